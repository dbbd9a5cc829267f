//! The prober: real TCP, UDP and SCTP traffic from every pod to every other pod on every
//! port the target declares. One thread per source pod enters that pod's namespace and
//! drives all its probes at once with non-blocking sockets, so a whole matrix costs about
//! one timeout. A probe goes to the pod's own address, or (`--via service`) to the
//! ClusterIP of a Service that has the pod behind it, through the node's kube-proxy.

use std::collections::{BTreeMap, HashMap};
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use socket2::{Domain, Socket, Type};

use super::listen::{raw_sctp_socket, recv_sctp_chunk};
use super::netns;
use super::sctp::{self, ChunkKind};
use super::services::Frontend;
use super::state::PodState;
use super::LabError;
use weir_policy::desired::Protocol;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IpFamily {
    Ipv4,
    Ipv6,
}

/// `weir-lab probe --via`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Via {
    Pod,
    Service,
    Both,
}

/// What one probe connected to: the pod's address or a Service's ClusterIP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Route {
    #[default]
    Pod,
    Service,
}

/// One probe's outcome, as `weir-lab probe --output json` prints it. `port` is the pod's
/// port also when the probe went through a Service (on the Service's own port).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe {
    pub from: String,
    pub to: String,
    pub port: u16,
    #[serde(with = "protocol_name")]
    pub protocol: Protocol,
    pub connected: bool,
    #[serde(default)]
    pub via: Route,
}

/// A target no Service reaches: its service probes are not made (and not counted).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Skipped {
    pub to: String,
    pub port: u16,
    #[serde(with = "protocol_name")]
    pub protocol: Protocol,
    pub reason: String,
}

/// Every source pod's targets, and the service targets left out.
pub struct Plan {
    family: IpFamily,
    targets: Vec<Vec<Target>>,
    pub skipped: Vec<Skipped>,
}

/// Plans the probes from every pod (in `pods` order) to every other pod's declared ports,
/// by the routes `via` asks for. `frontends` maps (pod, port, protocol) to the Service
/// frontend reaching it (see [`super::services::frontends`]).
pub fn plan(
    pods: &[PodState],
    family: IpFamily,
    via: Via,
    frontends: &BTreeMap<(String, u16, Protocol), Frontend>,
) -> Plan {
    let mut skipped = BTreeMap::new();
    let targets = pods
        .iter()
        .map(|src| {
            let mut targets = Vec::new();
            if via != Via::Service {
                targets.extend(targets_of(src, pods, family));
            }
            if via != Via::Pod {
                targets.extend(service_targets_of(
                    src,
                    pods,
                    family,
                    frontends,
                    &mut skipped,
                ));
            }
            targets
        })
        .collect();
    Plan {
        family,
        targets,
        skipped: skipped.into_values().collect(),
    }
}

fn service_targets_of(
    src: &PodState,
    pods: &[PodState],
    family: IpFamily,
    frontends: &BTreeMap<(String, u16, Protocol), Frontend>,
    skipped: &mut BTreeMap<(String, u16, Protocol), Skipped>,
) -> Vec<Target> {
    let mut targets = Vec::new();
    for dst in pods.iter().filter(|p| p.key() != src.key()) {
        for p in &dst.ports {
            let key = (dst.key(), p.port, p.protocol);
            let reason = match (family, frontends.get(&key)) {
                (IpFamily::Ipv4, Some(f)) => {
                    targets.push(Target {
                        to: dst.key(),
                        addr: SocketAddr::new(IpAddr::V4(f.ip), f.port),
                        port: p.port,
                        protocol: p.protocol,
                        route: Route::Service,
                    });
                    continue;
                }
                (IpFamily::Ipv6, _) => "the lab's Services are IPv4 only",
                (IpFamily::Ipv4, None) => "no Service has this pod on this port behind it",
            };
            skipped.entry(key).or_insert_with(|| Skipped {
                to: dst.key(),
                port: p.port,
                protocol: p.protocol,
                reason: reason.to_string(),
            });
        }
    }
    targets
}

/// Probes every ordered pair of distinct pods; results are sorted by from, to, port, protocol.
///
/// `run` numbers this probe run within the lab: it picks the source ports, so that no
/// probe reuses the 5-tuple of a recent one. A reused tuple would find the conntrack
/// entry of an earlier, perhaps then allowed, flow and measure that instead of the policy.
pub fn probe_all(
    pods: &[PodState],
    plan: &Plan,
    timeout: Duration,
    run: u64,
) -> Result<Vec<Probe>, LabError> {
    let all_targets = &plan.targets;
    let family = plan.family;
    let band = all_targets.iter().map(Vec::len).max().unwrap_or(0) as u64;
    let mut results = std::thread::scope(|s| {
        let handles: Vec<_> = pods
            .iter()
            .zip(all_targets)
            .map(|(src, targets)| {
                let ports = source_ports(run, band, targets.len());
                s.spawn(move || probe_from(src, targets, &ports, family, timeout))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("probe thread panicked"))
            .collect::<Result<Vec<_>, _>>()
    })?
    .into_iter()
    .flatten()
    .collect::<Vec<_>>();
    results.sort_by(|a, b| {
        (&a.from, &a.to, a.port, a.protocol, a.via)
            .cmp(&(&b.from, &b.to, b.port, b.protocol, b.via))
    });
    Ok(results)
}

struct Target {
    to: String,
    /// Where the probe connects: the pod's address and port, or a Service frontend.
    addr: SocketAddr,
    /// The pod's port, as reported.
    port: u16,
    protocol: Protocol,
    route: Route,
}

fn targets_of(src: &PodState, pods: &[PodState], family: IpFamily) -> Vec<Target> {
    let mut targets = Vec::new();
    for dst in pods.iter().filter(|p| p.key() != src.key()) {
        let ip: Option<IpAddr> = match family {
            IpFamily::Ipv4 => dst.ipv4.map(IpAddr::V4),
            IpFamily::Ipv6 => dst.ipv6.map(IpAddr::V6),
        };
        let Some(ip) = ip else { continue };
        for p in &dst.ports {
            targets.push(Target {
                to: dst.key(),
                addr: SocketAddr::new(ip, p.port),
                port: p.port,
                protocol: p.protocol,
                route: Route::Pod,
            });
        }
    }
    targets
}

/// What a probe in flight waits for.
enum InFlight {
    /// A TCP connect or a UDP echo, decided by its own socket.
    Socket(Socket),
    /// An INIT-ACK to (target, our port, our tag) on the shared raw socket.
    Sctp {
        src_port: u16,
        tag: u32,
    },
    Done(bool),
}

fn probe_from(
    src: &PodState,
    targets: &[Target],
    ports: &[u16],
    family: IpFamily,
    timeout: Duration,
) -> Result<Vec<Probe>, LabError> {
    let fd = netns::open(&src.netns)?;
    netns::enter(&fd).map_err(|e| LabError::io(format!("entering netns {}", src.netns), e))?;
    let domain = match family {
        IpFamily::Ipv4 => Domain::IPV4,
        IpFamily::Ipv6 => Domain::IPV6,
    };
    let raw = targets
        .iter()
        .any(|t| t.protocol == Protocol::Sctp)
        .then(|| raw_sctp_socket(domain))
        .transpose()?;
    let mut flights: Vec<InFlight> = targets
        .iter()
        .zip(ports)
        .map(|(t, src_port)| start(t, domain, raw.as_ref(), *src_port))
        .collect();
    let deadline = Instant::now() + timeout;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        if flights.iter().all(|f| matches!(f, InFlight::Done(_))) {
            break;
        }
        wait_and_settle(&mut flights, targets, raw.as_ref(), domain, left);
    }
    Ok(targets
        .iter()
        .zip(flights)
        .map(|(t, f)| Probe {
            from: src.key(),
            to: t.to.clone(),
            port: t.port,
            protocol: t.protocol,
            connected: matches!(f, InFlight::Done(true)),
            via: t.route,
        })
        .collect())
}

fn start(t: &Target, domain: Domain, raw: Option<&Socket>, src_port: u16) -> InFlight {
    let sent = match t.protocol {
        Protocol::Tcp => tcp_connect(domain, src_port, t.addr).map(InFlight::Socket),
        Protocol::Udp => udp_send(domain, src_port, t.addr).map(InFlight::Socket),
        Protocol::Sctp => {
            let raw = raw.expect("raw socket opened for SCTP targets");
            let tag = random_u32() | 1;
            let target = SocketAddr::new(t.addr.ip(), 0);
            raw.send_to(&sctp::init(src_port, t.addr.port(), tag), &target.into())
                .map(|_| InFlight::Sctp { src_port, tag })
        }
    };
    sent.unwrap_or(InFlight::Done(false))
}

/// A socket on `src_port`, or on an ephemeral port when that one is taken.
fn bound_socket(domain: Domain, ty: Type, src_port: u16) -> std::io::Result<Socket> {
    let s = Socket::new(domain, ty, None)?;
    s.set_nonblocking(true)?;
    let any: IpAddr = match domain {
        Domain::IPV6 => std::net::Ipv6Addr::UNSPECIFIED.into(),
        _ => std::net::Ipv4Addr::UNSPECIFIED.into(),
    };
    // Taken ports are rare (ephemeral range, rotated); the kernel then picks one.
    let _ = s.bind(&SocketAddr::new(any, src_port).into());
    Ok(s)
}

fn tcp_connect(domain: Domain, src_port: u16, addr: SocketAddr) -> std::io::Result<Socket> {
    let s = bound_socket(domain, Type::STREAM, src_port)?;
    match s.connect(&addr.into()) {
        Ok(()) => Ok(s),
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(s),
        Err(e) => Err(e),
    }
}

fn udp_send(domain: Domain, src_port: u16, addr: SocketAddr) -> std::io::Result<Socket> {
    let s = bound_socket(domain, Type::DGRAM, src_port)?;
    s.connect(&addr.into())?;
    s.send(b"weir-lab-probe")?;
    Ok(s)
}

/// Waits until a socket is ready or `left` passes, and settles what became decidable.
fn wait_and_settle(
    flights: &mut [InFlight],
    targets: &[Target],
    raw: Option<&Socket>,
    domain: Domain,
    left: Duration,
) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut owners: Vec<usize> = Vec::new();
    for (i, f) in flights.iter().enumerate() {
        if let InFlight::Socket(s) = f {
            let events = match targets[i].protocol {
                Protocol::Tcp => libc::POLLOUT,
                _ => libc::POLLIN,
            };
            fds.push(pollfd(s.as_raw_fd(), events));
            owners.push(i);
        }
    }
    if let Some(raw) = raw {
        fds.push(pollfd(raw.as_raw_fd(), libc::POLLIN));
    }
    let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: fds is a valid, exclusively borrowed array of pollfd.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if ready <= 0 {
        return;
    }
    for (pfd, &i) in fds.iter().zip(&owners) {
        if pfd.revents == 0 {
            continue;
        }
        if let InFlight::Socket(s) = &flights[i] {
            flights[i] = InFlight::Done(socket_verdict(s, targets[i].protocol));
        }
    }
    if let (Some(raw), Some(last)) = (raw, fds.last()) {
        if last.revents != 0 {
            drain_init_acks(raw, domain, flights, targets);
        }
    }
}

fn pollfd(fd: RawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

fn socket_verdict(s: &Socket, protocol: Protocol) -> bool {
    match protocol {
        Protocol::Tcp => matches!(s.take_error(), Ok(None)),
        _ => {
            let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 64];
            s.recv(&mut buf).is_ok()
        }
    }
}

/// Reads every queued SCTP packet and completes the probes whose INIT-ACK arrived.
fn drain_init_acks(raw: &Socket, domain: Domain, flights: &mut [InFlight], targets: &[Target]) {
    let waiting: HashMap<(IpAddr, u16, u16, u32), usize> = flights
        .iter()
        .enumerate()
        .filter_map(|(i, f)| match f {
            InFlight::Sctp { src_port, tag } => Some((
                (
                    targets[i].addr.ip(),
                    targets[i].addr.port(),
                    *src_port,
                    *tag,
                ),
                i,
            )),
            _ => None,
        })
        .collect();
    loop {
        let (chunk, from) = match recv_sctp_chunk(raw, domain, libc::MSG_DONTWAIT) {
            Ok(got) => got,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        let (Some(chunk), Some(from)) = (chunk, from.as_socket()) else {
            continue;
        };
        if chunk.kind != ChunkKind::InitAck {
            continue;
        }
        if let Some(&i) = waiting.get(&(from.ip(), chunk.src_port, chunk.dst_port, chunk.vtag)) {
            flights[i] = InFlight::Done(true);
        }
    }
}

/// Source ports of one source pod's probes in run `run`: run r uses the r-th band of
/// `band` ports of the ephemeral range, so a tuple comes back only after the range has
/// been cycled through (hundreds of runs for the 9-pod world).
fn source_ports(run: u64, band: u64, n: usize) -> Vec<u16> {
    const FIRST: u64 = 32768;
    const SPAN: u64 = 28000;
    (0..n as u64)
        .map(|i| (FIRST + (run.wrapping_mul(band.max(1)) + i) % SPAN) as u16)
        .collect()
}

fn random_u32() -> u32 {
    let mut bytes = [0u8; 4];
    // SAFETY: getrandom writes at most bytes.len() bytes into the buffer.
    unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    u32::from_ne_bytes(bytes)
}

mod protocol_name {
    use serde::{Deserialize, Deserializer, Serializer};

    use weir_policy::desired::Protocol;

    pub fn serialize<S: Serializer>(p: &Protocol, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(p.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Protocol, D::Error> {
        let name = String::deserialize(d)?;
        crate::objects::parse_protocol(&name).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_runs_use_disjoint_source_ports() {
        let a = source_ports(7, 48, 48);
        let b = source_ports(8, 48, 48);
        assert_eq!(a.len(), 48);
        assert!(a.iter().all(|p| !b.contains(p)));
        assert!(a.iter().chain(&b).all(|p| (32768..60768).contains(p)));
        let mut distinct = a.clone();
        distinct.dedup();
        assert_eq!(distinct, a);
    }
}
