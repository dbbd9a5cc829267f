//! Socket probes inside a namespace: echo servers and one-shot TCP/UDP clients.

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        atomic::{AtomicBool, AtomicU32, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use crate::pods::enter;

/// TCP and UDP echo servers on the given ports in a namespace; stopped on drop.
pub struct EchoServers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl EchoServers {
    pub fn start(ns: &str, ports: &[u16]) -> EchoServers {
        Self::start_on(ns, IpAddr::V4(Ipv4Addr::UNSPECIFIED), ports)
    }

    pub fn start_v6(ns: &str, ports: &[u16]) -> EchoServers {
        Self::start_on(ns, IpAddr::V6(Ipv6Addr::UNSPECIFIED), ports)
    }

    fn start_on(ns: &str, bind: IpAddr, ports: &[u16]) -> EchoServers {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for &port in ports {
            let (ns1, ns2) = (ns.to_string(), ns.to_string());
            let (s1, s2) = (stop.clone(), stop.clone());
            let (tx, rx) = std::sync::mpsc::channel();
            let tx2 = tx.clone();
            threads.push(std::thread::spawn(move || {
                enter(&ns1);
                let l = TcpListener::bind((bind, port)).expect("bind tcp");
                l.set_nonblocking(true).unwrap();
                tx.send(()).unwrap();
                while !s1.load(Ordering::SeqCst) {
                    match l.accept() {
                        Ok((mut c, _)) => {
                            c.set_nonblocking(false).unwrap();
                            c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                            let mut buf = [0u8; 64];
                            if let Ok(n) = c.read(&mut buf) {
                                let _ = c.write_all(&buf[..n]);
                            }
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            }));
            threads.push(std::thread::spawn(move || {
                enter(&ns2);
                let s = UdpSocket::bind((bind, port)).expect("bind udp");
                s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                tx2.send(()).unwrap();
                let mut buf = [0u8; 64];
                while !s2.load(Ordering::SeqCst) {
                    if let Ok((n, from)) = s.recv_from(&mut buf) {
                        let _ = s.send_to(&buf[..n], from);
                    }
                }
            }));
            rx.recv().unwrap();
            rx.recv().unwrap();
        }
        EchoServers { stop, threads }
    }
}

impl Drop for EchoServers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Connects, sends a line and expects it echoed, all within `timeout`.
pub fn tcp_echo(to: SocketAddr, timeout: Duration) -> bool {
    let Ok(mut c) = TcpStream::connect_timeout(&to, timeout) else {
        return false;
    };
    c.set_read_timeout(Some(timeout)).unwrap();
    if c.write_all(b"weir").is_err() {
        return false;
    }
    let mut buf = [0u8; 4];
    c.read_exact(&mut buf).is_ok() && &buf == b"weir"
}

/// Sends one datagram and expects it echoed within `timeout`.
pub fn udp_echo(to: SocketAddr, timeout: Duration) -> bool {
    let s = UdpSocket::bind("0.0.0.0:0").unwrap();
    s.set_read_timeout(Some(timeout)).unwrap();
    if s.send_to(b"weir", to).is_err() {
        return false;
    }
    let mut buf = [0u8; 4];
    matches!(s.recv_from(&mut buf), Ok((4, _))) && &buf == b"weir"
}

/// A probe run from inside namespace `ns`.
pub fn tcp_from(ns: &str, to: SocketAddr, timeout: Duration) -> bool {
    let ns = ns.to_string();
    crate::pods::run_in(&ns, move || tcp_echo(to, timeout))
}

pub fn udp_from(ns: &str, to: SocketAddr, timeout: Duration) -> bool {
    let ns = ns.to_string();
    crate::pods::run_in(&ns, move || udp_echo(to, timeout))
}

/// Probes from a namespace in a loop until dropped: `allowed` must always answer,
/// `denied` never. Counts rounds and violations.
pub struct ContinuousProbe {
    stop: Arc<AtomicBool>,
    pub tally: Arc<Tally>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
pub struct Tally {
    pub rounds: AtomicU32,
    pub allowed_failed: AtomicU32,
    pub denied_passed: AtomicU32,
}

impl ContinuousProbe {
    pub fn start(ns: &str, allowed: SocketAddr, denied: SocketAddr) -> ContinuousProbe {
        Self::start_with_timeout(ns, allowed, denied, Duration::from_millis(300))
    }

    /// With a longer `timeout`, an allowed connection whose first SYN or SYN-ACK was lost
    /// still counts if TCP's retransmission (1 s) gets through.
    pub fn start_with_timeout(
        ns: &str,
        allowed: SocketAddr,
        denied: SocketAddr,
        timeout: Duration,
    ) -> ContinuousProbe {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Tally::default());
        let (s, t, ns) = (stop.clone(), tally.clone(), ns.to_string());
        let thread = std::thread::spawn(move || {
            enter(&ns);
            while !s.load(Ordering::SeqCst) {
                if !tcp_echo(allowed, timeout) {
                    t.allowed_failed.fetch_add(1, Ordering::SeqCst);
                }
                if tcp_echo(denied, timeout) {
                    t.denied_passed.fetch_add(1, Ordering::SeqCst);
                }
                t.rounds.fetch_add(1, Ordering::SeqCst);
            }
        });
        ContinuousProbe {
            stop,
            tally,
            thread: Some(thread),
        }
    }

    pub fn rounds(&self) -> u32 {
        self.tally.rounds.load(Ordering::SeqCst)
    }

    /// Stops and asserts that no round saw a violation.
    pub fn finish(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("prober panicked");
        }
        let t = &self.tally;
        assert_eq!(
            t.allowed_failed.load(Ordering::SeqCst),
            0,
            "an allowed flow failed"
        );
        assert_eq!(
            t.denied_passed.load(Ordering::SeqCst),
            0,
            "a denied flow passed"
        );
    }
}

impl Drop for ContinuousProbe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What [`crate::desired::whole_space_except`] promises on a world of pods a, b and c,
/// probed: a reaches b over IPv4 (TCP and UDP: every protocol) and IPv6; c, the except,
/// reaches b over neither family.
pub fn check_whole_space_except(world: &crate::pods::World, b: Ipv4Addr, b6: Ipv6Addr) {
    const T: Duration = Duration::from_millis(500);
    let (a, c) = (&world.pod("a").ns, &world.pod("c").ns);
    let (to_b, to_b6) = (SocketAddr::from((b, 80)), SocketAddr::from((b6, 80)));
    assert!(tcp_from(a, to_b, T), "a is in 0.0.0.0/0");
    assert!(udp_from(a, to_b, T), "every protocol is allowed");
    // Neighbour discovery may take a few tries; an allowed probe only gets retries.
    assert!((0..10).any(|_| tcp_from(a, to_b6, T)), "a is in ::/0");
    assert!(!tcp_from(c, to_b, T), "c is the IPv4 except");
    assert!(!tcp_from(c, to_b6, T), "c is the IPv6 except");
}
