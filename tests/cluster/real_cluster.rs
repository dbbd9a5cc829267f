//! weir as the DaemonSet it ships as, on a real two-node cluster (`weir-lab cluster`):
//! kubelets start its pods from deploy/'s own spec (`kubectl apply -k` of an overlay that
//! only points the image at the one imported into every node), the ptp CNI plugin wires
//! the test pods, and agnhost `connect` between pods on different nodes shows that a
//! default-deny plus an allow is enforced, on the eBPF and then the iptables dataplane
//! (switched with the `weir.io/dataplane` node label). Tear-down must leave nothing.
//!
//! Needs root, the components of `cargo xtask setup` and `cargo xtask cluster
//! --build-only`, and weir's image (`cargo xtask image --dev`, or `cargo xtask image`).
//! Compiled only with the `real-cluster` feature (see tests/Cargo.toml).
#![cfg(feature = "real-cluster")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

const NAME: &str = "wct";
const NS: &str = "weir-e2e";

struct Cluster {
    dir: PathBuf,
    torn_down: bool,
}

impl Cluster {
    fn lab(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(weir_tests::weir_bin::lab_path().map_err(|e| e.to_string())?)
            .arg("cluster")
            .arg("--dir")
            .arg(&self.dir)
            .args(args)
            .output()
            .map_err(|e| format!("weir-lab cluster {args:?}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "weir-lab cluster {args:?} failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        let mut all = vec!["kubectl", "--timeout-secs", "120", "--"];
        all.extend_from_slice(args);
        self.lab(&all)
    }

    fn kubectl_json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let out = self.kubectl(&all).unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("kubectl {args:?}: {e}: {out}"))
    }

    fn down(&mut self) -> Value {
        self.torn_down = true;
        let out = self.lab(&["down"]).unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("down printed {e}: {out}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !self.torn_down {
            if let Err(e) = self.lab(&["down"]) {
                eprintln!("tearing the cluster down after a failure: {e}");
            }
        }
    }
}

/// The image archive and digest `cargo xtask image [--dev]` wrote.
fn image() -> (PathBuf, String) {
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    for d in ["image-dev", "image"] {
        let dir = target.join(d);
        let digest = std::fs::read_to_string(dir.join("digest")).ok();
        let archive = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with(".oci.tar"));
        if let (Some(digest), Some(archive)) = (digest, archive) {
            return (archive, digest.trim().to_string());
        }
    }
    panic!("prerequisite missing: weir's image (build it with `cargo xtask image --dev`)");
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) if Instant::now() > deadline => {
                panic!("{what}: not after {timeout:?}: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_secs(1)),
        }
    }
}

fn pod(name: &str, node: &str, role: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {NS}
  labels:
    role: {role}
spec:
  nodeName: {node}
  terminationGracePeriodSeconds: 0
  containers:
  - name: agnhost
    image: registry.k8s.io/agnhost:2.56
    imagePullPolicy: Never
    args: ["netexec", "--http-port=8080"]
    ports:
    - containerPort: 8080
---
"#
    )
}

const POLICIES: &str = r#"apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: default-deny
  namespace: weir-e2e
spec:
  podSelector: {}
  policyTypes: ["Ingress"]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: allow-client-to-server
  namespace: weir-e2e
spec:
  podSelector:
    matchLabels:
      role: server
  policyTypes: ["Ingress"]
  ingress:
  - from:
    - podSelector:
        matchLabels:
          role: client
    ports:
    - port: 8080
      protocol: TCP
"#;

/// Whether `from` connects to `ip`:8080: agnhost connect exits 0, or reports TIMEOUT or
/// REFUSED (a drop or a reject). Anything else (exec failing, say) is an error, so a
/// broken probe never passes for a denied connection.
fn connects(cluster: &Cluster, from: &str, ip: &str) -> Result<bool, String> {
    match cluster.kubectl(&[
        "exec",
        "-n",
        NS,
        from,
        "--",
        "/agnhost",
        "connect",
        &format!("{ip}:8080"),
        "--timeout=3s",
    ]) {
        Ok(_) => Ok(true),
        Err(e) if e.contains("TIMEOUT") || e.contains("REFUSED") => Ok(false),
        Err(e) => Err(e),
    }
}

/// Waits until every verdict is as expected (the agent converges after the change).
fn expect(cluster: &Cluster, server_ip: &str, allowed: &[&str], denied: &[&str], label: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    wait_for(label, Duration::from_secs(120), || {
        let mut wrong = Vec::new();
        for from in allowed {
            if !connects(cluster, from, server_ip)? {
                wrong.push(format!("{from} could not connect"));
            }
        }
        for from in denied {
            if connects(cluster, from, server_ip)? {
                wrong.push(format!("{from} connected"));
            }
        }
        if wrong.is_empty() {
            Ok(())
        } else if Instant::now() > deadline {
            Err(format!("{}\n{}", wrong.join(", "), diagnostics(cluster)))
        } else {
            Err(wrong.join(", "))
        }
    });
}

/// What each node's weir reports, and the end of its log: printed with a failure.
fn diagnostics(cluster: &Cluster) -> String {
    let mut out = String::new();
    for p in weir_pods(cluster) {
        let name = p["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let status = cluster.kubectl(&[
            "exec",
            "-n",
            "kube-system",
            &name,
            "--",
            "/usr/local/bin/weir",
            "status",
        ]);
        let log = cluster.kubectl(&["logs", "-n", "kube-system", &name, "--tail=30"]);
        out += &format!(
            "--- {name} on {}: status\n{}\n--- log\n{}\n",
            p["spec"]["nodeName"],
            status.unwrap_or_else(|e| e),
            log.unwrap_or_else(|e| e)
        );
    }
    out += &cluster
        .kubectl(&["get", "pods", "-A", "-o", "wide", "--show-labels"])
        .unwrap_or_else(|e| e);
    out
}

fn weir_pods(cluster: &Cluster) -> Vec<Value> {
    cluster.kubectl_json(&[
        "get",
        "pods",
        "-n",
        "kube-system",
        "-l",
        "app.kubernetes.io/name=weir",
    ])["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Waits until each node's weir pod reports `dataplane` converged (`weir status` in it).
fn wait_dataplane(cluster: &Cluster, dataplane: &str) {
    wait_for(
        &format!("weir on every node converged on {dataplane}"),
        Duration::from_secs(180),
        || {
            let pods = weir_pods(cluster);
            if pods.len() != 2 {
                return Err(format!("{} weir pods", pods.len()));
            }
            for p in &pods {
                let name = p["metadata"]["name"].as_str().unwrap_or_default();
                let out = cluster.kubectl(&[
                    "exec",
                    "-n",
                    "kube-system",
                    name,
                    "--",
                    "/usr/local/bin/weir",
                    "status",
                    "--output",
                    "json",
                ])?;
                let status: Value = serde_json::from_str(&out).map_err(|e| e.to_string())?;
                if status["dataplane"] != dataplane || status["converged"] != true {
                    return Err(format!("{name}: {status}"));
                }
            }
            Ok(())
        },
    );
}

#[test]
fn weir_daemonset_enforces_on_kubelet_nodes_on_both_dataplanes() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "prerequisite missing: root (namespaces, mounts, cgroups)"
    );
    let (archive, digest) = image();
    let dir = PathBuf::from(format!("/var/tmp/weir-cluster-test-{}", std::process::id()));
    let mut cluster = Cluster {
        dir: dir.clone(),
        torn_down: false,
    };
    let up = cluster
        .lab(&[
            "up",
            "--nodes",
            "2",
            "--name",
            NAME,
            "--image",
            archive.to_str().unwrap(),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
    let up: Value = serde_json::from_str(&up).unwrap();
    let nodes: Vec<String> = up["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(nodes.len(), 2, "{up}");
    for n in &nodes {
        cluster
            .kubectl(&["label", "node", n, "--overwrite", "weir.io/dataplane=ebpf"])
            .unwrap_or_else(|e| panic!("{e}"));
    }

    // deploy/ unchanged, its image pointed at the one every node has imported.
    let overlay = dir.join("overlay");
    std::fs::create_dir_all(&overlay).unwrap();
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .canonicalize()
        .unwrap();
    // kustomize takes only relative paths to a base.
    let up_to_root = "../".repeat(overlay.components().count() - 1);
    let deploy = format!(
        "{up_to_root}{}",
        deploy.display().to_string().trim_start_matches('/')
    );
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- {deploy}\nimages:\n- name: registry.example/weir\n  newName: docker.io/library/weir\n  digest: {digest}\n"
        ),
    )
    .unwrap();
    cluster
        .kubectl(&["apply", "-k", overlay.to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{e}"));
    wait_for(
        "weir's DaemonSet pods Running and Ready on both nodes",
        Duration::from_secs(180),
        || {
            let pods = weir_pods(&cluster);
            let ready = pods
                .iter()
                .filter(|p| {
                    p["status"]["phase"] == "Running"
                        && p["status"]["conditions"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
                .count();
            (ready == 2).then_some(()).ok_or_else(|| {
                let pods = cluster
                    .kubectl(&["get", "pods", "-A", "-o", "wide"])
                    .unwrap_or_default();
                format!("{ready} of 2 ready:\n{pods}")
            })
        },
    );
    wait_dataplane(&cluster, "ebpf");

    // A server on node 1; clients on node 2 (across nodes) and node 1 (same node).
    let mut manifest = format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NS}\n---\n");
    manifest += &pod("server", &nodes[0], "server");
    manifest += &pod("client", &nodes[1], "client");
    manifest += &pod("other", &nodes[1], "other");
    manifest += &pod("other-local", &nodes[0], "other");
    let file = dir.join("pods.yaml");
    std::fs::write(&file, manifest).unwrap();
    cluster
        .kubectl(&["apply", "-f", file.to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{e}"));
    cluster
        .kubectl(&[
            "wait",
            "-n",
            NS,
            "--for=condition=Ready",
            "pod",
            "--all",
            "--timeout=120s",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
    let server = cluster.kubectl_json(&["get", "pod", "-n", NS, "server"]);
    let server_ip = server["status"]["podIP"].as_str().unwrap().to_string();

    expect(
        &cluster,
        &server_ip,
        &["client", "other", "other-local"],
        &[],
        "no policy: every pod connects",
    );
    let policies = dir.join("policies.yaml");
    std::fs::write(&policies, POLICIES).unwrap();
    cluster
        .kubectl(&["apply", "-f", policies.to_str().unwrap()])
        .unwrap_or_else(|e| panic!("{e}"));
    expect(
        &cluster,
        &server_ip,
        &["client"],
        &["other", "other-local"],
        "ebpf: default-deny plus allow",
    );

    for n in &nodes {
        cluster
            .kubectl(&[
                "label",
                "node",
                n,
                "--overwrite",
                "weir.io/dataplane=iptables",
            ])
            .unwrap_or_else(|e| panic!("{e}"));
    }
    wait_dataplane(&cluster, "iptables");
    expect(
        &cluster,
        &server_ip,
        &["client"],
        &["other", "other-local"],
        "iptables: default-deny plus allow",
    );

    let report = cluster.down();
    assert_eq!(report["left"], serde_json::json!([]), "{report}");
    assert!(!dir.exists(), "{} is left", dir.display());
    for n in ["wct-cp", "wct-node-1", "wct-node-2"] {
        assert!(
            !Path::new("/run/netns").join(n).exists(),
            "network namespace {n} is left"
        );
    }
}
