//! The lab's world without an agent: namespaces, routes, listeners and the prober, over
//! IPv4 and IPv6, and the life cycle of objects (apply, delete, re-create at once,
//! invalid input, down).

use weir_tests::lab::{manifest, netpol_world, Lab};

const EXTRA_POD: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: d, namespace: w, labels: {pod: d}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 8080, protocol: UDP}]
status:
  podIP: 10.9.0.7
"#;

#[test]
fn world_without_enforcement_connects_everything_and_follows_apply_and_delete() {
    let lab = Lab::new("world");
    lab.weir(&["up", "--without-agent", netpol_world().to_str().unwrap()])
        .unwrap();

    let pods: serde_json::Value =
        serde_json::from_str(&lab.weir(&["pods", "--output", "json"]).unwrap()).unwrap();
    let pods = pods.as_array().unwrap();
    assert_eq!(pods.len(), 9);
    assert_eq!(pods[0]["pod"], "x/a");
    assert_eq!(pods[0]["ip"], "10.244.0.2");
    assert_eq!(pods[0]["ipv6"], "fd00:10:244::2");

    for family in ["ipv4", "ipv6"] {
        let (dataplane, matrix) = lab.probe(&["--family", family]).unwrap();
        assert_eq!(dataplane, "none");
        // 9 sources × 8 targets × 2 ports × 3 protocols.
        assert_eq!(matrix.len(), 432, "{family}");
        let blocked: Vec<_> = matrix.iter().filter(|(_, c)| !**c).collect();
        assert!(
            blocked.is_empty(),
            "{family}: blocked without policy: {blocked:?}"
        );
    }

    // A new pod in a new namespace, with the address its manifest gives.
    let extra = manifest(&lab, "extra.yaml", EXTRA_POD);
    lab.weir(&["apply", extra.to_str().unwrap()]).unwrap();
    let (_, matrix) = lab.probe(&[]).unwrap();
    // Nine sources to w/d on its one port, and w/d to nine targets on six.
    assert_eq!(matrix.len(), 432 + 9 + 9 * 6);
    assert!(matrix[&("x/a".into(), "w/d".into(), 8080, "UDP".into())]);
    assert!(lab.weir(&["pods"]).unwrap().contains("10.9.0.7"));

    // An invalid object is refused, naming it, and changes nothing.
    let bad = manifest(
        &lab,
        "bad.yaml",
        "apiVersion: v1\nkind: Pod\nmetadata: {name: e, namespace: w}\nspec:\n  containers:\n  - name: c\n    ports: [{containerPort: 80, protocol: ICMP}]\n",
    );
    let out = lab.weir_raw(&["apply", bad.to_str().unwrap()]).unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Pod w/e") && stderr.contains("protocol"),
        "{stderr}"
    );
    assert!(!lab.weir(&["pods"]).unwrap().contains("w/e"));
    let objects = std::fs::read_to_string(lab.dir.join("objects.yaml")).unwrap();
    let bad_policy = manifest(
        &lab,
        "bad-policy.yaml",
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: bad, namespace: x}\nspec:\n  podSelector: {}\n  ingress: [{ports: [{port: 81, endPort: 80}]}]\n",
    );
    let out = lab
        .weir_raw(&["apply", bad_policy.to_str().unwrap()])
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("networkpolicy x/bad") && stderr.contains("endPort"),
        "{stderr}"
    );
    let unchanged = std::fs::read_to_string(lab.dir.join("objects.yaml")).unwrap();
    assert_eq!(objects, unchanged, "a refused object changed the lab");

    // Deleted while something still holds its namespace (an exiting process, a capture),
    // then re-created at once: the namespace, and the veth in it, outlive the delete, so
    // the lab must remove the veth itself or the new pod's (same name) is refused with
    // "File exists". CI's bridge_topology once met this through a slow namespace teardown.
    let (netns, _) = lab.pod("w/d");
    let held = std::fs::File::open(format!("/run/netns/{netns}")).expect("w/d's netns file");
    lab.weir(&["delete", extra.to_str().unwrap()]).unwrap();
    lab.weir(&["apply", extra.to_str().unwrap()])
        .expect("w/d re-created while its old namespace is still held");
    drop(held);
    let (_, matrix) = lab.probe(&[]).unwrap();
    assert!(matrix[&("x/a".into(), "w/d".into(), 8080, "UDP".into())]);

    lab.weir(&["delete", extra.to_str().unwrap()]).unwrap();
    let (_, matrix) = lab.probe(&[]).unwrap();
    assert_eq!(matrix.len(), 432);

    lab.weir(&["down"]).unwrap();
    lab.weir(&["down"]).unwrap();
    assert!(lab.weir_raw(&["probe"]).unwrap().status.code() != Some(0));
}

#[test]
fn up_with_an_invalid_manifest_builds_nothing() {
    let lab = Lab::new("badup");
    let bad = manifest(
        &lab,
        "bad.yaml",
        // A Service is a kind the lab knows; its ClusterIP outside the service range is not.
        "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: x}\nspec: {clusterIP: 192.168.0.1}\n",
    );
    let out = lab
        .weir_raw(&["up", "--without-agent", bad.to_str().unwrap()])
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Service"), "{stderr}");
    assert!(!lab.dir.join("state.json").exists());
    let pods = lab.weir_raw(&["pods"]).unwrap();
    assert!(!pods.status.success(), "a lab exists after a refused up");
}

/// `--enforcer` refuses what it cannot run before building anything, and says why: a
/// version deploy/peer-versions does not pin (naming the pinned ones), and a peer without
/// the lab's API server.
#[test]
fn a_peer_the_lab_cannot_run_is_refused_with_the_reason() {
    let lab = Lab::new("peerno");
    let world = netpol_world();
    let world = world.to_str().unwrap();
    for (args, reason) in [
        (
            vec!["up", "--enforcer", "azure-npm@v0.0.1", world],
            "deploy/peer-versions pins azure-npm at v1.8.12",
        ),
        (
            vec!["up", "--enforcer", "kube-router", "--api", "file", world],
            "--api file",
        ),
    ] {
        let out = lab.weir_raw(&args).unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} came up");
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
        assert!(!lab.dir.join("state.json").exists(), "{args:?} left a lab");
    }
}
