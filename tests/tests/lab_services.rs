//! Services through the real kube-proxy in the lab's node namespace (`weir-lab up --proxy
//! iptables|nftables`, server mode), on both dataplanes, proven with real packets: a pod's
//! egress to a Service must be judged as egress to the pod behind it (after kube-proxy's
//! DNAT), so probes via the ClusterIP give the pod-level verdicts.
//!
//! - "DNS only to kube-dns pods": the client's egress allows only kube-system's
//!   `k8s-app: kube-dns` pods on 53/UDP and 53/TCP; DNS-like probes through the kube-dns
//!   ClusterIP (named targetPorts) pass, egress to a Service whose backend it may not reach
//!   is blocked, a pod without a policy reaches that Service (kube-proxy forwards), and
//!   every verdict via service equals the verdict via pod.
//! - On a kernel with IPVS (Debian's, in `cargo xtask kernels`), the same DNS checks run
//!   in ipvs mode on both dataplanes; without it (the host's), `--proxy ipvs` fails at once
//!   naming the missing kernel support.
//! - (The upstream netpol scenarios through kube-proxy, `--services auto`, via pod and via
//!   service, are cells of tests/tests/netpol_conformance.rs.)

use std::time::{Duration, Instant};

use weir_tests::lab::{manifest, Lab, Matrix, Routes};

/// kube-system's DNS (a named UDP and TCP port behind a fixed ClusterIP), an app namespace
/// with a DNS-only client, an unrestricted pod, a web Service (NodePort, named targetPort)
/// and a pod that no Service reaches.
const DNS_WORLD: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  containers:
  - name: coredns
    ports:
    - {containerPort: 53, protocol: UDP, name: dns}
    - {containerPort: 53, protocol: TCP, name: dns-tcp}
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system}
spec:
  clusterIP: 10.96.0.10
  selector: {k8s-app: kube-dns}
  ports:
  - {name: dns, port: 53, protocol: UDP, targetPort: dns}
  - {name: dns-tcp, port: 53, protocol: TCP, targetPort: dns-tcp}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: app, labels: {app: client}}
spec: {containers: [{name: c}]}
---
apiVersion: v1
kind: Pod
metadata: {name: other, namespace: app, labels: {app: other}}
spec: {containers: [{name: c}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: app, labels: {app: web}}
spec:
  containers:
  - name: web
    ports: [{containerPort: 8080, name: http}]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: app}
spec:
  type: NodePort
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: http}]
---
apiVersion: v1
kind: Pod
metadata: {name: metrics, namespace: app, labels: {app: metrics}}
spec:
  containers:
  - name: m
    ports: [{containerPort: 9090}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: dns-only, namespace: app}
spec:
  podSelector: {matchLabels: {app: client}}
  policyTypes: [Egress]
  egress:
  - to:
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: kube-system}}
      podSelector: {matchLabels: {k8s-app: kube-dns}}
    ports:
    - {port: 53, protocol: UDP}
    - {port: 53, protocol: TCP}
"#;

/// The web Service of DNS_WORLD, to delete and apply again.
const WEB_SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: app}\nspec:\n  type: NodePort\n  selector: {app: web}\n  ports: [{name: http, port: 80, targetPort: http}]\n";

fn key(from: &str, to: &str, port: u16, protocol: &str) -> (String, String, u16, String) {
    (from.into(), to.into(), port, protocol.into())
}

/// Every check of the DNS world on one probe; the failures, described.
fn dns_failures(routes: &Routes) -> Vec<String> {
    let mut failures = Vec::new();
    let mut expect = |what: &str, matrix: &Matrix, k: (String, String, u16, String), want| {
        match matrix.get(&k) {
            Some(got) if *got == want => {}
            got => failures.push(format!(
                "{what}: {} -> {} {}/{}: expected {}, got {got:?}",
                k.0,
                k.1,
                k.2,
                k.3,
                if want { "connected" } else { "blocked" }
            )),
        }
    };
    for proto in ["UDP", "TCP"] {
        let k = key("app/client", "kube-system/coredns", 53, proto);
        expect(
            "DNS via the kube-dns ClusterIP",
            &routes.service,
            k.clone(),
            true,
        );
        expect("DNS to the kube-dns pod", &routes.pod, k, true);
    }
    let web = key("app/client", "app/web", 8080, "TCP");
    expect(
        "egress via a denied Service",
        &routes.service,
        web.clone(),
        false,
    );
    expect("egress to a denied pod", &routes.pod, web, false);
    let control = key("app/other", "app/web", 8080, "TCP");
    expect(
        "an unrestricted pod via the web Service (kube-proxy forwards)",
        &routes.service,
        control,
        true,
    );
    for (k, via_pod) in &routes.pod {
        if k.1 == "app/metrics" {
            continue;
        }
        match routes.service.get(k) {
            Some(via_service) if via_service == via_pod => {}
            other => failures.push(format!(
                "{} -> {} {}/{}: via pod {via_pod}, via service {other:?}",
                k.0, k.1, k.2, k.3
            )),
        }
    }
    if routes.service.keys().any(|k| k.1 == "app/metrics") {
        failures.push("app/metrics has no Service but was probed via service".into());
    }
    if routes.skipped != ["app/metrics 9090/TCP"] {
        failures.push(format!(
            "skipped targets: expected [app/metrics 9090/TCP], got {:?}",
            routes.skipped
        ));
    }
    failures
}

fn dns_only_through_kube_proxy(proxy: &str, dataplane: &str) {
    let lab = Lab::new(&format!("svc-{proxy}-{dataplane}"));
    let world = manifest(&lab, "dns-world.yaml", DNS_WORLD);
    let started = Instant::now();
    lab.weir(&[
        "up",
        "--dataplane",
        dataplane,
        "--proxy",
        proxy,
        world.to_str().unwrap(),
    ])
    .unwrap_or_else(|e| panic!("{dataplane}, kube-proxy {proxy}: lab up: {e}"));
    eprintln!(
        "{dataplane}, kube-proxy {proxy}: lab up in {:.1?}",
        started.elapsed()
    );
    let routes = lab.probe_routes("both").expect("probe --via both");
    assert_eq!(
        routes.dataplane, dataplane,
        "the agent enforces another dataplane"
    );
    let mut failures = dns_failures(&routes);

    // The Service follows delete and apply: without it, web is skipped (not blocked);
    // with it back, kube-proxy forwards to web again.
    let web = manifest(&lab, "web-service.yaml", WEB_SERVICE);
    lab.weir(&["delete", web.to_str().unwrap()])
        .expect("delete the web Service");
    let without = lab.probe_routes("service").expect("probe --via service");
    if !without.skipped.contains(&"app/web 8080/TCP".to_string())
        || without.service.keys().any(|k| k.1 == "app/web")
    {
        failures.push(format!(
            "without its Service, app/web was probed via service (skipped: {:?})",
            without.skipped
        ));
    }
    lab.weir(&["apply", web.to_str().unwrap()])
        .expect("apply the web Service again");
    let again = lab.probe_routes("service").expect("probe --via service");
    let control = key("app/other", "app/web", 8080, "TCP");
    if again.service.get(&control) != Some(&true) {
        failures.push(format!(
            "the web Service applied again: app/other -> app/web via service {:?}",
            again.service.get(&control)
        ));
    }

    // Least privilege: system:node-proxier was all kube-proxy needed.
    let log = std::fs::read_to_string(lab.dir.join("kube-proxy.log")).expect("kube-proxy.log");
    if let Some(line) = log.lines().find(|l| l.contains("forbidden")) {
        failures.push(format!("kube-proxy was refused a request: {line}"));
    }
    assert!(
        failures.is_empty(),
        "{dataplane}, kube-proxy {proxy}: {} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn dns_only_egress_through_kube_proxy_iptables_on_iptables() {
    dns_only_through_kube_proxy("iptables", "iptables");
}

#[test]
fn dns_only_egress_through_kube_proxy_iptables_on_ebpf() {
    dns_only_through_kube_proxy("iptables", "ebpf");
}

/// On a kernel kube-proxy's nftables mode starts on (5.13 and later): the DNS checks in
/// nftables mode. Before 5.13 (Debian's 5.10, `cargo xtask kernels`): `--proxy nftables`
/// fails at once naming the kernel it needs, instead of kube-proxy exiting mid-start.
#[test]
fn dns_only_egress_through_kube_proxy_nftables_on_iptables() {
    nftables_or_its_refusal("iptables");
}

#[test]
fn dns_only_egress_through_kube_proxy_nftables_on_ebpf() {
    nftables_or_its_refusal("ebpf");
}

fn nftables_or_its_refusal(dataplane: &str) {
    if weir_lab::proxy::kernel_runs_nftables_mode() {
        dns_only_through_kube_proxy("nftables", dataplane);
        return;
    }
    refused_at_once("nftables", dataplane, "5.13");
}

/// On a kernel with IPVS (Debian's, `cargo xtask kernels`): the DNS checks in ipvs mode,
/// where Service traffic goes INPUT → IPVS → OUTPUT, never FORWARD. Without it: `--proxy
/// ipvs` fails at once naming what is missing.
#[test]
fn dns_only_egress_through_kube_proxy_ipvs_on_iptables() {
    ipvs_or_its_refusal("iptables");
}

#[test]
fn dns_only_egress_through_kube_proxy_ipvs_on_ebpf() {
    ipvs_or_its_refusal("ebpf");
}

/// `weir-lab up --proxy <proxy>` on a kernel that mode cannot run: it fails within 15 s,
/// naming the flag and `what` the kernel lacks, and leaves no lab behind.
fn refused_at_once(proxy: &str, dataplane: &str, what: &str) -> Lab {
    let lab = Lab::new(&format!("svc-{proxy}-{dataplane}"));
    let world = manifest(&lab, "dns-world.yaml", DNS_WORLD);
    let started = Instant::now();
    let out = lab
        .weir_raw(&[
            "up",
            "--dataplane",
            dataplane,
            "--proxy",
            proxy,
            world.to_str().unwrap(),
        ])
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "up --proxy {proxy} succeeded on a kernel that mode cannot run"
    );
    assert!(
        stderr.contains(&format!("--proxy {proxy}")) && stderr.contains(what),
        "the error does not name what the kernel lacks ({what}): {stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the error took {:?}",
        started.elapsed()
    );
    assert!(
        !lab.dir.join("state.json").exists(),
        "a failed up left a lab behind"
    );
    lab
}

fn ipvs_or_its_refusal(dataplane: &str) {
    if weir_tests::kernel_has_ipvs() {
        eprintln!("this kernel has IPVS and dummy devices: running the DNS checks in ipvs mode");
        dns_only_through_kube_proxy("ipvs", dataplane);
        return;
    }
    let lab = refused_at_once("ipvs", dataplane, "CONFIG_IP_VS");
    let world = lab.dir.join("dns-world.yaml");
    // And --proxy with an explicit --api file is refused, naming both.
    let out = lab
        .weir_raw(&[
            "up",
            "--api",
            "file",
            "--proxy",
            "iptables",
            world.to_str().unwrap(),
        ])
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--api file"),
        "{stderr}"
    );
}
