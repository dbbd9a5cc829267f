//! The listener that runs inside each pod's namespace (`weir-lab listen`): it accepts TCP,
//! echoes UDP and answers SCTP INITs with INIT-ACKs on every port the pod declares, over
//! IPv4 and IPv6.

use std::io::Write;
use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};
use std::thread;

use socket2::{Domain, Protocol as SockProtocol, Socket, Type};

use super::sctp::{self, ChunkKind};
use super::state::ServedPort;
use super::LabError;
use weir_policy::desired::Protocol;

/// Binds every port, prints `ready` on stdout (the lab waits for it), then serves forever.
pub fn serve(ports: &[ServedPort]) -> Result<(), LabError> {
    let mut workers: Vec<Box<dyn FnOnce() + Send>> = Vec::new();
    for p in ports {
        match p.protocol {
            Protocol::Tcp => {
                let s = bind_dual_stack(Type::STREAM, p.port)?;
                s.listen(128)
                    .map_err(|e| LabError::io(format!("listening on TCP port {}", p.port), e))?;
                workers.push(Box::new(move || accept_forever(s)));
            }
            Protocol::Udp => {
                let s = bind_dual_stack(Type::DGRAM, p.port)?;
                workers.push(Box::new(move || echo_forever(s)));
            }
            Protocol::Sctp => {}
        }
    }
    let sctp_ports: Vec<u16> = ports
        .iter()
        .filter(|p| p.protocol == Protocol::Sctp)
        .map(|p| p.port)
        .collect();
    if !sctp_ports.is_empty() {
        for domain in [Domain::IPV4, Domain::IPV6] {
            let s = raw_sctp_socket(domain)?;
            let served = sctp_ports.clone();
            workers.push(Box::new(move || answer_inits_forever(s, domain, &served)));
        }
    }
    let mut stdout = std::io::stdout();
    writeln!(stdout, "ready")
        .and_then(|()| stdout.flush())
        .map_err(|e| LabError::io("signalling readiness", e))?;
    let handles: Vec<_> = workers.into_iter().map(thread::spawn).collect();
    for h in handles {
        // Workers only return on a socket error, which ends the listener.
        let _ = h.join();
    }
    Err(LabError::invalid(
        "listener",
        "a socket failed; see the log",
    ))
}

fn bind_dual_stack(ty: Type, port: u16) -> Result<Socket, LabError> {
    let what = if ty == Type::STREAM { "TCP" } else { "UDP" };
    let bind = || -> std::io::Result<Socket> {
        let s = Socket::new(Domain::IPV6, ty, None)?;
        s.set_only_v6(false)?;
        s.set_reuse_address(true)?;
        let addr = SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, port, 0, 0));
        s.bind(&addr.into())?;
        Ok(s)
    };
    bind().map_err(|e| LabError::io(format!("binding {what} port {port}"), e))
}

/// A raw socket receiving every SCTP packet of this namespace for one address family.
pub fn raw_sctp_socket(domain: Domain) -> Result<Socket, LabError> {
    Socket::new(
        domain,
        Type::RAW,
        Some(SockProtocol::from(sctp::IPPROTO_SCTP)),
    )
    .map_err(|e| LabError::io("opening a raw SCTP socket (needs CAP_NET_RAW)", e))
}

fn accept_forever(s: Socket) {
    // Accepting completes the handshake; closing at once is all a probe needs.
    while let Ok((conn, _)) = s.accept() {
        drop(conn);
    }
    eprintln!("TCP accept failed; listener stops");
}

fn echo_forever(s: Socket) {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 2048];
    loop {
        let Ok((n, from)) = s.recv_from(&mut buf) else {
            eprintln!("UDP receive failed; listener stops");
            return;
        };
        // SAFETY: recv_from initialised the first n bytes.
        let data: Vec<u8> = buf[..n]
            .iter()
            .map(|b| unsafe { b.assume_init() })
            .collect();
        if let Err(e) = s.send_to(&data, &from) {
            eprintln!("UDP reply to {:?} failed: {e}", from.as_socket());
        }
    }
}

/// Reads one packet from a raw protocol-132 socket and parses its SCTP chunk (`None`
/// when it is not one we understand). Raw IPv4 sockets deliver the IP header too.
pub(super) fn recv_sctp_chunk(
    s: &Socket,
    domain: Domain,
    flags: libc::c_int,
) -> std::io::Result<(Option<sctp::Chunk>, socket2::SockAddr)> {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 2048];
    let (n, from) = s.recv_from_with_flags(&mut buf, flags)?;
    // SAFETY: recv_from initialised the first n bytes.
    let packet: Vec<u8> = buf[..n]
        .iter()
        .map(|b| unsafe { b.assume_init() })
        .collect();
    let payload = if domain == Domain::IPV4 {
        sctp::strip_ipv4_header(&packet)
    } else {
        Some(packet.as_slice())
    };
    Ok((payload.and_then(sctp::parse), from))
}

fn answer_inits_forever(s: Socket, domain: Domain, served: &[u16]) {
    loop {
        let Ok((chunk, from)) = recv_sctp_chunk(&s, domain, 0) else {
            eprintln!("SCTP receive failed; listener stops");
            return;
        };
        let Some(init) = chunk else {
            continue;
        };
        if init.kind != ChunkKind::Init || !served.contains(&init.dst_port) {
            continue;
        }
        let ack = sctp::init_ack(&init, init.initiate_tag.rotate_left(16) | 1);
        if let Err(e) = s.send_to(&ack, &from) {
            eprintln!("SCTP INIT-ACK to {:?} failed: {e}", from.as_socket());
        }
    }
}
