//! `weir explain` on the e2e world: the verdict and the deciding policies and rules, in
//! text and JSON, for upstream scenarios.

// The engine tests' world (policy/tests/support), shared rather than copied.
#[path = "../../policy/tests/support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use support::{policy, world_yaml};

/// A directory for this test's manifests, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("weir-explain-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write manifest");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn explain(manifests: &[PathBuf], args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_weir"))
        .arg("explain")
        .arg("--manifests")
        .args(manifests)
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("run weir explain");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(manifests: &[PathBuf], from: &str, to: &str, port: &str) -> Value {
    let (ok, stdout, stderr) = explain(
        manifests,
        &[
            "--from", from, "--to", to, "--port", port, "--output", "json",
        ],
    );
    assert!(ok, "{stderr}");
    serde_json::from_str(&stdout).expect("JSON output")
}

fn rules(side: &Value) -> Vec<String> {
    side["allowed_by"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            format!(
                "{} {}",
                r["policy"].as_str().unwrap(),
                r["rule"].as_str().unwrap()
            )
        })
        .collect()
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect()
}

#[test]
fn explains_upstream_scenarios_with_the_deciding_rules() {
    let dir = TempDir::new("scenarios");
    let world = dir.write("world.yaml", &world_yaml());
    let policies = dir.write(
        "policies.yaml",
        &[
            policy("x", "deny-all", "podSelector: {}\npolicyTypes: [Ingress]"),
            policy("x", "allow-b", "podSelector: {matchLabels: {pod: a}}\ningress:\n- from: [{podSelector: {matchLabels: {pod: b}}}]\n  ports: [{port: 80}]\n- from: [{namespaceSelector: {matchLabels: {ns: y}}}]\n  ports: [{port: serve-81-udp, protocol: UDP}]"),
            policy("z", "deny-egress-a", "podSelector: {matchLabels: {pod: a}}\npolicyTypes: [Egress]"),
            policy("y", "bad", "podSelector: {}\ningress:\n- ports: [{port: 80, endPort: 70}]"),
        ]
        .join("---\n"),
    );
    let files = [world, policies];

    // Allowed by one rule; the source is not isolated.
    let v = json(&files, "x/b", "x/a", "80");
    assert_eq!(v["allowed"], true);
    assert_eq!(v["egress"]["isolated"], false);
    assert_eq!(
        strings(&v["ingress"]["isolated_by"]),
        ["x/allow-b", "x/deny-all"]
    );
    assert_eq!(rules(&v["ingress"]), ["x/allow-b ingress[0]"]);

    // Same pods, port not allowed: denied, isolated by both, no rule.
    let v = json(&files, "x/b", "x/a", "81");
    assert_eq!(v["allowed"], false);
    assert_eq!(v["ingress"]["allowed_by"], Value::Array(vec![]));

    // Named port resolved on the destination, over UDP, from another namespace.
    let v = json(&files, "y/c", "x/a", "81/udp");
    assert_eq!(v["allowed"], true);
    assert_eq!(rules(&v["ingress"]), ["x/allow-b ingress[1]"]);
    assert_eq!(v["ingress"]["allowed_by"][0]["ports"], "UDP/81");

    // Denied at the source's egress although the destination does not isolate.
    let v = json(&files, "z/a", "y/a", "80/sctp");
    assert_eq!(v["allowed"], false);
    assert_eq!(v["egress"]["allowed"], false);
    assert_eq!(strings(&v["egress"]["isolated_by"]), ["z/deny-egress-a"]);
    assert_eq!(v["ingress"]["isolated"], false);

    // To an address: the pod that owns it is found; IPv6 works the same.
    let v = json(&files, "x/c", "fd00::1:2", "80");
    assert_eq!(v["to"], "x/b");
    assert_eq!(v["allowed"], false);
    let v = json(&files, "x/c", "192.0.2.1", "80");
    assert_eq!(v["to"], "192.0.2.1");
    assert_eq!(v["ingress"]["enforced"], false);
    assert_eq!(v["allowed"], true);

    // Text output names the verdict, the isolating policies and the rule.
    let (ok, text, stderr) = explain(
        &files,
        &["--from", "x/b", "--to", "x/a", "--port", "80/TCP"],
    );
    assert!(ok, "{stderr}");
    assert!(
        text.starts_with("x/b (10.0.1.2) -> x/a (10.0.1.1) port 80/TCP: ALLOWED\n"),
        "{text}"
    );
    assert!(
        text.contains("egress of x/b: allowed, not isolated"),
        "{text}"
    );
    assert!(
        text.contains("isolated by: x/allow-b, x/deny-all"),
        "{text}"
    );
    assert!(
        text.contains(
            "allowed by: x/allow-b ingress[0]: peer pods(namespace=x; pods={pod in (b)}) on TCP/80"
        ),
        "{text}"
    );
    // The invalid policy is reported, not applied.
    assert!(
        stderr.contains(
            "ignored networkpolicy y/bad: spec.ingress[0].ports[0].endPort: must be >= port (80)"
        ),
        "{stderr}"
    );
}

#[test]
fn bad_arguments_are_clear_errors() {
    let dir = TempDir::new("errors");
    let world = [dir.write("world.yaml", &world_yaml())];
    let cases = [
        (
            vec!["--from", "x/q", "--to", "x/a", "--port", "80"],
            "pod x/q is not in the manifests",
        ),
        (
            vec!["--from", "x/a", "--to", "x", "--port", "80"],
            "neither NAMESPACE/POD nor an IP address",
        ),
        (
            vec!["--from", "x/a", "--to", "x/b", "--port", "80/icmp"],
            "unsupported protocol \"ICMP\"",
        ),
        (
            vec!["--from", "x/a", "--to", "x/b", "--port", "0"],
            "not a port number",
        ),
    ];
    for (args, message) in cases {
        let (ok, _, stderr) = explain(&world, &args);
        assert!(!ok && stderr.contains(message), "{args:?}: {stderr}");
    }
    let missing = [dir.0.join("missing.yaml")];
    let (ok, _, stderr) = explain(&missing, &["--from", "x/a", "--to", "x/b", "--port", "80"]);
    assert!(!ok && stderr.contains("missing.yaml"), "{stderr}");
}

/// A reader that went away (`weir explain ... | head -1`) ends the command quietly: exit 0,
/// no panic. The pipe's read end is closed before weir writes, so the write must fail.
#[test]
fn output_to_a_closed_pipe_ends_quietly() {
    let dir = TempDir::new("epipe");
    let world = dir.write("world.yaml", &world_yaml());
    for output in ["text", "json"] {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(["explain", "--manifests"])
            .arg(&world)
            .args([
                "--from", "x/a", "--to", "x/b", "--port", "80", "--output", output,
            ])
            .stdout(writer)
            .env_remove("RUST_BACKTRACE")
            .output()
            .expect("run weir explain");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && !stderr.contains("panicked"),
            "--output {output} to a closed pipe: {:?}, stderr: {stderr}",
            out.status
        );
    }
}
