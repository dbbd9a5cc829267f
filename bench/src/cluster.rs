//! `weir-bench --cluster`: N weir agents, each as a different node and on the dataplane
//! that programs nothing (`weir agent --dataplane none`: they watch, compile and report
//! their status, so that N fit on one machine), against one real etcd and kube-apiserver
//! holding P pods on 100 Node objects, written through the API (no kubelet). Per N it
//! measures:
//! - the cold start of all N agents at once: each agent's time to its first convergence,
//!   the API server's CPU and peak RSS meanwhile;
//! - changes (a pod label change and a policy create or delete, alternately, each written
//!   once every agent had the previous one): from just before the first write request to
//!   each agent's status file naming the state digest of the server after the change
//!   (p50 / p99 over (agent, change) pairs, and of the slowest agent per change); the API
//!   server's CPU and its `apiserver_watch_events_total` and `apiserver_watch_events_sizes`
//!   per change; the bytes each agent received per change (its TCP connections to the API
//!   server, `ss`); each agent's CPU per change;
//! - changes at a steady rate (`weir-lab kube churn`, 10 a second by default), each
//!   written when its time comes whether or not the agents have the ones before: from
//!   its first write request to each agent's status naming its digest or a later one;
//! - an API server restart (etcd keeps running): the time to ready, then the first change
//!   after it as above, the bytes each agent received from the new server (its relists)
//!   and the new server's CPU until every agent had the change;
//! - a 410 storm: the same restart with etcd's revision moved on while the server is
//!   stopped (`weir-lab kube touch --etcd`), so that every agent's watches are older than
//!   the new server's cache and they all list again at once (counted: the agents whose
//!   log shows a list of the Pods started after the restart);
//! - each agent's peak RSS (VmHWM) after its cold start, and over all of it;
//! - with `--cluster-pod-sweep`, all of it again for the largest N with the world resized
//!   to each pod count in turn.
//!
//! The control plane, the writer and the bench itself run on CPU 0, the agents on CPU 1.
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::agent::{kube_start, monotonic_ns, start_cluster, Cluster};
use super::netns::Netns;
use super::report::Row;
use super::traffic::percentile;
use super::world::{remote_node_name, Toggle, World, REMOTE_NODES};

/// Where the control plane, the writer and the bench run.
const CONTROL_CPU: usize = 0;
/// Where every agent runs.
const AGENT_CPU: usize = 1;
/// Every agent must converge within this after its start, a change or the restart.
const LIMIT: Duration = Duration::from_secs(600);
/// Agent i serves its /metrics on this port + i (in the control plane's namespace).
const METRICS_PORT_BASE: u16 = 19400;
/// The API server's secure port, as the lab runs it.
const APISERVER_PORT: &str = ":6443";
/// The dataplane column of the report.
const DP: &str = "none";
/// The world's changes alternate two kinds, each flipping a state: after this many the
/// world is as it was.
const CHANGE_CYCLE: usize = 4;

/// How long after the storm's next change an agent that has not begun its relist yet is
/// waited for.
const RELIST_GRACE: Duration = Duration::from_secs(60);

/// What `--cluster` sweeps.
pub struct Plan {
    /// Agent counts, each a run against the same control plane and world.
    pub agents: Vec<usize>,
    pub pods: usize,
    pub policies: usize,
    pub changes: usize,
    /// Changes a second of the steady-rate changes, and how many (0: none).
    pub rate: f64,
    pub rate_changes: usize,
    /// The largest N once more, its agents reading with the API server's streaming lists
    /// (`weir agent --lists stream`): the same figures, before and after, in one run.
    pub streaming_too: bool,
    /// The largest N once more, its agents reading Pods in JSON (`weir agent
    /// --pod-encoding json`) instead of protobuf: before and after, in one run.
    pub json_pods_too: bool,
    /// The largest N once more, its agents reading from `weir relay`'s etcd (`weir agent
    /// --relay`), the relay started (and its list of the world done) before them.
    pub relay_too: bool,
    /// After those, the world resized to each of these pod counts in turn (through the
    /// API, as a change: the pods beyond it deleted or the missing ones created) and the
    /// largest N run again there: the sweep over the cluster's size.
    pub pod_sweep: Vec<usize>,
}

/// How the agents read the cluster: each kind's whole state (`weir agent --lists`) and
/// the Pods' encoding (`--pod-encoding`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// The agent's defaults: pages, Pods in protobuf.
    Default,
    /// Streaming lists, Pods in protobuf.
    StreamingLists,
    /// Pages, Pods in JSON (as every other kind).
    JsonPods,
    /// From `weir relay`'s etcd (`weir agent --relay`), the relay reading with the defaults.
    Relay,
}

impl Reading {
    /// The agent's flags, on the control plane in `api`.
    fn args(self, api: &Path) -> Vec<String> {
        let (lists, pods) = match self {
            Reading::Default => ("pages", "protobuf"),
            Reading::StreamingLists => ("stream", "protobuf"),
            Reading::JsonPods => ("pages", "json"),
            // The relay's etcd as `weir-lab kube start-relay` runs it: TLS, and the client
            // certificate it made.
            Reading::Relay => {
                let tls = api.join("relay-tls");
                let file = |name: &str| tls.join(name).display().to_string();
                return vec![
                    format!("--relay=https://127.0.0.1{RELAY_STORE_PORT}"),
                    format!("--relay-ca={}", file("ca.crt")),
                    format!("--relay-cert={}", file("client.crt")),
                    format!("--relay-key={}", file("client.key")),
                ];
            }
        };
        ["--lists", lists, "--pod-encoding", pods]
            .map(String::from)
            .into()
    }

    /// The suffix of its scenarios' names.
    fn suffix(self) -> &'static str {
        match self {
            Reading::Default => "",
            Reading::StreamingLists => STREAMING,
            Reading::JsonPods => JSON_PODS,
            Reading::Relay => RELAY,
        }
    }
}

/// The scenario name of N agents.
pub fn scenario(agents: usize, pods: usize) -> String {
    format!("cluster, {agents} agents, {pods} pods")
}

/// The suffix of a scenario whose agents read with streaming lists.
const STREAMING: &str = ", streaming lists";
/// The suffix of a scenario whose agents read Pods in JSON.
const JSON_PODS: &str = ", pods in JSON";
/// The suffix of a scenario whose agents read from the relay.
const RELAY: &str = ", from the relay";
/// The relay's etcd's client port: the agents' connections to it are counted as to the
/// API server's.
const RELAY_STORE_PORT: &str = ":2381";

pub fn notes(plan: &Plan) -> Vec<String> {
    vec![
        format!("cluster: the real etcd and kube-apiserver (the lab's, `weir-lab kube start`) in one network namespace, holding {} pods on {REMOTE_NODES} Node objects and {} NetworkPolicies, written through the API by `weir-lab kube apply` (each Pod created, then its status written); N `weir agent --dataplane none` (watch, compile and report, program nothing), agent i as Node remote-node-i with its own status file, metrics port and the DaemonSet's ServiceAccount; control plane, writer and bench pinned to CPU {CONTROL_CPU}, the agents to CPU {AGENT_CPU}; one control plane for the whole sweep (N = {:?}), in that order", plan.pods, plan.policies, plan.agents),
        "cluster convergence: from just before a change's first write request to the first poll (every 5 ms) of an agent's status file that names the server's state digest after the change; changes alternate a pod label change and a NetworkPolicy create or delete, the next written once every agent had the last; p50 / p99 over all (agent, change) pairs and over the slowest agent of each change".into(),
        format!("cluster changes at a steady rate: {} changes at {} a second written by `weir-lab kube churn` without waiting for the agents (the k-th due k / rate after the first; one whose time came while the one before was being written goes right after it), of the same kinds in the same order as above; an agent has change k at the first poll (every 5 ms) of its status naming the digest after k or after a later change; the write rate achieved is the changes over the time from the first write to the last", plan.rate_changes.div_ceil(CHANGE_CYCLE) * CHANGE_CYCLE, plan.rate),
        "cluster cold start: all N agents started at once, the world already on the server (and the server restarted once after writing or resizing it, so that the first run's agents do not meet a server still carrying the bulk write); each agent's time from its start to its first convergence (its status file says converged: every kind listed, compiled, applied); the API server's CPU over that time and its peak RSS (VmRSS sampled every 100 ms)".into(),
        "cluster API server figures: CPU from /proc (user + system) of the kube-apiserver process; watch events and their bytes are the deltas of the sums of `apiserver_watch_events_total` and `apiserver_watch_events_sizes` (sum and count) over every resource; the writer's own requests (a change's writes, a list of the Nodes for the digest) are in the CPU figure. Bytes received: the agents' TCP connections to the API server (`ss` bytes_received, TLS included); per pod change and per policy change: from just before each change's write to every agent having it, by its kind. The agents read Pods in protobuf (`weir agent --pod-encoding protobuf`, the default) but in the `pods in JSON` run".into(),
        format!("cluster, streaming lists: the largest N again, after the others, its agents started with `--lists stream` (the API server's WatchList) instead of the default `--lists pages` (LIST requests of 5,000 objects); otherwise the same run{}", if plan.streaming_too { "" } else { " (not run this time)" }),
        format!("cluster, pods in JSON: the largest N again, after the others, its agents started with `--pod-encoding json` (Pods read in JSON, as before protobuf, and as every other kind) instead of the default `protobuf`; otherwise the same run{}", if plan.json_pods_too { "" } else { " (not run this time)" }),
        format!("cluster, from the relay: the largest N again, after the others, with `weir relay` and its own etcd (`weir-lab kube start-relay`, on CPU {CONTROL_CPU} with the control plane) started first and waited for until it had written every kind, then the agents started with `--relay` (every object read from the relay's etcd; the API server only written to, for their Node annotations). Bytes received are the agents' connections to the relay's etcd and to the API server; the API server's figures include the relay's one watch per kind; `relay:` figures are the relay process's and its etcd's{}", if plan.relay_too { "" } else { " (not run this time)" }),
        format!("cluster, the size sweep: after the runs above, the world resized through the API to each of {:?} pods in turn (the pods past the smaller count created or deleted, the rest of the world as it was) and the largest N run again at each, its agents started afresh; `world resized to this many pods` is that write's time", plan.pod_sweep),
        "cluster restart: kube-apiserver stopped (SIGTERM) and started again on the same etcd, whose data it keeps; the figures after it are the first change written once the new server was ready, the bytes each agent received from the new server until it had that change, and the new server's CPU from its start to then (both once every agent's lists of the Pods begun since the restart have ended: a relisting agent can have the change before its Pods are in). Whether an agent lists again after it depends on whether its watches' resourceVersion is the newest when the server stops (an event or bookmark since the server's own last write); `410 storm`: the same restart with a key written to etcd itself while the server is stopped (`weir-lab kube touch --etcd`), so that every agent's watches are older than the new server's watch cache, which answers 410 Gone, and they list every kind again at once (`agents that listed every pod again`: those whose log shows a list of the Pods started after the restart); its figures also wait for every agent to have begun its list of the Pods (one still in its backoff after the 410), for up to 60 s".into(),
    ]
}

/// Runs the sweep; one scenario per agent count. A setup that fails fails every scenario.
pub fn run(weir: &Path, lab: &Path, run_dir: &Path, plan: &Plan) -> Vec<Row> {
    let mut rows = Vec::new();
    let first = scenario(plan.agents.first().copied().unwrap_or(0), plan.pods);
    let mut bench = match Bench::set_up(lab, run_dir, plan) {
        Ok((bench, setup_rows)) => {
            rows.extend(
                setup_rows
                    .into_iter()
                    .map(|(figure, value, unit)| Row::number(&first, DP, &figure, value, unit)),
            );
            bench
        }
        Err(e) => {
            for &n in &plan.agents {
                rows.push(Row::failed(
                    &scenario(n, plan.pods),
                    DP,
                    "all figures",
                    format!("setup: {e:#}"),
                ));
            }
            return rows;
        }
    };
    let mut runs: Vec<(usize, Reading)> =
        plan.agents.iter().map(|&n| (n, Reading::Default)).collect();
    if let Some(&n) = plan.agents.iter().max() {
        if plan.streaming_too {
            runs.push((n, Reading::StreamingLists));
        }
        if plan.json_pods_too {
            runs.push((n, Reading::JsonPods));
        }
        if plan.relay_too {
            runs.push((n, Reading::Relay));
        }
    }
    for (n, reading) in runs {
        let name = scenario(n, plan.pods) + reading.suffix();
        crate::progress(&name);
        match bench.run_agents(weir, n, plan, reading) {
            Ok(figures) => rows.extend(
                figures
                    .into_iter()
                    .map(|(figure, value, unit)| Row::number(&name, DP, &figure, value, unit)),
            ),
            Err(e) => rows.push(Row::failed(&name, DP, "all figures", format!("{e:#}"))),
        }
    }
    let largest = plan.agents.iter().max().copied().unwrap_or(0);
    for &pods in plan.pod_sweep.iter().filter(|&&p| p != plan.pods) {
        let name = scenario(largest, pods);
        crate::progress(&name);
        let measured = bench.resize(pods, plan).and_then(|mut figures| {
            figures.extend(bench.run_agents(weir, largest, plan, Reading::Default)?);
            Ok(figures)
        });
        match measured {
            Ok(figures) => rows.extend(
                figures
                    .into_iter()
                    .map(|(figure, value, unit)| Row::number(&name, DP, &figure, value, unit)),
            ),
            Err(e) => rows.push(Row::failed(&name, DP, "all figures", format!("{e:#}"))),
        }
    }
    rows
}

type Figures = Vec<(String, f64, &'static str)>;

struct Bench {
    netns: Netns,
    /// The world's files (manifests.yaml, the previous one) and the control plane's (api/).
    dir: PathBuf,
    cluster: Cluster,
    world: World,
    generation: u64,
    /// Changes written so far (which kind the next one is).
    changes: usize,
}

impl Drop for Bench {
    fn drop(&mut self) {
        for pid in &self.cluster.pids {
            // SAFETY: kill only sends a signal; the control plane is this bench's.
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
    }
}

impl Bench {
    /// Pins the bench to the control plane's CPU (what it starts inherits it), starts the
    /// control plane and writes the world. Returns the setup's own figures.
    fn set_up(lab: &Path, run_dir: &Path, plan: &Plan) -> Result<(Bench, Figures)> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cpus <= AGENT_CPU {
            bail!("the cluster bench pins the control plane and the agents to CPUs {CONTROL_CPU} and {AGENT_CPU}: this machine has {cpus}");
        }
        pin(CONTROL_CPU).context("pinning the bench to CPU 0")?;
        let netns = Netns::create("cluster")?;
        let dir = run_dir.join("cluster");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let world = World::new(plan.policies, plan.pods).with_remote_nodes();
        world.write(&dir.join("manifests.yaml"), 1)?;
        let started = Instant::now();
        let cluster = start_cluster(lab, &netns, &dir)?;
        let written = started.elapsed().as_secs_f64();
        if cluster.pids.len() != 2 {
            bail!("weir-lab kube start named no etcd and kube-apiserver pids");
        }
        let mut bench = Bench {
            netns,
            dir,
            cluster,
            world,
            generation: 1,
            changes: 0,
        };
        let rss = status_kib(bench.apiserver(), "VmRSS:")? as f64 / 1024.0;
        let mut figures = vec![
            (
                "control plane started and the world written".into(),
                written,
                "s",
            ),
            ("API server RSS with the world, no agent".into(), rss, "MiB"),
        ];
        figures.extend(bench.settle_server()?);
        Ok((bench, figures))
    }

    /// Resizes the world to `pods` pods on the server, its changeable state kept: the
    /// remote pods are numbered, so this creates or deletes only those beyond the smaller
    /// count. Returns how long that took and the API server's RSS after it.
    fn resize(&mut self, pods: usize, plan: &Plan) -> Result<Figures> {
        let mut world = World::new(plan.policies, pods).with_remote_nodes();
        world.toggle = self.world.toggle;
        world.client_granted = self.world.client_granted;
        world.namespace_granted = self.world.namespace_granted;
        world.cluster_deny = self.world.cluster_deny;
        self.world = world;
        let started = Instant::now();
        self.write(false)?;
        let resized = started.elapsed().as_secs_f64();
        let rss = status_kib(self.apiserver(), "VmRSS:")? as f64 / 1024.0;
        let mut figures = vec![
            ("world resized to this many pods".into(), resized, "s"),
            ("API server RSS with the world, no agent".into(), rss, "MiB"),
        ];
        figures.extend(self.settle_server()?);
        Ok(figures)
    }

    fn apiserver(&self) -> u32 {
        self.cluster.pids[1]
    }

    /// Stops the API server (etcd keeps the state) and starts it again; with `touch`,
    /// moves etcd's revision on while it is stopped. Returns the seconds from its start
    /// to its being ready.
    fn restart_apiserver(&mut self, touch: bool) -> Result<f64> {
        let lab = self.cluster.lab.clone();
        let old = self.apiserver();
        // SAFETY: kill only sends a signal; the server is this bench's.
        unsafe { libc::kill(old as i32, libc::SIGTERM) };
        let stopping = Instant::now();
        while alive(old) {
            if stopping.elapsed() > Duration::from_secs(30) {
                // SAFETY: as above.
                unsafe { libc::kill(old as i32, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if touch {
            // A write to etcd itself: no agent can have heard of its revision (a write
            // through the server before it stops reaches those whose next bookmark comes
            // in time, about half of them).
            self.kube_with(&lab, "touch", &["--etcd"], Duration::from_secs(60))?;
        }
        let restarting = Instant::now();
        let out = self.kube(&lab, "start-apiserver", Duration::from_secs(180))?;
        let pid: Value = serde_json::from_slice(&out).context("weir-lab kube start-apiserver")?;
        self.cluster.pids[1] = pid["apiserver_pid"]
            .as_u64()
            .context("weir-lab kube start-apiserver printed no pid")?
            as u32;
        Ok(restarting.elapsed().as_secs_f64())
    }

    /// After the world was written or resized: the API server restarted, so that the
    /// next agents' cold start meets a server as every later one does (each run restarts
    /// it twice), not one still carrying the bulk write (the first run's cold start at
    /// 150,000 pods once cost its server 7.1 s of CPU and 4.7 GiB against 4.1 s and
    /// 3.0 GiB for the run after it).
    fn settle_server(&mut self) -> Result<Figures> {
        let ready = self.restart_apiserver(false)?;
        let rss = status_kib(self.apiserver(), "VmRSS:")? as f64 / 1024.0;
        Ok(vec![
            (
                "API server restarted after the write, ready after".into(),
                ready,
                "s",
            ),
            (
                "API server RSS after that restart, no agent".into(),
                rss,
                "MiB",
            ),
        ])
    }

    fn api_dir(&self) -> PathBuf {
        Cluster::api_dir(&self.dir)
    }

    /// Writes the next change (or, `change` false, nothing: the digest of the server as it
    /// is, its Nodes listed afresh); returns the instant before its first write request and
    /// the state digest every agent must reach.
    fn write(&mut self, change: bool) -> Result<(Instant, String)> {
        if change {
            self.next_change();
        }
        self.generation += 1;
        let file = self.dir.join("manifests.yaml");
        let previous = self.dir.join("manifests.previous.yaml");
        std::fs::rename(&file, &previous)?;
        self.world.write(&file, self.generation)?;
        let (written, _) = self.cluster.write(&self.dir, Some(&previous), &file)?;
        Ok((written, self.cluster.expected()?.to_string()))
    }

    /// Changes the world (not the server): the client pod's label that a policy selects,
    /// and the toggle policy's presence, in turn.
    fn next_change(&mut self) {
        if self.changes.is_multiple_of(2) {
            self.world.client_granted = !self.world.client_granted;
        } else {
            self.world.toggle = match self.world.toggle {
                Toggle::Absent => Toggle::Allow,
                _ => Toggle::Absent,
            };
        }
        self.changes += 1;
    }

    /// Runs `weir-lab kube ACTION` on this bench's control plane, killed after `limit`;
    /// its stdout, or an error with its stderr.
    fn kube(&self, lab: &Path, action: &str, limit: Duration) -> Result<Vec<u8>> {
        self.kube_with(lab, action, &[], limit)
    }

    /// [`Self::kube`] with `extra` arguments after the lab's own.
    fn kube_with(
        &self,
        lab: &Path,
        action: &str,
        extra: &[&str],
        limit: Duration,
    ) -> Result<Vec<u8>> {
        let mut command = Command::new(lab);
        command
            .args(["kube", action, "--netns", self.netns.name(), "--dir"])
            .arg(self.api_dir())
            .args(extra);
        let out = output_within(&mut command, limit)?;
        if !out.status.success() {
            bail!(
                "weir-lab kube {action}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(out.stdout)
    }

    /// The API server's CPU seconds and watch counters.
    fn api_sample(&self, lab: &Path) -> Result<ApiSample> {
        let out = self.kube(lab, "metrics", Duration::from_secs(30))?;
        let text = String::from_utf8_lossy(&out);
        let sum = |name: &str| -> f64 {
            text.lines()
                .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        Ok(ApiSample {
            cpu: cpu_seconds(self.apiserver())?,
            events: sum("apiserver_watch_events_total"),
            event_bytes: sum("apiserver_watch_events_sizes_sum"),
        })
    }

    /// One agent count: cold start, changes, a restart, memory. The agents are stopped at
    /// the end (or on an error).
    fn run_agents(
        &mut self,
        weir: &Path,
        n: usize,
        plan: &Plan,
        reading: Reading,
    ) -> Result<Figures> {
        let changes = plan.changes;
        let lab = self.cluster.lab.clone();
        let mut figures: Figures = Vec::new();
        let mut put = |figure: &str, value: f64, unit: &'static str| {
            figures.push((figure.to_string(), value, unit));
        };

        let relay = match reading {
            Reading::Relay => {
                let started = Instant::now();
                let relay = RelayProcs::start(&lab, &self.netns, &self.api_dir())?;
                put(
                    "relay: started and the world written to its etcd",
                    started.elapsed().as_secs_f64(),
                    "s",
                );
                Some(relay)
            }
            _ => None,
        };

        // Cold start, all at once.
        let before = self.api_sample(&lab)?;
        let started = Instant::now();
        let agents = (0..n)
            .map(|i| AgentProc::spawn(weir, &self.netns, &self.dir, &self.api_dir(), i, reading))
            .collect::<Result<Vec<_>>>()?;
        let (cold, peak) = wait_all(&agents, started, self.apiserver(), |s| {
            s["converged"] == true
        })?;
        let after = self.api_sample(&lab)?;
        for a in &agents {
            let status = a.status().unwrap_or_default();
            if status["dataplane"] != DP {
                bail!(
                    "agent {} runs {} (not none): {status}",
                    a.index,
                    status["dataplane"]
                );
            }
        }
        let mut cold_ms: Vec<f64> = cold.iter().map(ms).collect();
        put("cold start p50", percentile(&mut cold_ms, 50.0), "ms");
        put(
            "cold start, slowest agent",
            percentile(&mut cold_ms, 100.0),
            "ms",
        );
        put("cold start: API server CPU", after.cpu - before.cpu, "s");
        put(
            "cold start: API server peak RSS",
            peak as f64 / 1024.0,
            "MiB",
        );
        let agent_cpu: Vec<f64> = agents.iter().map(|a| a.cpu()).collect::<Result<_>>()?;
        put("cold start: CPU per agent (mean)", mean(&agent_cpu), "s");
        // The peak so far: the lists, before any relist after the restart below.
        let cold_peaks = peak_rss_mib(&agents)?;
        put(
            "cold start: agent peak RSS (mean)",
            mean(&cold_peaks),
            "MiB",
        );

        // Every agent at the server's state, its Node annotations included.
        self.settle(&agents)?;

        // Changes, one at a time.
        let received0 = received_by_connection(self.netns.name())?;
        let cpu0 = agent_cpu_now(&agents)?;
        let before = self.api_sample(&lab)?;
        let (mut pairs, mut slowest) = (Vec::new(), Vec::new());
        // Bytes each agent received by the kind of change, from just before its write to
        // every agent having it: [pod label changes, policy creates and deletes].
        let mut by_kind: [(Vec<f64>, usize); 2] = Default::default();
        for c in 0..changes {
            // Changes land at varied offsets from the agents' timers.
            std::thread::sleep(Duration::from_millis(100 + (c as u64 * 37) % 100));
            let kind = usize::from(!self.changes.is_multiple_of(2));
            let received_before = received_by_connection(self.netns.name())?;
            let (written, digest) = self.write(true)?;
            let (times, _) = wait_all(&agents, written, self.apiserver(), |s| {
                s["converged"] == true && s["state_digest"].as_str() == Some(digest.as_str())
            })?;
            let received = received_between(
                &received_before,
                &received_by_connection(self.netns.name())?,
            );
            let (sums, count) = &mut by_kind[kind];
            sums.resize(agents.len(), 0.0);
            for (sum, a) in sums.iter_mut().zip(&agents) {
                *sum += received.get(&a.pid()).copied().unwrap_or(0) as f64;
            }
            *count += 1;
            let times: Vec<f64> = times.iter().map(ms).collect();
            slowest.push(times.iter().copied().fold(0.0, f64::max));
            pairs.extend(times);
        }
        let after = self.api_sample(&lab)?;
        let cpu1 = agent_cpu_now(&agents)?;
        let received1 = received_by_connection(self.netns.name())?;
        let received_meanwhile = received_between(&received0, &received1);
        let per = |v: f64| v / changes.max(1) as f64;
        for (figure, value, unit) in spread(&mut pairs, &mut slowest) {
            put(&figure, value, unit);
        }
        put(
            "API server watch events per change",
            per(after.events - before.events),
            "events",
        );
        put(
            "API server watch event bytes per change",
            per(after.event_bytes - before.event_bytes),
            "bytes",
        );
        put(
            "API server CPU per change",
            per(after.cpu - before.cpu) * 1e3,
            "ms",
        );
        let received: Vec<f64> = agents
            .iter()
            .map(|a| {
                let pid = a.pid();
                per(received_meanwhile.get(&pid).copied().unwrap_or(0) as f64)
            })
            .collect();
        put(
            "bytes received per agent per change (mean)",
            mean(&received),
            "bytes",
        );
        for ((sums, count), kind) in by_kind.iter().zip(["pod", "policy"]) {
            if *count > 0 {
                let each: Vec<f64> = sums.iter().map(|s| s / *count as f64).collect();
                put(
                    &format!("bytes received per agent per {kind} change (mean)"),
                    mean(&each),
                    "bytes",
                );
            }
        }
        let cpu: Vec<f64> = cpu1
            .iter()
            .zip(&cpu0)
            .map(|(a, b)| per(a - b) * 1e3)
            .collect();
        put("CPU per agent per change (mean)", mean(&cpu), "ms");

        if plan.rate_changes > 0 {
            for (figure, value, unit) in self.churn(&agents, plan.rate, plan.rate_changes)? {
                put(&figure, value, unit);
            }
        }

        // An API server restart; etcd keeps the state. Whether each agent lists again
        // depends on whether its watches' resourceVersion is still the newest.
        for (figure, value, unit) in self.restart(&agents, "restart", false, relay.as_ref())? {
            put(&figure, value, unit);
        }
        // The same after a write no agent watches: every watch is too old for the new
        // server's cache (410), and they list again at once.
        for (figure, value, unit) in self.restart(&agents, "410 storm", true, relay.as_ref())? {
            put(&figure, value, unit);
        }

        // Memory over all of it.
        let peaks = peak_rss_mib(&agents)?;
        put("agent peak RSS (mean)", mean(&peaks), "MiB");
        put(
            "agent peak RSS (max)",
            peaks.iter().copied().fold(0.0, f64::max),
            "MiB",
        );
        put(
            "API server RSS at the end",
            status_kib(self.apiserver(), "VmRSS:")? as f64 / 1024.0,
            "MiB",
        );
        if let Some(relay) = &relay {
            put("relay: CPU over the run", cpu_seconds(relay.relay)?, "s");
            put(
                "relay: peak RSS",
                status_kib(relay.relay, "VmHWM:")? as f64 / 1024.0,
                "MiB",
            );
            put(
                "relay: its etcd's CPU over the run",
                cpu_seconds(relay.store)?,
                "s",
            );
            put(
                "relay: its etcd's RSS at the end",
                status_kib(relay.store, "VmRSS:")? as f64 / 1024.0,
                "MiB",
            );
        }
        Ok(figures)
    }

    /// `changes` (rounded up to whole cycles) written at `rate` a second by `weir-lab kube
    /// churn`, which does not wait for the agents; agent a has change k at the first poll
    /// of its status that names the digest after k or after a later change (an agent
    /// that took two changes in one batch never names the first's).
    fn churn(&mut self, agents: &[AgentProc], rate: f64, changes: usize) -> Result<Figures> {
        let lab = self.cluster.lab.clone();
        let changes = changes.div_ceil(CHANGE_CYCLE) * CHANGE_CYCLE;
        let phase = format!("at {rate} a second");
        let mut figures: Figures = Vec::new();
        let mut put = |figure: &str, value: f64, unit: &'static str| {
            figures.push((format!("{phase}: {figure}"), value, unit));
        };
        // One cycle of states, the first what the server holds; after the cycle the world
        // is as it was, and so is the server after whole cycles of changes.
        let mut files = Vec::new();
        for i in 0..CHANGE_CYCLE {
            let file = self.dir.join(format!("churn-{i}.yaml"));
            self.world.write(&file, self.generation)?;
            files.push(file);
            self.next_change();
        }
        let before = self.api_sample(&lab)?;
        let mut child = Command::new(&lab)
            .args(["kube", "churn", "--netns", self.netns.name(), "--dir"])
            .arg(self.api_dir())
            .arg(format!("--interval-ms={}", (1000.0 / rate).round() as u64))
            .arg(format!("--changes={changes}"))
            .args(&files)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting weir-lab kube churn")?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut written: Vec<u64> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        // Per agent, each digest its status named and when it was first seen.
        let mut seen: Vec<HashMap<String, u64>> = vec![HashMap::new(); agents.len()];
        let started = Instant::now();
        let mut checked = Instant::now();
        loop {
            while let Ok(line) = rx.try_recv() {
                let (ns, digest) = parse_churn_line(&line)
                    .with_context(|| format!("weir-lab kube churn printed {line:?}"))?;
                index.insert(digest, written.len());
                written.push(ns);
            }
            let now = monotonic_ns();
            for (a, seen) in agents.iter().zip(seen.iter_mut()) {
                if let Some(status) = a.status().filter(|s| s["converged"] == true) {
                    if let Some(digest) = status["state_digest"].as_str() {
                        seen.entry(digest.to_string()).or_insert(now);
                    }
                }
            }
            let last = (written.len() == changes)
                .then(|| index.iter().find(|(_, &k)| k == changes - 1))
                .flatten();
            if let Some((last, _)) = last {
                if seen.iter().all(|s| s.contains_key(last)) {
                    break;
                }
            }
            if checked.elapsed() >= Duration::from_millis(100) {
                checked = Instant::now();
                for a in agents {
                    a.check_running()?;
                }
                if let Some(status) = child.try_wait()? {
                    if !status.success() || written.len() < changes {
                        let mut err = String::new();
                        if let Some(mut e) = child.stderr.take() {
                            let _ = e.read_to_string(&mut err);
                        }
                        bail!("weir-lab kube churn ended ({status}) after {} of {changes} changes: {}", written.len(), err.trim());
                    }
                }
            }
            if started.elapsed() > LIMIT {
                let _ = child.kill();
                bail!("the agents did not all have {changes} changes at {rate} a second within {LIMIT:?} ({} written)", written.len());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.wait();
        let after = self.api_sample(&lab)?;
        let (mut pairs, mut slowest) = churn_delays(&written, &index, &seen);
        for (figure, value, unit) in spread(&mut pairs, &mut slowest) {
            put(&figure, value, unit);
        }
        let span = written
            .last()
            .copied()
            .unwrap_or(0)
            .saturating_sub(written[0]) as f64
            / 1e9;
        put(
            "changes written a second",
            if span > 0.0 {
                (changes - 1) as f64 / span
            } else {
                0.0
            },
            "/s",
        );
        put(
            "API server CPU per change",
            (after.cpu - before.cpu) / changes as f64 * 1e3,
            "ms",
        );
        Ok(figures)
    }

    /// Stops the API server (etcd keeps the state) and starts it again; with `touch`,
    /// moves etcd's revision on while it is stopped, so that every agent's watches are
    /// older than the new server's cache. Then the next change: how long each agent took
    /// to have it, what each received from the new server until then, and that server's
    /// CPU.
    fn restart(
        &mut self,
        agents: &[AgentProc],
        phase: &str,
        touch: bool,
        relay: Option<&RelayProcs>,
    ) -> Result<Figures> {
        // Agents reading from the relay keep their watches on its etcd: only the relay
        // lists again, and none of them is waited for to begin a list.
        let storm = touch && relay.is_none();
        let mut figures: Figures = Vec::new();
        let mut put = |figure: &str, value: f64, unit: &'static str| {
            figures.push((format!("{phase}: {figure}"), value, unit));
        };
        let listed_before: Vec<usize> = agents.iter().map(AgentProc::pod_listings).collect();
        // Connections to the old server are gone after it; those to the relay's etcd go on.
        let received_before = received_by_connection(self.netns.name())?;
        put(
            "API server ready after",
            self.restart_apiserver(touch)?,
            "s",
        );
        let (written, digest) = self.write(true)?;
        let (times, _) = wait_all(agents, written, self.apiserver(), |s| {
            s["converged"] == true && s["state_digest"].as_str() == Some(digest.as_str())
        })?;
        let mut times: Vec<f64> = times.iter().map(ms).collect();
        put(
            "the next change to every agent p50",
            percentile(&mut times, 50.0),
            "ms",
        );
        put(
            "the next change, slowest agent",
            percentile(&mut times, 100.0),
            "ms",
        );
        // An agent relisting keeps enforcing what it had: the change can reach it (a
        // policy's kind listed already) before its Pods are in. What it receives and what
        // the server spends are counted once every relist has ended.
        // After the storm every agent lists again, but one still in its backoff after the
        // 410 has not begun: it is waited for too, for up to RELIST_GRACE (kube-runtime's
        // backoff tops out at 30 s), and if it never begins, the count below says so.
        let listed = Instant::now();
        while agents.iter().zip(&listed_before).any(|(a, before)| {
            let (started, finished) = a.pod_lists();
            started > finished || (storm && started == *before && listed.elapsed() < RELIST_GRACE)
        }) {
            if listed.elapsed() > LIMIT {
                bail!("{phase}: an agent's list of the Pods did not end within {LIMIT:?}");
            }
            for a in agents {
                a.check_running()?;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        put(
            "every agent's lists done, from the change's write",
            ms(&written.elapsed()),
            "ms",
        );
        let by_process = received_between(
            &received_before,
            &received_by_connection(self.netns.name())?,
        );
        let received: Vec<f64> = agents
            .iter()
            .map(|a| by_process.get(&a.pid()).copied().unwrap_or(0) as f64 / (1024.0 * 1024.0))
            .collect();
        put(
            "MiB received per agent from the new server (mean)",
            mean(&received),
            "MiB",
        );
        if let Some(relay) = relay {
            put(
                "MiB the relay received from the new server",
                by_process.get(&relay.relay).copied().unwrap_or(0) as f64 / (1024.0 * 1024.0),
                "MiB",
            );
        }
        let relisted = agents
            .iter()
            .zip(&listed_before)
            .filter(|(a, before)| a.pod_listings() > **before)
            .count();
        put(
            "agents that listed every pod again",
            relisted as f64,
            "agents",
        );
        put(
            "new API server CPU until every agent had the change and its lists done",
            cpu_seconds(self.apiserver())?,
            "s",
        );
        Ok(figures)
    }

    /// Waits until every agent reports the server's digest: each agent annotates its own
    /// Node after its first convergence, which every agent then receives. A digest taken
    /// before the last annotation landed is taken again.
    fn settle(&mut self, agents: &[AgentProc]) -> Result<()> {
        let mut last = String::new();
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(500));
            let (at, digest) = self.write(false)?;
            let deadline = at + Duration::from_secs(20);
            while Instant::now() < deadline {
                if agents.iter().all(|a| {
                    a.status()
                        .is_some_and(|s| s["state_digest"].as_str() == Some(digest.as_str()))
                }) {
                    return Ok(());
                }
                for a in agents {
                    a.check_running()?;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            last = digest;
        }
        bail!("the agents did not all reach the server's state digest {last} after their start")
    }
}

/// The API server's CPU seconds and the sums of its watch counters.
struct ApiSample {
    cpu: f64,
    events: f64,
    event_bytes: f64,
}

/// One `weir agent --dataplane none`, stopped when dropped.
struct AgentProc {
    index: usize,
    child: Child,
    dir: PathBuf,
}

impl AgentProc {
    fn spawn(
        weir: &Path,
        netns: &Netns,
        run: &Path,
        api: &Path,
        index: usize,
        reading: Reading,
    ) -> Result<Self> {
        let dir = run.join(format!("agent-{index}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let log = File::create(dir.join("agent.log"))?;
        let mut command = Command::new(weir);
        command
            .arg("agent")
            .args([
                "--dataplane",
                "none",
                "--node-name",
                &remote_node_name(index),
            ])
            .arg("--status-file")
            .arg(dir.join("status.json"))
            .args([
                "--listen",
                &format!("127.0.0.1:{}", METRICS_PORT_BASE + index as u16),
            ])
            // Never made: the none dataplane pins nothing.
            .arg("--bpf-root")
            .arg(format!(
                "/sys/fs/bpf/weir-bench-cluster{index}-{}",
                std::process::id()
            ))
            .args(["--verdict-log", "off", "--log-format", "text"])
            .args(reading.args(api))
            .env("KUBECONFIG", api.join("kubeconfig-agent"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        netns.command(&mut command)?;
        // SAFETY: between fork and exec the child only calls sched_setaffinity, an
        // async-signal-safe system call.
        unsafe { command.pre_exec(|| pin(AGENT_CPU)) };
        let child = command
            .spawn()
            .with_context(|| format!("starting agent {index}"))?;
        Ok(AgentProc { index, child, dir })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The status file, when there is one that parses (it is replaced atomically).
    fn status(&self) -> Option<Value> {
        let text = std::fs::read_to_string(self.dir.join("status.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    fn cpu(&self) -> Result<f64> {
        cpu_seconds(self.pid())
    }

    /// How many lists of the cluster's Pods the agent has started and finished (its log's
    /// `listing` and `listed` lines of kind Pod): one at its start, one more for each
    /// relist. (A kind with few objects and no recent event, Nodes or
    /// ClusterNetworkPolicies, may be listed again on any restart; the Pods are what a
    /// relist costs.)
    fn pod_lists(&self) -> (usize, usize) {
        let log = std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default();
        let count = |what: &str| {
            log.lines()
                // `kind="Pod"`, with the log's colour codes around the `=`.
                .filter(|l| l.contains(what) && l.contains("\"Pod\""))
                .count()
        };
        (count(" listing "), count(" listed "))
    }

    fn pod_listings(&self) -> usize {
        self.pod_lists().0
    }

    fn check_running(&self) -> Result<()> {
        if alive(self.pid()) {
            return Ok(());
        }
        bail!(
            "agent {} exited; last lines of its log:\n{}",
            self.index,
            crate::agent::log_tail(&self.dir)
        )
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        crate::agent::stop_child(&mut self.child);
    }
}

/// Polls every agent's status until `done` holds for each; returns, per agent, the time
/// from `since` to the first poll that saw it, and the API server's peak VmRSS (KiB)
/// sampled meanwhile.
fn wait_all(
    agents: &[AgentProc],
    since: Instant,
    apiserver: u32,
    done: impl Fn(&Value) -> bool,
) -> Result<(Vec<Duration>, u64)> {
    let mut times: Vec<Option<Duration>> = vec![None; agents.len()];
    let mut peak = status_kib(apiserver, "VmRSS:").unwrap_or(0);
    let mut sampled = Instant::now();
    while times.iter().any(Option::is_none) {
        for (a, t) in agents.iter().zip(times.iter_mut()) {
            if t.is_none() && a.status().is_some_and(|s| done(&s)) {
                *t = Some(since.elapsed());
            }
        }
        if sampled.elapsed() >= Duration::from_millis(100) {
            peak = peak.max(status_kib(apiserver, "VmRSS:").unwrap_or(0));
            sampled = Instant::now();
            for a in agents {
                a.check_running()?;
            }
        }
        if since.elapsed() > LIMIT {
            let late: Vec<String> = agents
                .iter()
                .zip(&times)
                .filter(|(_, t)| t.is_none())
                .map(|(a, _)| a.index.to_string())
                .collect();
            bail!("agents {} not there within {LIMIT:?}", late.join(", "));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok((times.into_iter().flatten().collect(), peak))
}

/// p50 and p99 of the (agent, change) pairs' times and of the slowest agent's per change.
fn spread(pairs: &mut [f64], slowest: &mut [f64]) -> Figures {
    let (n, changes) = (pairs.len(), slowest.len());
    vec![
        (
            format!("change to every agent p50 (n={n} agent-changes)"),
            percentile(pairs, 50.0),
            "ms",
        ),
        (
            format!("change to every agent p99 (n={n} agent-changes)"),
            percentile(pairs, 99.0),
            "ms",
        ),
        (
            format!("slowest agent per change p50 (n={changes})"),
            percentile(slowest, 50.0),
            "ms",
        ),
        (
            format!("slowest agent per change p99 (n={changes})"),
            percentile(slowest, 99.0),
            "ms",
        ),
    ]
}

/// `written NS digest HEX`, a line of `weir-lab kube churn`.
fn parse_churn_line(line: &str) -> Option<(u64, String)> {
    let rest = line.strip_prefix("written ")?;
    let (ns, digest) = rest.split_once(" digest ")?;
    Some((ns.parse().ok()?, digest.trim().to_string()))
}

/// From when each change was written (CLOCK_MONOTONIC ns), which change each digest is
/// the state after, and each agent's digests with when it first named them: the
/// milliseconds from each change's write to the agent having it or a later one, per
/// (agent, change) pair, and the slowest agent's per change. A digest that is no change's
/// (a state halfway through one's writes) is no evidence of any.
fn churn_delays(
    written: &[u64],
    index: &HashMap<String, usize>,
    seen: &[HashMap<String, u64>],
) -> (Vec<f64>, Vec<f64>) {
    let mut pairs = Vec::new();
    let mut slowest = vec![0.0f64; written.len()];
    for seen in seen {
        let mut first_at = vec![u64::MAX; written.len()];
        for (digest, &at) in seen {
            if let Some(&k) = index.get(digest) {
                first_at[k] = first_at[k].min(at);
            }
        }
        // Having a later change is having this one: the earliest of k and after.
        let mut had = u64::MAX;
        for k in (0..written.len()).rev() {
            had = had.min(first_at[k]);
            if had == u64::MAX {
                continue;
            }
            let delay = had.saturating_sub(written[k]) as f64 / 1e6;
            pairs.push(delay);
            slowest[k] = slowest[k].max(delay);
        }
    }
    (pairs, slowest)
}

/// Each agent's peak RSS (VmHWM) so far, in MiB.
fn peak_rss_mib(agents: &[AgentProc]) -> Result<Vec<f64>> {
    agents
        .iter()
        .map(|a| Ok(status_kib(a.pid(), "VmHWM:")? as f64 / 1024.0))
        .collect()
}

fn agent_cpu_now(agents: &[AgentProc]) -> Result<Vec<f64>> {
    agents.iter().map(AgentProc::cpu).collect()
}

fn ms(d: &Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Restricts the calling thread (and what it starts later) to one CPU.
fn pin(cpu: usize) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET and sched_setaffinity only
    // touch the set we own.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn alive(pid: u32) -> bool {
    // A zombie has not gone yet, but it no longer runs.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit(") ").next().is_some_and(|r| !r.starts_with('Z')))
}

/// A process's user + system CPU time, in seconds.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    // After the command's name: state is field 3, utime 14, stime 15.
    let fields: Vec<&str> = text
        .rsplit_once(") ")
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let tick = |i: usize| -> Result<f64> {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .with_context(|| format!("{path}: field {}", i + 3))
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok((tick(11)? + tick(12)?) / hz)
}

/// A `/proc/PID/status` line in KiB (VmRSS:, VmHWM:).
fn status_kib(pid: u32, key: &str) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("{path} has no {key} line"))
}

/// Bytes received on each process's established TCP connections to the API server, by
/// pid (`ss -tinp`; a connection closed since is no longer counted).
/// `weir relay` and its etcd, as `weir-lab kube start-relay` starts them (in the control
/// plane's namespace, on its CPU: the bench's affinity is inherited).
struct RelayProcs {
    relay: u32,
    store: u32,
}

impl RelayProcs {
    fn start(lab: &Path, netns: &Netns, api: &Path) -> Result<Self> {
        let pids = kube_start(lab, "start-relay", netns, api, &["relay_pid", "store_pid"])?;
        Ok(RelayProcs {
            relay: pids[0],
            store: pids[1],
        })
    }
}

impl Drop for RelayProcs {
    fn drop(&mut self) {
        for pid in [self.relay, self.store] {
            // SAFETY: kill only sends a signal; both are this bench's.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// Bytes received on each TCP connection to the API server (or to the relay's etcd), by
/// (process, local address).
type Received = BTreeMap<(u32, String), u64>;

fn received_by_connection(netns: &str) -> Result<Received> {
    let mut command = Command::new("ip");
    command.args([
        "netns",
        "exec",
        netns,
        "ss",
        "-tinpH",
        "state",
        "established",
    ]);
    command.args([
        "(",
        "dport",
        "=",
        APISERVER_PORT,
        "or",
        "dport",
        "=",
        RELAY_STORE_PORT,
        ")",
    ]);
    let out = output_within(&mut command, Duration::from_secs(30))?;
    if !out.status.success() {
        bail!(
            "ss in {netns}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(parse_ss(&String::from_utf8_lossy(&out.stdout)))
}

/// `ss -tinpH` output: a socket's line gives its local address (the third column) and
/// names its process (`users:(("weir",pid=N,fd=M))`), its details (on the same line or the
/// next) its `bytes_received:N`.
fn parse_ss(text: &str) -> Received {
    let mut received = BTreeMap::new();
    let mut socket = None;
    for line in text.lines() {
        if let Some(p) = line
            .split("pid=")
            .nth(1)
            .and_then(|r| r.split([',', ')']).next())
            .and_then(|p| p.parse::<u32>().ok())
        {
            let local = line.split_whitespace().nth(2).unwrap_or_default();
            socket = Some((p, local.to_string()));
        }
        let bytes = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("bytes_received:"))
            .and_then(|n| n.parse::<u64>().ok());
        if let (Some(s), Some(n)) = (&socket, bytes) {
            *received.entry(s.clone()).or_default() += n;
            socket = None;
        }
    }
    received
}

/// What each process received between two reads: each connection's growth, and the whole
/// of a connection opened between them (a watch that reconnected; a total by process
/// would shrink then). A connection closed between them counts nothing.
fn received_between(before: &Received, after: &Received) -> BTreeMap<u32, u64> {
    let mut by_pid = BTreeMap::new();
    for (socket, n) in after {
        let earlier = before.get(socket).copied().unwrap_or(0);
        *by_pid.entry(socket.0).or_default() += n.saturating_sub(earlier);
    }
    by_pid
}

/// Runs `command` to completion, killing it after `limit`.
fn output_within(command: &mut Command, limit: Duration) -> Result<Output> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {command:?}"))?;
    let started = Instant::now();
    // The output is read on threads, so a large one cannot block the child.
    let mut stdout = child.stdout.take().context("stdout")?;
    let mut stderr = child.stderr.take().context("stderr")?;
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut v);
        v
    });
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{command:?} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Ok(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::{churn_delays, parse_churn_line, parse_ss, received_between, Received};
    use std::collections::HashMap;

    #[test]
    fn ss_lines_are_summed_by_process() {
        let text = "0 0 127.0.0.1:40000 127.0.0.1:6443 users:((\"weir\",pid=12,fd=9))\n\t cubic wscale:7,7 bytes_sent:100 bytes_received:5000 segs_out:3\n0 0 127.0.0.1:40002 127.0.0.1:6443 users:((\"weir\",pid=12,fd=10)) cubic bytes_received:7\n0 0 127.0.0.1:40004 127.0.0.1:6443 users:((\"weir\",pid=13,fd=9))\n\t cubic bytes_acked:1\n";
        let received = parse_ss(text);
        let by_pid = received_between(&Received::new(), &received);
        assert_eq!(by_pid.get(&12), Some(&5007));
        assert_eq!(by_pid.get(&13), None);
        assert_eq!(received.get(&(12, "127.0.0.1:40002".into())), Some(&7));
    }

    #[test]
    fn a_churn_line_is_a_write_time_and_a_digest() {
        assert_eq!(
            parse_churn_line("written 123456789 digest 00ff00ff00ff00ff"),
            Some((123456789, "00ff00ff00ff00ff".to_string()))
        );
        assert_eq!(parse_churn_line("digest 00ff"), None);
        assert_eq!(parse_churn_line("written x digest 00ff"), None);
    }

    #[test]
    fn an_agent_that_skipped_a_change_had_it_with_the_next() {
        // Changes written at 0, 100 and 200 ms; the agent named the first's digest at
        // 30 ms, never the second's, the third's at 250 ms, and a digest of no change.
        let ms = 1_000_000;
        let written = [0, 100 * ms, 200 * ms];
        let index: HashMap<String, usize> = [("a", 0), ("b", 1), ("c", 2)]
            .into_iter()
            .map(|(d, k)| (d.to_string(), k))
            .collect();
        let seen: Vec<HashMap<String, u64>> =
            vec![[("a", 30 * ms), ("halfway", 120 * ms), ("c", 250 * ms)]
                .into_iter()
                .map(|(d, t)| (d.to_string(), t))
                .collect()];
        let (mut pairs, slowest) = churn_delays(&written, &index, &seen);
        pairs.sort_by(f64::total_cmp);
        assert_eq!(pairs, vec![30.0, 50.0, 150.0]);
        assert_eq!(slowest, vec![30.0, 150.0, 50.0]);
    }

    #[test]
    fn a_reconnected_watch_counts_its_new_connection_whole() {
        let before = parse_ss("0 0 10.0.0.2:40000 10.0.0.1:6443 users:((\"weir\",pid=12,fd=9)) bytes_received:9000\n0 0 10.0.0.2:40002 10.0.0.1:6443 users:((\"weir\",pid=12,fd=10)) bytes_received:100\n");
        // 40000 closed, 40004 opened; 40002 grew by 50.
        let after = parse_ss("0 0 10.0.0.2:40002 10.0.0.1:6443 users:((\"weir\",pid=12,fd=10)) bytes_received:150\n0 0 10.0.0.2:40004 10.0.0.1:6443 users:((\"weir\",pid=12,fd=9)) bytes_received:700\n");
        assert_eq!(received_between(&before, &after).get(&12), Some(&750));
    }
}
