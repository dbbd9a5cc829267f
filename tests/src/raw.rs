//! Hand-made frames for the hostile-pod tests: Ethernet (optionally VLAN/QinQ-tagged),
//! IPv4/IPv6, TCP/UDP/ICMP with correct checksums, sent from inside a pod's namespace
//! with an AF_PACKET socket; a sniffer that watches a pod's `eth0` for a marker; and a TCP
//! connect from a chosen source port.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::FromRawFd;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::pods::enter;

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_ICMPV6: u8 = 58;

pub const TCP_SYN: u8 = 0x02;
pub const TCP_ACK: u8 = 0x10;

/// The Internet checksum (RFC 1071) of `data`, starting from `initial` (a partial sum).
pub fn checksum(initial: u32, data: &[u8]) -> u16 {
    let mut sum = initial;
    for pair in data.chunks(2) {
        let word = u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]);
        sum += u32::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn pseudo_sum(src: IpAddr, dst: IpAddr, protocol: u8, len: usize) -> u32 {
    let mut bytes = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            bytes.extend_from_slice(&s.octets());
            bytes.extend_from_slice(&d.octets());
            bytes.extend_from_slice(&[0, protocol]);
            bytes.extend_from_slice(&(len as u16).to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            bytes.extend_from_slice(&s.octets());
            bytes.extend_from_slice(&d.octets());
            bytes.extend_from_slice(&(len as u32).to_be_bytes());
            bytes.extend_from_slice(&[0, 0, 0, protocol]);
        }
        _ => panic!("mixed families {src} {dst}"),
    }
    bytes
        .chunks(2)
        .map(|p| u32::from(u16::from_be_bytes([p[0], p[1]])))
        .sum()
}

/// A TCP segment (20-byte header, no options) with its checksum.
pub fn tcp(src: SocketAddr, dst: SocketAddr, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut s = Vec::with_capacity(20 + payload.len());
    s.extend_from_slice(&src.port().to_be_bytes());
    s.extend_from_slice(&dst.port().to_be_bytes());
    s.extend_from_slice(&0x1234_5678u32.to_be_bytes()); // seq
    let ack: u32 = if flags & TCP_ACK != 0 { 0x0abc_def0 } else { 0 };
    s.extend_from_slice(&ack.to_be_bytes());
    s.extend_from_slice(&[5 << 4, flags]);
    s.extend_from_slice(&64240u16.to_be_bytes()); // window
    s.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent
    s.extend_from_slice(payload);
    let c = checksum(pseudo_sum(src.ip(), dst.ip(), IPPROTO_TCP, s.len()), &s);
    s[16..18].copy_from_slice(&c.to_be_bytes());
    s
}

/// A UDP datagram with its checksum.
pub fn udp(src: SocketAddr, dst: SocketAddr, payload: &[u8]) -> Vec<u8> {
    let len = 8 + payload.len();
    let mut s = Vec::with_capacity(len);
    s.extend_from_slice(&src.port().to_be_bytes());
    s.extend_from_slice(&dst.port().to_be_bytes());
    s.extend_from_slice(&(len as u16).to_be_bytes());
    s.extend_from_slice(&[0, 0]);
    s.extend_from_slice(payload);
    let mut c = checksum(pseudo_sum(src.ip(), dst.ip(), IPPROTO_UDP, s.len()), &s);
    if c == 0 {
        c = 0xffff;
    }
    s[6..8].copy_from_slice(&c.to_be_bytes());
    s
}

/// An ICMP (v4) or ICMPv6 message: type, code, 4 unused bytes, body; with its checksum.
pub fn icmp(src: IpAddr, dst: IpAddr, ty: u8, code: u8, body: &[u8]) -> Vec<u8> {
    let mut s = vec![ty, code, 0, 0, 0, 0, 0, 0];
    s.extend_from_slice(body);
    let c = match (src, dst) {
        (IpAddr::V4(_), IpAddr::V4(_)) => checksum(0, &s),
        _ => checksum(pseudo_sum(src, dst, IPPROTO_ICMPV6, s.len()), &s),
    };
    s[2..4].copy_from_slice(&c.to_be_bytes());
    s
}

/// An IP packet (IPv4 with header checksum, or IPv6) around `l4`.
pub fn ip(src: IpAddr, dst: IpAddr, protocol: u8, l4: &[u8]) -> Vec<u8> {
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => ipv4(s, d, protocol, l4),
        (IpAddr::V6(s), IpAddr::V6(d)) => ipv6(s, d, protocol, 64, l4),
        _ => panic!("mixed families {src} {dst}"),
    }
}

pub fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, l4: &[u8]) -> Vec<u8> {
    let total = 20 + l4.len();
    let mut p = vec![0x45, 0];
    p.extend_from_slice(&(total as u16).to_be_bytes());
    p.extend_from_slice(&[0x4b, 0x1d, 0x40, 0]); // id, DF
    p.extend_from_slice(&[64, protocol, 0, 0]);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    let c = checksum(0, &p);
    p[10..12].copy_from_slice(&c.to_be_bytes());
    p.extend_from_slice(l4);
    p
}

pub fn ipv6(src: Ipv6Addr, dst: Ipv6Addr, next: u8, hop_limit: u8, l4: &[u8]) -> Vec<u8> {
    let mut p = vec![0x60, 0, 0, 0];
    p.extend_from_slice(&(l4.len() as u16).to_be_bytes());
    p.extend_from_slice(&[next, hop_limit]);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(l4);
    p
}

/// VLAN tags outermost first: (TPID, VLAN id), e.g. `[(0x88a8, 100), (0x8100, 10)]`.
pub type Tags<'a> = &'a [(u16, u16)];

/// An Ethernet frame carrying `packet` (IPv4 or IPv6, read from its version nibble).
pub fn ethernet(dst: [u8; 6], src: [u8; 6], tags: Tags, packet: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + 4 * tags.len() + packet.len());
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    for (tpid, vid) in tags {
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&(vid & 0x0fff).to_be_bytes());
    }
    let ethertype: u16 = if packet[0] >> 4 == 6 { 0x86dd } else { 0x0800 };
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(packet);
    f
}

/// An Ethernet frame carrying an ARP reply: `sender_mac` claims `sender_ip`, to
/// `target` (`target_mac`), followed by `trailer` (padding a sniffer can find).
pub fn arp_reply(
    sender_mac: [u8; 6],
    sender_ip: Ipv4Addr,
    target_mac: [u8; 6],
    target_ip: Ipv4Addr,
    trailer: &[u8],
) -> Vec<u8> {
    let mut f = Vec::with_capacity(42 + trailer.len());
    f.extend_from_slice(&target_mac);
    f.extend_from_slice(&sender_mac);
    f.extend_from_slice(&0x0806u16.to_be_bytes());
    // Ethernet, IPv4, their lengths, operation 2 (reply).
    f.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 2]);
    f.extend_from_slice(&sender_mac);
    f.extend_from_slice(&sender_ip.octets());
    f.extend_from_slice(&target_mac);
    f.extend_from_slice(&target_ip.octets());
    f.extend_from_slice(trailer);
    f
}

/// The MAC address of `dev` in namespace `ns` (`ip -j link show`).
pub fn mac(ns: &str, dev: &str) -> [u8; 6] {
    let out = std::process::Command::new("ip")
        .args(["-n", ns, "-j", "link", "show", dev])
        .output()
        .expect("run ip");
    assert!(out.status.success(), "ip -n {ns} link show {dev}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j output");
    let text = json[0]["address"].as_str().expect("address").to_string();
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).expect("hex"))
        .collect();
    bytes.try_into().expect("6 bytes")
}

fn ifindex(dev: &str) -> i32 {
    let c = std::ffi::CString::new(dev).unwrap();
    // SAFETY: a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    assert!(i != 0, "no interface {dev}");
    i as i32
}

fn packet_socket(dev: &str) -> (i32, libc::sockaddr_ll) {
    let proto = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain socket creation.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
    assert!(
        fd >= 0,
        "AF_PACKET socket: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: sockaddr_ll is plain data; zero is a valid value.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = proto;
    addr.sll_ifindex = ifindex(dev);
    (fd, addr)
}

/// Sends `frames` out of `dev` in namespace `ns`, as the pod itself would.
pub fn send_frames(ns: &str, dev: &str, frames: Vec<Vec<u8>>) {
    let (ns, dev) = (ns.to_string(), dev.to_string());
    std::thread::spawn(move || {
        enter(&ns);
        let (fd, addr) = packet_socket(&dev);
        for f in &frames {
            // SAFETY: f and addr are valid for the stated lengths.
            let n = unsafe {
                libc::sendto(
                    fd,
                    f.as_ptr().cast(),
                    f.len(),
                    0,
                    (&addr as *const libc::sockaddr_ll).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(
                n,
                f.len() as isize,
                "sendto on {dev} in {ns}: {}",
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: fd is ours.
        unsafe { libc::close(fd) };
    })
    .join()
    .expect("sender thread");
}

/// Sends `count` frames made by `frame(i)` as fast as one socket can, from `dev` in `ns`.
/// Returns how long it took.
pub fn flood(
    ns: &str,
    dev: &str,
    count: u32,
    frame: impl Fn(u32) -> Vec<u8> + Send + 'static,
) -> Duration {
    let (ns, dev) = (ns.to_string(), dev.to_string());
    std::thread::spawn(move || {
        enter(&ns);
        let (fd, addr) = packet_socket(&dev);
        let started = Instant::now();
        for i in 0..count {
            let f = frame(i);
            loop {
                // SAFETY: f and addr are valid for the stated lengths.
                let n = unsafe {
                    libc::sendto(
                        fd,
                        f.as_ptr().cast(),
                        f.len(),
                        0,
                        (&addr as *const libc::sockaddr_ll).cast(),
                        std::mem::size_of::<libc::sockaddr_ll>() as u32,
                    )
                };
                if n >= 0 {
                    break;
                }
                let e = std::io::Error::last_os_error();
                assert_eq!(e.raw_os_error(), Some(libc::ENOBUFS), "flood sendto: {e}");
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        // SAFETY: fd is ours.
        unsafe { libc::close(fd) };
        started.elapsed()
    })
    .join()
    .expect("flood thread")
}

/// Watches `dev` in namespace `ns` for frames containing `marker` until [`Sniffer::stop`].
pub struct Sniffer {
    thread: Option<JoinHandle<usize>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Sniffer {
    pub fn start(ns: &str, dev: &str, marker: &[u8]) -> Sniffer {
        let (ns, dev, marker) = (ns.to_string(), dev.to_string(), marker.to_vec());
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            enter(&ns);
            let (fd, addr) = packet_socket(&dev);
            // SAFETY: addr is a valid sockaddr_ll.
            let rc = unsafe {
                libc::bind(
                    fd,
                    (&addr as *const libc::sockaddr_ll).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(rc, 0, "bind sniffer: {}", std::io::Error::last_os_error());
            let tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 50_000,
            };
            // SAFETY: tv is a valid timeval.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&tv as *const libc::timeval).cast(),
                    std::mem::size_of::<libc::timeval>() as u32,
                )
            };
            tx.send(()).unwrap();
            let mut seen = 0;
            let mut buf = vec![0u8; 65536];
            while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
                // SAFETY: buf is writable for its length.
                let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n > 0 && buf[..n as usize].windows(marker.len()).any(|w| w == marker) {
                    seen += 1;
                }
            }
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            seen
        });
        rx.recv().expect("sniffer started");
        Sniffer {
            thread: Some(thread),
            stop,
        }
    }

    /// Waits `linger`, stops, and returns how many frames carried the marker.
    pub fn stop(mut self, linger: Duration) -> usize {
        std::thread::sleep(linger);
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.take().unwrap().join().expect("sniffer thread")
    }
}

impl Drop for Sniffer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A TCP connection from `src_port` to `dst`, made inside namespace `ns`; `None` when it
/// does not complete within `timeout`.
pub fn tcp_connect_from(
    ns: &str,
    src_port: u16,
    dst: SocketAddr,
    timeout: Duration,
) -> Option<std::net::TcpStream> {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        enter(&ns);
        let family = if dst.is_ipv4() {
            libc::AF_INET
        } else {
            libc::AF_INET6
        };
        // SAFETY: plain socket calls on a socket this function owns.
        unsafe {
            let fd = libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0);
            assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
            let one: i32 = 1;
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_REUSEADDR,
                (&one as *const i32).cast(),
                4,
            );
            let (local, local_len) = sockaddr(SocketAddr::new(
                if dst.is_ipv4() {
                    IpAddr::V4(Ipv4Addr::UNSPECIFIED)
                } else {
                    IpAddr::V6(Ipv6Addr::UNSPECIFIED)
                },
                src_port,
            ));
            let rc = libc::bind(
                fd,
                (&local as *const libc::sockaddr_storage).cast(),
                local_len,
            );
            assert_eq!(
                rc,
                0,
                "bind :{src_port}: {}",
                std::io::Error::last_os_error()
            );
            let (remote, remote_len) = sockaddr(dst);
            libc::connect(
                fd,
                (&remote as *const libc::sockaddr_storage).cast(),
                remote_len,
            );
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLOUT,
                revents: 0,
            };
            let ready = libc::poll(&mut pfd, 1, timeout.as_millis() as i32);
            let mut err: i32 = 0;
            let mut len = 4u32;
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&mut err as *mut i32).cast(),
                &mut len,
            );
            if ready == 1 && err == 0 {
                let s = std::net::TcpStream::from_raw_fd(fd);
                s.set_nonblocking(false).unwrap();
                Some(s)
            } else {
                libc::close(fd);
                None
            }
        }
    })
    .join()
    .expect("connect thread")
}

fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, u32) {
    // SAFETY: sockaddr_storage is plain data; zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            let sin = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>()
            };
            sin.sin_family = libc::AF_INET as u16;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            (ss, std::mem::size_of::<libc::sockaddr_in>() as u32)
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            let sin6 = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            sin6.sin6_family = libc::AF_INET6 as u16;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            (ss, std::mem::size_of::<libc::sockaddr_in6>() as u32)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_verify_to_zero() {
        // A header whose checksum field is filled sums (with it) to 0xffff, i.e. !0.
        let p = ipv4(
            Ipv4Addr::new(10, 244, 0, 2),
            Ipv4Addr::new(10, 244, 0, 3),
            IPPROTO_UDP,
            &[],
        );
        assert_eq!(checksum(0, &p[..20]), 0);
        let (s, d): (SocketAddr, SocketAddr) = (
            "10.0.0.1:5432".parse().unwrap(),
            "10.0.0.2:40000".parse().unwrap(),
        );
        let seg = tcp(s, d, TCP_SYN | TCP_ACK, b"x");
        assert_eq!(
            checksum(pseudo_sum(s.ip(), d.ip(), IPPROTO_TCP, seg.len()), &seg),
            0
        );
        let (s6, d6): (SocketAddr, SocketAddr) = (
            "[fd00::1]:1".parse().unwrap(),
            "[fd00::2]:2".parse().unwrap(),
        );
        let dg = udp(s6, d6, b"abc");
        assert_eq!(
            checksum(pseudo_sum(s6.ip(), d6.ip(), IPPROTO_UDP, dg.len()), &dg),
            0
        );
        // RFC 1071's example: 0001 f203 f4f5 f6f7 sums to 0xddf2, checksum 0x220d.
        assert_eq!(
            checksum(0, &[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            0x220d
        );
    }

    #[test]
    fn qinq_frame_layout() {
        let f = ethernet([1; 6], [2; 6], &[(0x88a8, 100), (0x8100, 10)], &[0x45, 0]);
        assert_eq!(&f[12..14], &[0x88, 0xa8]);
        assert_eq!(&f[14..16], &[0, 100]);
        assert_eq!(&f[16..18], &[0x81, 0x00]);
        assert_eq!(&f[18..20], &[0, 10]);
        assert_eq!(&f[20..22], &[0x08, 0x00]);
    }
}
