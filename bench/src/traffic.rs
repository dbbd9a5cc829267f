//! Traffic between the client and server pods: TCP throughput with iperf3 (Debian's), and
//! request/response latency with a small echo probe (one persistent connection, and one
//! new connection per request, which is where per-connection policy cost shows).
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::netns::Netns;
use super::world::{IPERF_PORT, LATENCY_PORT, SERVER_IP, TOGGLE_PORT};

const MESSAGE: usize = 64;
/// New connections per measurement at most, so that TIME_WAIT sockets never exhaust the
/// client's ephemeral ports.
const MAX_CONNECTIONS: usize = 10_000;

/// The server pod's listeners: an echo server, a port that only accepts (for the
/// convergence probe) and iperf3. All stop when dropped.
pub struct Servers {
    listeners: Vec<(TcpListener, JoinHandle<()>)>,
    iperf: Child,
}

impl Servers {
    pub fn start(server: &Netns) -> Result<Self> {
        let echo = listen(server, LATENCY_PORT)?;
        let accept = listen(server, TOGGLE_PORT)?;
        let mut iperf = Command::new("iperf3");
        iperf
            .args(["--server", "--port", &IPERF_PORT.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        server.command(&mut iperf)?;
        let iperf = iperf
            .spawn()
            .context("starting iperf3 (installed by `cargo xtask setup`)")?;
        let echo_thread = serve(&echo, echo_connection)?;
        let accept_thread = serve(&accept, |_| {})?;
        Ok(Servers {
            listeners: vec![(echo, echo_thread), (accept, accept_thread)],
            iperf,
        })
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        let _ = self.iperf.kill();
        let _ = self.iperf.wait();
        for (listener, thread) in self.listeners.drain(..) {
            // Shutting a listening socket down wakes the thread blocked in accept.
            // SAFETY: shutdown on a socket fd that `listener` owns.
            unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RDWR) };
            let _ = thread.join();
        }
    }
}

fn listen(server: &Netns, port: u16) -> Result<TcpListener> {
    server.run(|| {
        TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("listening on port {port}"))
    })
}

/// The CPU that the latency probe's client and echo server both run on. On these 2-vCPU
/// virtual machines a wakeup across CPUs costs an inter-processor interrupt of tens of
/// µs, which swamps the enforcement's cost and depends on where the scheduler happened to
/// place the two threads: in one run (2026-12-05, unpinned), RR p50 with no enforcement
/// was 61–75 µs in most setups and 6 µs in one. On one CPU every setup pays the same.
const PROBE_CPU: usize = 0;

/// Pins the calling thread to [`PROBE_CPU`].
fn pin_to_probe_cpu() -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity only
    // touch it and this thread's affinity.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(PROBE_CPU, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Serves connections one at a time (the client is sequential) until the listener is
/// shut down, on [`PROBE_CPU`].
fn serve(listener: &TcpListener, handle: fn(TcpStream)) -> Result<JoinHandle<()>> {
    let listener = listener.try_clone()?;
    let (pinned, result) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        if pinned.send(pin_to_probe_cpu()).is_err() {
            return;
        }
        while let Ok((conn, _)) = listener.accept() {
            handle(conn);
        }
    });
    result
        .recv()
        .context("the server thread ended before it started")?
        .with_context(|| format!("pinning the probe's server to CPU {PROBE_CPU}"))?;
    Ok(thread)
}

fn echo_connection(mut conn: TcpStream) {
    let _ = conn.set_nodelay(true);
    let mut buf = [0u8; MESSAGE];
    while conn.read_exact(&mut buf).is_ok() {
        if conn.write_all(&buf).is_err() {
            break;
        }
    }
}

fn server_addr(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(SERVER_IP, port))
}

/// TCP throughput from client to server in bits per second (iperf3, one stream).
pub fn throughput(client: &Netns, seconds: u32) -> Result<f64> {
    let mut last_error = String::new();
    // iperf3's server may still be starting: retry a refused connection briefly.
    for _ in 0..20 {
        let mut c = Command::new("iperf3");
        c.args([
            "--client",
            &SERVER_IP.to_string(),
            "--port",
            &IPERF_PORT.to_string(),
        ])
        .args(["--time", &seconds.to_string(), "--json"]);
        client.command(&mut c)?;
        let out = c.output().context("running iperf3")?;
        let report: serde_json::Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("iperf3 printed no JSON (exit {})", out.status))?;
        if let Some(bps) = report["end"]["sum_received"]["bits_per_second"].as_f64() {
            return Ok(bps);
        }
        last_error = report["error"].as_str().unwrap_or("no result").to_string();
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("iperf3 failed: {last_error}")
}

/// Round-trip times (µs) of 64-byte request/responses for `duration`: on one persistent
/// connection, or with a new connection per request when `reconnect`; the client on
/// [`PROBE_CPU`], as the echo server.
pub fn round_trips(client: &Netns, duration: Duration, reconnect: bool) -> Result<Vec<f64>> {
    client.run(|| {
        pin_to_probe_cpu()
            .with_context(|| format!("pinning the probe's client to CPU {PROBE_CPU}"))?;
        let addr = server_addr(LATENCY_PORT);
        let mut samples = Vec::new();
        let mut conn: Option<TcpStream> = None;
        let end = Instant::now() + duration;
        let mut buf = [7u8; MESSAGE];
        while Instant::now() < end && !(reconnect && samples.len() >= MAX_CONNECTIONS) {
            let started = Instant::now();
            let stream = match &mut conn {
                Some(c) => c,
                None => {
                    let c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
                        .context("connecting to the echo server")?;
                    c.set_nodelay(true)?;
                    conn.insert(c)
                }
            };
            stream.write_all(&buf).context("echo request")?;
            stream.read_exact(&mut buf).context("echo response")?;
            if reconnect {
                let _ = stream.shutdown(Shutdown::Both);
                conn = None;
            }
            samples.push(started.elapsed().as_secs_f64() * 1e6);
        }
        if samples.is_empty() {
            bail!("no round trip completed in {duration:?}");
        }
        Ok(samples)
    })
}

/// Whether a new connection from the client to the server's TOGGLE_PORT succeeds. Called
/// on a thread already inside the client namespace.
pub fn toggle_port_open(timeout: Duration) -> bool {
    TcpStream::connect_timeout(&server_addr(TOGGLE_PORT), timeout).is_ok()
}

/// The p-th percentile (0 < p <= 100) by nearest rank.
pub fn percentile(samples: &mut [f64], p: f64) -> f64 {
    samples.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * samples.len() as f64).ceil() as usize;
    samples[rank.clamp(1, samples.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentile_is_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&mut v, 50.0), 50.0);
        assert_eq!(percentile(&mut v, 99.0), 99.0);
        assert_eq!(percentile(&mut [3.0], 99.0), 3.0);
    }
}
