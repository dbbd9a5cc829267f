//! The real `weir agent` inside the bench node's namespace, in file mode (the world is a
//! manifest file it polls) or cluster mode (the world is on the real kube-apiserver, which
//! runs with etcd in the node's namespace, and the agent watches it with the DaemonSet's
//! ServiceAccount): started cold, waited on through its status file, measured through
//! /proc, stopped (with its control plane, and its BPF pins removed) when dropped.
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::netns::Netns;
use super::world::{World, NODE_NAME};

/// Where the agent serves /metrics, inside its node's namespace.
const METRICS_ADDR: &str = "127.0.0.1:9402";
/// How often the agent checks the manifest file (the bench's notes quote it).
pub const POLL_MS: u64 = 10;

/// What enforces a setup: weir on one of its dataplanes, or a peer in its place
/// (`weir-bench --peers`; deploy/peer-versions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dataplane {
    Ebpf,
    Iptables,
    /// kube-router's network-policy controller alone, against the bench's API server.
    KubeRouter,
    /// Azure NPM (its v2 dataplane: iptables and ipset), against the bench's API server.
    AzureNpm,
}

impl Dataplane {
    pub const ALL: [Dataplane; 2] = [Dataplane::Ebpf, Dataplane::Iptables];

    pub fn as_str(self) -> &'static str {
        match self {
            Dataplane::Ebpf => "ebpf",
            Dataplane::Iptables => "iptables",
            Dataplane::KubeRouter => "kube-router",
            Dataplane::AzureNpm => "azure-npm",
        }
    }

    pub fn is_peer(self) -> bool {
        matches!(self, Dataplane::KubeRouter | Dataplane::AzureNpm)
    }

    /// How long a peer's rules must stand still before the bench takes them as
    /// programmed, from the instant they last changed: kube-router's as `weir-lab`'s
    /// 1.5 s less its sync log (which ties a sync to the change); NPM logs nothing per
    /// change and applies its batches every 500 ms (its ConfigMap's
    /// ApplyIntervalInMilliseconds), so it gets the lab's 1.5 s.
    fn peer_quiet(self) -> Duration {
        match self {
            Dataplane::AzureNpm => Duration::from_millis(1500),
            _ => Duration::from_secs(1),
        }
    }
}

/// The bench's error when a peer has not programmed a change (or its cold start) within
/// the time the bench gives it: reported as "over N s", not as a failure.
#[derive(Debug)]
pub struct OverLimit {
    pub limit: Duration,
    pub what: String,
}

impl std::fmt::Display for OverLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} not within {} s", self.what, self.limit.as_secs())
    }
}

impl std::error::Error for OverLimit {}

impl OverLimit {
    /// The row value: "over N s".
    pub fn value(&self) -> String {
        format!("over {} s", self.limit.as_secs())
    }
}

/// A peer's binary and the flags it runs with (kube-router: deploy/kube-router-flags,
/// which the lab reads too; NPM: none, its config is the file beside its binary), as
/// `cargo xtask bench --peers` found them.
pub struct PeerBinary {
    pub binary: PathBuf,
    pub args: Vec<String>,
}

/// Azure NPM's config beside its binary: the ConfigMap its Linux DaemonSet mounts
/// (`cargo xtask peers` copies it out of the source archive, as the lab runs it).
pub const NPM_CONFIG: &str = "azure-npm.json";
/// What NPM logs once its dataplane has booted and its controllers start.
const NPM_STARTED: &str = "starting NPM - (";
/// Azure's instance metadata service, where NPM asks which cloud it runs in (the lab's
/// `weir-lab imds` answers it; see lab/src/peers.rs).
const IMDS: &str = "169.254.169.254";

/// Where the agent reads the world from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    File,
    Cluster,
}

pub struct Agent {
    child: Child,
    dir: PathBuf,
    bpf_root: PathBuf,
    dataplane: Dataplane,
    generation: u64,
    /// Cluster mode: the control plane and the last write to it.
    cluster: Option<Cluster>,
    /// The node's namespace (a peer's rules are read there).
    node: String,
    /// A peer: where its log ended when the last change was written (its sync of that
    /// change is logged after it).
    log_mark: u64,
    /// What a peer needs beside it in the node (NPM: the metadata stub), stopped with it.
    helpers: Vec<Child>,
    /// When the last change was written (CLOCK_MONOTONIC ns): the start of its watch delay.
    written_ns: u64,
}

/// The bench node's control plane (`weir-lab kube`), and what the agent must reach.
pub(crate) struct Cluster {
    /// The `weir-lab` binary that runs it.
    pub(crate) lab: PathBuf,
    netns: String,
    /// etcd's and kube-apiserver's, in that order.
    pub(crate) pids: Vec<u32>,
    /// The state digest the agent reports once it applied the last write.
    expected: String,
    /// The `weir-lab kube apply` of the last change, until its digest is read.
    writer: Option<(Child, BufReader<ChildStdout>)>,
}

impl Cluster {
    pub(crate) fn api_dir(dir: &Path) -> PathBuf {
        dir.join("api")
    }

    /// Starts `weir-lab kube apply` of `file` (against `previous`) and returns once the
    /// server acknowledged the last write, with the instant just before the first (and
    /// that instant in CLOCK_MONOTONIC ns).
    pub(crate) fn write(
        &mut self,
        dir: &Path,
        previous: Option<&Path>,
        file: &Path,
    ) -> Result<(Instant, u64)> {
        let mut command = Command::new(&self.lab);
        command
            .args(["kube", "apply", "--netns", &self.netns, "--node", NODE_NAME])
            .arg("--dir")
            .arg(Self::api_dir(dir));
        if let Some(p) = previous {
            command.arg("--previous").arg(p);
        }
        let mut child = command
            .arg(file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting weir-lab kube apply")?;
        let mut out = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        out.read_line(&mut line)?;
        let written_ns: u64 = line
            .strip_prefix("written ")
            .and_then(|n| n.trim().parse().ok())
            .with_context(|| format!("weir-lab kube apply failed ({:?})", child.wait()))?;
        let ago = monotonic_ns().saturating_sub(written_ns);
        self.writer = Some((child, out));
        Ok((Instant::now() - Duration::from_nanos(ago), written_ns))
    }

    /// The digest of the last write, once its writer has computed it.
    pub(crate) fn expected(&mut self) -> Result<&str> {
        if let Some((mut child, mut out)) = self.writer.take() {
            let mut line = String::new();
            out.read_line(&mut line)?;
            let status = child.wait()?;
            self.expected = line
                .strip_prefix("digest ")
                .map(|d| d.trim().to_string())
                .with_context(|| format!("weir-lab kube apply printed no digest ({status})"))?;
        }
        Ok(&self.expected)
    }
}

pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Agent {
    /// Writes generation 1 of `world` to a fresh directory `dir` and starts the agent on it;
    /// returns with the agent and the instant it was started.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        weir: &Path,
        lab: &Path,
        peer: Option<&PeerBinary>,
        node: &Netns,
        dir: &Path,
        dataplane: Dataplane,
        world: &World,
        source: Source,
    ) -> Result<(Self, Instant)> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        world.write(&dir.join("manifests.yaml"), 1)?;
        let cluster = match source {
            Source::File => None,
            Source::Cluster => Some(start_cluster(lab, node, dir)?),
        };
        let trial = dir.file_name().unwrap_or_default().to_string_lossy();
        let bpf_root = PathBuf::from(format!(
            "/sys/fs/bpf/weir-bench-{trial}-{}",
            std::process::id()
        ));
        let log = File::create(dir.join("agent.log"))?;
        let mut helpers = Vec::new();
        let mut command = match (dataplane.is_peer(), &cluster) {
            (true, None) => bail!("a peer runs against the API server only"),
            (true, Some(_)) => {
                let peer = peer.with_context(|| {
                    format!(
                        "{}'s binary was not given (weir-bench --{})",
                        dataplane.as_str(),
                        dataplane.as_str()
                    )
                })?;
                if dataplane == Dataplane::AzureNpm {
                    helpers.push(npm_node(lab, node, dir)?);
                }
                peer_command(dataplane, peer, dir)
            }
            (false, cluster) => {
                let mut command = Command::new(weir);
                command.arg("agent");
                match cluster {
                    None => {
                        command
                            .arg("--manifests")
                            .arg(dir.join("manifests.yaml"))
                            .args(["--poll-ms", &POLL_MS.to_string()]);
                    }
                    // As the DaemonSet: the ServiceAccount's kubeconfig, the node's name.
                    Some(_) => {
                        command.env("KUBECONFIG", Cluster::api_dir(dir).join("kubeconfig-agent"));
                    }
                }
                command
                    .arg("--status-file")
                    .arg(dir.join("status.json"))
                    .args(["--dataplane", dataplane.as_str(), "--node-name", NODE_NAME])
                    .args(["--listen", METRICS_ADDR])
                    .arg("--bpf-root")
                    .arg(&bpf_root);
                command
            }
        };
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        node.command(&mut command)?;
        let started = Instant::now();
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", dataplane.as_str()))?;
        let agent = Agent {
            child,
            dir: dir.to_path_buf(),
            bpf_root,
            dataplane,
            generation: 1,
            cluster,
            node: node.name().to_string(),
            log_mark: 0,
            helpers,
            written_ns: 0,
        };
        Ok((agent, started))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Where the agent pins its BPF maps and programs (`--bpf-root`).
    pub fn bpf_root(&self) -> &Path {
        &self.bpf_root
    }

    /// A peer in weir's place: no status file, no metrics of weir's.
    pub fn is_peer(&self) -> bool {
        self.dataplane.is_peer()
    }

    /// Writes the next generation of `world`; returns the instant it became visible (the
    /// file renamed into place), or, in cluster mode, the instant just before its first
    /// write request to the API server.
    pub fn update(&mut self, world: &World) -> Result<Instant> {
        self.generation += 1;
        self.log_mark = std::fs::metadata(self.dir.join("agent.log")).map_or(0, |m| m.len());
        let file = self.dir.join("manifests.yaml");
        let Some(cluster) = &mut self.cluster else {
            self.written_ns = monotonic_ns();
            world.write(&file, self.generation)?;
            return Ok(Instant::now());
        };
        let previous = self.dir.join("manifests.previous.yaml");
        std::fs::rename(&file, &previous)?;
        world.write(&file, self.generation)?;
        let (written, written_ns) = cluster.write(&self.dir, Some(&previous), &file)?;
        self.written_ns = written_ns;
        Ok(written)
    }

    /// The last change's watch delay, once the agent has applied it: from its write (in
    /// cluster mode, the first write request; in file mode, the file in place) to the
    /// agent's source receiving it (status file `change_received_monotonic_ns`). Nothing
    /// for a peer.
    pub fn watch_delay(&self) -> Result<Option<Duration>> {
        if self.dataplane.is_peer() {
            return Ok(None);
        }
        let path = self.dir.join("status.json");
        let status = read_status(&path)?.with_context(|| format!("{} is gone", path.display()))?;
        let received = status["change_received_monotonic_ns"]
            .as_u64()
            .with_context(|| format!("{} has no change_received_monotonic_ns", path.display()))?;
        if received < self.written_ns {
            bail!(
                "the agent's last applied change was received {} µs before the last write",
                (self.written_ns - received) / 1000
            );
        }
        Ok(Some(Duration::from_nanos(received - self.written_ns)))
    }

    /// Whether `status` describes the latest write.
    fn caught_up(&mut self, status: &Value) -> Result<bool> {
        Ok(match &mut self.cluster {
            None => status["generation"].as_u64() >= Some(self.generation),
            Some(cluster) => status["state_digest"].as_str() == Some(cluster.expected()?),
        })
    }

    /// Waits until the agent reports the latest generation converged on the requested
    /// dataplane with no errors; returns the instant it saw that.
    pub fn wait_converged(&mut self, timeout: Duration) -> Result<Instant> {
        if self.dataplane.is_peer() {
            return self.wait_peer_programmed(timeout);
        }
        let deadline = Instant::now() + timeout;
        let path = self.dir.join("status.json");
        loop {
            if let Some(status) = read_status(&path)? {
                if status["converged"] == true && self.caught_up(&status)? {
                    let now = Instant::now();
                    self.check_status(&status)?;
                    return Ok(now);
                }
            }
            if let Some(exit) = self.child.try_wait()? {
                bail!(
                    "the agent exited ({exit}); last lines of its log:\n{}",
                    self.log_tail()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "generation {} not converged after {timeout:?}; last lines of the agent log:\n{}",
                    self.generation,
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// A peer: waits until kube-router logged a whole sync after the last write (it builds
    /// a sync's rules in memory and restores them at its end: 5 s at 1,000 policies and
    /// 20,000 pods, during which its rules stand still), or NPM has booted and jumps from
    /// FORWARD to its chain, then until its rules (iptables-save and ipset save in the
    /// node) have stood still for [`Dataplane::peer_quiet`]; returns the instant they last
    /// changed. Past `timeout` the error is an [`OverLimit`].
    fn wait_peer_programmed(&mut self, timeout: Duration) -> Result<Instant> {
        let deadline = Instant::now() + timeout;
        let (mut last, mut changed) = (String::new(), Instant::now());
        loop {
            let rules = self.peer_rules()?;
            if rules != last {
                (last, changed) = (rules, Instant::now());
            } else if changed.elapsed() >= self.dataplane.peer_quiet() && self.peer_ready(&last) {
                return Ok(changed);
            }
            if let Some(exit) = self.child.try_wait()? {
                bail!(
                    "{} exited ({exit}); last lines of its log:\n{}",
                    self.dataplane.as_str(),
                    self.log_tail()
                );
            }
            if Instant::now() > deadline {
                return Err(OverLimit {
                    limit: timeout,
                    what: format!("{}'s rules settled", self.dataplane.as_str()),
                }
                .into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// kube-router: whether its log shows a sync started and finished after the last
    /// write. NPM logs nothing the bench can tie to one change: that it has booted and its
    /// jump from FORWARD (in `rules`) are all (as in the lab).
    fn peer_ready(&self, rules: &str) -> bool {
        let log = std::fs::read(self.dir.join("agent.log")).unwrap_or_default();
        match self.dataplane {
            Dataplane::AzureNpm => {
                String::from_utf8_lossy(&log).contains(NPM_STARTED)
                    && rules
                        .lines()
                        .any(|l| l.starts_with("-A FORWARD ") && l.ends_with("-j AZURE-NPM"))
            }
            _ => {
                let after =
                    String::from_utf8_lossy(log.get(self.log_mark as usize..).unwrap_or_default());
                after
                    .split_once("Starting sync of iptables")
                    .is_some_and(|(_, rest)| rest.contains("sync iptables took"))
            }
        }
    }

    /// A peer's rules and sets in the node, without packet counters.
    fn peer_rules(&self) -> Result<String> {
        let mut text = String::new();
        for (program, args) in [("iptables-save", &[][..]), ("ipset", &["save"][..])] {
            let out = Command::new("ip")
                .args(["netns", "exec", &self.node, program])
                .args(args)
                .output()
                .with_context(|| format!("running {program} in {}", self.node))?;
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if !line.starts_with('#') {
                    text.push_str(line.split(" [").next().unwrap_or(line));
                    text.push('\n');
                }
            }
        }
        Ok(text)
    }

    /// The cold start's phases from the status file (`startup`, written at the first
    /// convergence), in milliseconds, in the order they happen. A peer reports none.
    pub fn startup_phases(&self) -> Result<Vec<(String, f64)>> {
        if self.dataplane.is_peer() {
            return Ok(Vec::new());
        }
        let path = self.dir.join("status.json");
        let status = read_status(&path)?.with_context(|| format!("{} is gone", path.display()))?;
        let Some(startup) = status["startup"].as_object() else {
            bail!("{} has no startup phases", path.display());
        };
        ["listed", "compiled", "loaded", "programmed", "cleaned"]
            .iter()
            .map(|phase| {
                let ms = startup
                    .get(&format!("{phase}_ms"))
                    .and_then(Value::as_f64)
                    .with_context(|| format!("startup.{phase}_ms missing"))?;
                Ok((phase.to_string(), ms))
            })
            .collect()
    }

    fn check_status(&self, status: &Value) -> Result<()> {
        let running = status["dataplane"].as_str().unwrap_or("none");
        if running != self.dataplane.as_str() {
            bail!(
                "the agent runs {running}, not {} (fallback reason: {})",
                self.dataplane.as_str(),
                status["fallback_reason"].as_str().unwrap_or("none given")
            );
        }
        if let Some(errors) = status["errors"].as_array().filter(|e| !e.is_empty()) {
            bail!(
                "the agent converged with errors: {}",
                Value::from(errors.clone())
            );
        }
        Ok(())
    }

    /// The agent's own account of its work (`weir_apply_duration_seconds`: from an event
    /// batch to the dataplane having applied it): (seconds in total, batches).
    pub fn apply_totals(&self, node: &Netns) -> Result<(f64, f64)> {
        self.histogram_totals(node, "weir_apply_duration_seconds")
    }

    /// `weir_policy_implementation_delay_seconds`: from the source receiving a change to
    /// the dataplane having programmed it; (sum, count).
    pub fn implementation_delay_totals(&self, node: &Netns) -> Result<(f64, f64)> {
        self.histogram_totals(node, "weir_policy_implementation_delay_seconds")
    }

    /// A histogram's sum and count from the agent's /metrics (nothing for a peer: its
    /// share is not measured).
    fn histogram_totals(&self, node: &Netns, histogram: &str) -> Result<(f64, f64)> {
        if self.dataplane.is_peer() {
            return Ok((0.0, 0.0));
        }
        let text = node.run(|| {
            let mut conn = TcpStream::connect(METRICS_ADDR)
                .with_context(|| format!("connecting to the agent's metrics at {METRICS_ADDR}"))?;
            conn.set_read_timeout(Some(Duration::from_secs(5)))?;
            conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")?;
            let mut text = String::new();
            conn.read_to_string(&mut text).context("reading /metrics")?;
            Ok(text)
        })?;
        let value = |name: &str| -> Result<f64> {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .with_context(|| format!("/metrics has no {name}"))?
                .trim()
                .parse()
                .with_context(|| format!("/metrics: {name}"))
        };
        Ok((
            value(&format!("{histogram}_sum"))?,
            value(&format!("{histogram}_count"))?,
        ))
    }

    /// Peak resident set size in bytes (VmHWM).
    pub fn peak_rss(&self) -> Result<u64> {
        let path = format!("/proc/{}/status", self.pid());
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .with_context(|| format!("{path} has no VmHWM line"))?;
        let kib: u64 = line
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .with_context(|| format!("{path}: VmHWM {line:?}"))?;
        Ok(kib * 1024)
    }

    fn log_tail(&self) -> String {
        log_tail(&self.dir)
    }
}

/// The last lines of the agent log in `dir`.
pub(crate) fn log_tail(dir: &Path) -> String {
    let text = std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Stops a child this process spawned: SIGTERM, up to 5 s to exit, then SIGKILL; reaped.
pub(crate) fn stop_child(child: &mut std::process::Child) {
    // SAFETY: kill with a pid this process spawned and has not reaped yet.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Agent {
    fn drop(&mut self) {
        stop_child(&mut self.child);
        for helper in &mut self.helpers {
            let _ = helper.kill();
            let _ = helper.wait();
        }
        for pid in self.cluster.iter().flat_map(|c| &c.pids) {
            // SAFETY: kill only sends a signal; the control plane is this agent's.
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
        if self.bpf_root.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.bpf_root) {
                eprintln!("bench: cleanup: removing {}: {e}", self.bpf_root.display());
            }
        }
    }
}

/// Starts etcd and kube-apiserver in the node's namespace and writes the whole world
/// there, before the agent starts: a cold start finds it on the server.
pub(crate) fn start_cluster(lab: &Path, node: &Netns, dir: &Path) -> Result<Cluster> {
    let pids = kube_start(
        lab,
        "start",
        node,
        &Cluster::api_dir(dir),
        &["etcd_pid", "apiserver_pid"],
    )?;
    let mut cluster = Cluster {
        lab: lab.to_path_buf(),
        netns: node.name().to_string(),
        pids,
        expected: String::new(),
        writer: None,
    };
    cluster.write(dir, None, &dir.join("manifests.yaml"))?;
    cluster.expected()?;
    Ok(cluster)
}

/// `weir-lab kube ACTION --netns NODE --dir DIR` (`start`, `start-relay`): the pids it
/// prints as JSON, under `keys`.
pub(crate) fn kube_start(
    lab: &Path,
    action: &str,
    node: &Netns,
    dir: &Path,
    keys: &[&str],
) -> Result<Vec<u32>> {
    let out = Command::new(lab)
        .args(["kube", action, "--netns", node.name()])
        .arg("--dir")
        .arg(dir)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting weir-lab kube {action}"))?;
    if !out.status.success() {
        bail!(
            "weir-lab kube {action}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let pids: Value =
        serde_json::from_slice(&out.stdout).with_context(|| format!("weir-lab kube {action}"))?;
    keys.iter()
        .map(|k| {
            pids[k]
                .as_u64()
                .map(|p| p as u32)
                .with_context(|| format!("weir-lab kube {action} printed no {k}"))
        })
        .collect()
}

/// A peer in the bench node, as the lab runs it, with the bench control plane's admin
/// credentials: kube-router with deploy/kube-router-flags; NPM as its Linux DaemonSet
/// (`azure-npm start`, HOSTNAME the node's name, NPM_CONFIG its ConfigMap).
fn peer_command(dataplane: Dataplane, peer: &PeerBinary, dir: &Path) -> Command {
    let kubeconfig = Cluster::api_dir(dir).join("kubeconfig-admin");
    let mut command = Command::new(&peer.binary);
    match dataplane {
        Dataplane::AzureNpm => {
            let config = peer.binary.with_file_name(NPM_CONFIG);
            command
                .arg("start")
                .arg(format!("--kubeconfig={}", kubeconfig.display()))
                .args(&peer.args)
                .env("HOSTNAME", NODE_NAME)
                .env("NPM_CONFIG", config);
        }
        _ => {
            command
                .arg(format!("--kubeconfig={}", kubeconfig.display()))
                .arg(format!("--hostname-override={NODE_NAME}"))
                .args(&peer.args)
                .env("NODE_NAME", NODE_NAME);
        }
    }
    command
}

/// What NPM needs of its node that kubelet and Azure give it, as the lab supplies them:
/// the chain kubelet makes to tell the iptables backend (NPM v1.8 refuses to start
/// without it), and the instance metadata service (`weir-lab imds` on IMDS's address on
/// the node's loopback; without it NPM's telemetry holds it back 3 × 1 min). Returns the
/// stub's process.
fn npm_node(lab: &Path, node: &Netns, dir: &Path) -> Result<Child> {
    let run = |program: &str, args: &[&str]| -> Result<()> {
        let out = Command::new("ip")
            .args(["netns", "exec", node.name(), program])
            .args(args)
            .output()
            .with_context(|| format!("running {program} in {}", node.name()))?;
        if !out.status.success() {
            bail!(
                "{program} {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    };
    run("iptables", &["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"])?;
    run(
        "ip",
        &["addr", "replace", &format!("{IMDS}/32"), "dev", "lo"],
    )?;
    let log = File::create(dir.join("imds.log"))?;
    let mut command = Command::new(lab);
    command
        .arg("imds")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    node.command(&mut command)?;
    let mut child = command.spawn().context("starting weir-lab imds")?;
    let started = Instant::now();
    loop {
        let answers = node.run(|| {
            Ok(TcpStream::connect_timeout(
                &format!("{IMDS}:80").parse()?,
                Duration::from_millis(200),
            )
            .is_ok())
        })?;
        if answers {
            return Ok(child);
        }
        if let Some(exit) = child.try_wait()? {
            bail!(
                "weir-lab imds exited ({exit}); see {}",
                dir.join("imds.log").display()
            );
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            bail!("weir-lab imds does not answer on {IMDS}:80 after 10 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn read_status(path: &Path) -> Result<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .with_context(|| format!("parsing {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}
