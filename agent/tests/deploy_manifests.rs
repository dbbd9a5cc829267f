//! deploy/ builds with kustomize and every object in it is a valid Kubernetes object of
//! its kind (no unknown or misspelt fields), with the properties the agent depends on.
//! Needs `kubectl` (Debian package kubernetes-client).

use std::path::PathBuf;
use std::process::Command;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde::de::DeserializeOwned;
use serde::Serialize;

fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn kustomize() -> Vec<serde_yaml::Value> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(deploy_dir())
        .output()
        .expect("prerequisite missing: kubectl (apt-get install kubernetes-client)");
    assert!(
        out.status.success(),
        "kubectl kustomize deploy/ failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("kustomize output is UTF-8");
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("kustomize output is YAML"))
        .collect()
}

/// Parses `value` as `T` and checks that nothing was lost: a field the type does not
/// know (a typo, a wrong indentation) would vanish in the round trip.
fn typed<T: DeserializeOwned + Serialize>(value: &serde_yaml::Value) -> T {
    let json: serde_json::Value = serde_json::to_value(value).unwrap();
    let object: T = serde_json::from_value(json.clone())
        .unwrap_or_else(|e| panic!("not a valid {}: {e}", std::any::type_name::<T>()));
    let back = serde_json::to_value(&object).unwrap();
    assert_eq!(
        back, json,
        "fields lost in the round trip: unknown or misplaced fields"
    );
    object
}

fn find<'a>(docs: &'a [serde_yaml::Value], kind: &str) -> &'a serde_yaml::Value {
    let found: Vec<_> = docs
        .iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind}");
    found[0]
}

#[test]
fn deploy_builds_and_every_object_is_valid() {
    let docs = kustomize();
    let kinds: Vec<_> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(kinds.len(), 4, "{kinds:?}");

    let sa: ServiceAccount = typed(find(&docs, "ServiceAccount"));
    let role: ClusterRole = typed(find(&docs, "ClusterRole"));
    let binding: ClusterRoleBinding = typed(find(&docs, "ClusterRoleBinding"));
    let ds: DaemonSet = typed(find(&docs, "DaemonSet"));

    let sa_name = sa.metadata.name.clone().unwrap();
    let sa_ns = sa.metadata.namespace.clone().unwrap();

    // The binding ties this role to this service account.
    assert_eq!(binding.role_ref.name, role.metadata.name.clone().unwrap());
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    let subject = &binding.subjects.as_ref().unwrap()[0];
    assert_eq!(
        (subject.name.as_str(), subject.namespace.as_deref()),
        (sa_name.as_str(), Some(sa_ns.as_str()))
    );

    // Least privilege: no wildcards; writes only nodes/status patch and events. (That the
    // role is enough and each grant used is proven against the real server in
    // tests/tests/cluster_mode.rs.)
    for rule in role.rules.as_ref().unwrap() {
        let resources = rule.resources.clone().unwrap_or_default();
        for list in [&rule.verbs, &resources] {
            assert!(!list.iter().any(|v| v == "*"), "wildcard in {rule:?}");
        }
        for verb in &rule.verbs {
            let read = matches!(verb.as_str(), "list" | "watch");
            let allowed_write = (resources == ["nodes/status"] && verb == "patch")
                || (resources == ["events"] && matches!(verb.as_str(), "create" | "patch"));
            assert!(
                read || allowed_write,
                "verb {verb} on {resources:?} is more than the agent needs"
            );
        }
    }
    let readable = |res: &str| {
        role.rules.as_ref().unwrap().iter().any(|r| {
            r.resources
                .as_ref()
                .is_some_and(|x| x.iter().any(|x| x == res))
                && ["list", "watch"]
                    .iter()
                    .all(|v| r.verbs.iter().any(|x| x == v))
        })
    };
    for res in [
        "pods",
        "namespaces",
        "networkpolicies",
        "nodes",
        "clusternetworkpolicies",
    ] {
        assert!(readable(res), "the agent must list and watch {res}");
    }

    // The DaemonSet: every Linux node, in the node's network namespace.
    assert_eq!(ds.metadata.namespace.as_deref(), Some(sa_ns.as_str()));
    let pod = ds.spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some(sa_name.as_str()));
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = pod.tolerations.as_ref().unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "must tolerate every taint"
    );
    assert_eq!(
        pod.node_selector
            .as_ref()
            .and_then(|s| s.get("kubernetes.io/os"))
            .map(String::as_str),
        Some("linux"),
        "Linux nodes only"
    );
    // Least privilege: not privileged, these capabilities and no others (each is needed:
    // tests/tests/agent_image.rs and the conformance cells run the agent with this spec).
    let c = &pod.containers[0];
    let security = c.security_context.as_ref().unwrap();
    assert_eq!(security.privileged, Some(false));
    let caps = security.capabilities.as_ref().unwrap();
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    let mut added = caps.add.clone().unwrap();
    added.sort();
    assert_eq!(
        added,
        [
            "BPF",
            "NET_ADMIN",
            "NET_RAW",
            "PERFMON",
            "SYS_ADMIN",
            "SYS_MODULE",
            "SYS_RESOURCE"
        ]
    );
    assert_eq!(c.args.as_deref(), Some(&["agent".to_string()][..]));
    let node_name = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME env");
    let field = node_name
        .value_from
        .as_ref()
        .unwrap()
        .field_ref
        .as_ref()
        .unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
    let requests = c.resources.as_ref().unwrap().requests.as_ref().unwrap();
    assert!(requests.contains_key("cpu") && requests.contains_key("memory"));
    let mounts: Vec<_> = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .map(|m| m.mount_path.as_str())
        .collect();
    for path in [
        "/sys/fs/bpf",
        "/run/xtables.lock",
        "/lib/modules",
        "/run/netns",
    ] {
        assert!(mounts.contains(&path), "mount {path} missing: {mounts:?}");
    }
    // Pods' network namespaces (bridge ports are found through them), including those of
    // pods started after the agent.
    let netns = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.mount_path == "/run/netns")
        .unwrap();
    assert_eq!(
        netns.mount_propagation.as_deref(),
        Some("HostToContainer"),
        "/run/netns must follow the host's mounts"
    );
    let volumes = pod.volumes.as_ref().unwrap();
    for m in c.volume_mounts.as_ref().unwrap() {
        let v = volumes
            .iter()
            .find(|v| v.name == m.name)
            .unwrap_or_else(|| panic!("volume {} undefined", m.name));
        assert_eq!(
            v.host_path.as_ref().map(|h| h.path.as_str()),
            Some(m.mount_path.as_str())
        );
    }
    let probe_paths: Vec<_> = [&c.liveness_probe, &c.readiness_probe]
        .iter()
        .map(|p| {
            p.as_ref()
                .unwrap()
                .http_get
                .as_ref()
                .unwrap()
                .path
                .clone()
                .unwrap()
        })
        .collect();
    assert_eq!(probe_paths, ["/healthz", "/readyz"]);
}

/// deploy/crds/ is network-policy-api v0.2.0's standard-channel CRD, byte for byte (its
/// kustomization names the source and digest), and the one the agent's types read.
#[test]
fn the_crd_is_upstream_v0_2_0_standard() {
    let path = deploy_dir().join("crds/policy.networking.k8s.io_clusternetworkpolicies.yaml");
    let sum = Command::new("sha256sum")
        .arg(&path)
        .output()
        .expect("prerequisite missing: sha256sum (coreutils)");
    assert!(
        String::from_utf8_lossy(&sum.stdout)
            .starts_with("5df2cdcface11718bd332fd88b4cb5fb3adf63426eaffdcbef4d33aac6836bef "),
        "{} is not v0.2.0's: {}",
        path.display(),
        String::from_utf8_lossy(&sum.stdout)
    );
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(deploy_dir().join("crds"))
        .output()
        .expect("prerequisite missing: kubectl (apt-get install kubernetes-client)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition =
        serde_yaml::from_slice(&out.stdout).unwrap();
    assert_eq!(crd.spec.group, "policy.networking.k8s.io");
    assert_eq!(crd.spec.names.kind, "ClusterNetworkPolicy");
    assert_eq!(crd.spec.scope, "Cluster");
    let versions: Vec<_> = crd.spec.versions.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(versions, ["v1alpha2"]);
}
