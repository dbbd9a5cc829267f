//! The real `weir agent` in file mode, inside the bench node's namespace: started cold,
//! waited on through its status file, measured through /proc, stopped (and its BPF pins
//! removed) when dropped.
use std::fs::File;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::netns::Netns;
use super::world::{World, NODE_NAME};

/// Where the agent serves /metrics, inside its node's namespace.
const METRICS_ADDR: &str = "127.0.0.1:9402";
/// How often the agent checks the manifest file (the bench's notes quote it).
pub const POLL_MS: u64 = 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dataplane {
    Ebpf,
    Iptables,
}

impl Dataplane {
    pub const ALL: [Dataplane; 2] = [Dataplane::Ebpf, Dataplane::Iptables];

    pub fn as_str(self) -> &'static str {
        match self {
            Dataplane::Ebpf => "ebpf",
            Dataplane::Iptables => "iptables",
        }
    }
}

pub struct Agent {
    child: Child,
    dir: PathBuf,
    bpf_root: PathBuf,
    dataplane: Dataplane,
    generation: u64,
}

impl Agent {
    /// Writes generation 1 of `world` to a fresh directory `dir` and starts the agent on it;
    /// returns with the agent and the instant it was started.
    pub fn start(
        weir: &Path,
        node: &Netns,
        dir: &Path,
        dataplane: Dataplane,
        world: &World,
    ) -> Result<(Self, Instant)> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        world.write(&dir.join("manifests.yaml"), 1)?;
        let trial = dir.file_name().unwrap_or_default().to_string_lossy();
        let bpf_root = PathBuf::from(format!(
            "/sys/fs/bpf/weir-bench-{trial}-{}",
            std::process::id()
        ));
        let log = File::create(dir.join("agent.log"))?;
        let mut command = Command::new(weir);
        command
            .arg("agent")
            .arg("--manifests")
            .arg(dir.join("manifests.yaml"))
            .arg("--status-file")
            .arg(dir.join("status.json"))
            .args(["--dataplane", dataplane.as_str(), "--node-name", NODE_NAME])
            .args(["--poll-ms", &POLL_MS.to_string(), "--listen", METRICS_ADDR])
            .arg("--bpf-root")
            .arg(&bpf_root)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        node.command(&mut command)?;
        let started = Instant::now();
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", weir.display()))?;
        let agent = Agent {
            child,
            dir: dir.to_path_buf(),
            bpf_root,
            dataplane,
            generation: 1,
        };
        Ok((agent, started))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Writes the next generation of `world`; returns the instant it became visible.
    pub fn update(&mut self, world: &World) -> Result<Instant> {
        self.generation += 1;
        world.write(&self.dir.join("manifests.yaml"), self.generation)?;
        Ok(Instant::now())
    }

    /// Waits until the agent reports the latest generation converged on the requested
    /// dataplane with no errors; returns the instant it saw that.
    pub fn wait_converged(&mut self, timeout: Duration) -> Result<Instant> {
        let deadline = Instant::now() + timeout;
        let path = self.dir.join("status.json");
        loop {
            if let Some(status) = read_status(&path)? {
                if status["generation"].as_u64() >= Some(self.generation)
                    && status["converged"] == true
                {
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
            value("weir_apply_duration_seconds_sum")?,
            value("weir_apply_duration_seconds_count")?,
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
        let text = std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: kill with a pid this process spawned and has not reaped yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.bpf_root.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.bpf_root) {
                eprintln!("bench: cleanup: removing {}: {e}", self.bpf_root.display());
            }
        }
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
