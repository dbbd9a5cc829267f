//! Raw NETLINK_ROUTE sockets and the two message kinds the agent reads from them by hand:
//! link events (the new-pod link watch, subscribed to RTMGRP_LINK) and the namespace id
//! a namespace gives another (RTM_GETNSID, the bridge-port lookup). Netfilter netlink
//! (NFLOG) goes through the netlink-sys and netlink-packet crates instead.

use std::io;
use std::mem::{offset_of, size_of};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// The multicast group of link events.
pub const RTMGRP_LINK: u32 = 1;
pub const RTM_NEWLINK: u16 = 16;
pub const RTM_DELLINK: u16 = 17;
const IFLA_IFNAME: u16 = 3;
const RTM_NEWNSID: u16 = 88;
const RTM_GETNSID: u16 = 90;
const NETNSA_NSID: u16 = 1;
const NETNSA_FD: u16 = 3;

// The kernel's struct sockaddr_nl, as libc declares it and bind(2) reads it.
const _: () = {
    assert!(size_of::<libc::sockaddr_nl>() == 12);
    assert!(offset_of!(libc::sockaddr_nl, nl_family) == 0);
    assert!(offset_of!(libc::sockaddr_nl, nl_pid) == 4);
    assert!(offset_of!(libc::sockaddr_nl, nl_groups) == 8);
};

/// A NETLINK_ROUTE socket bound to the multicast `groups` (0: none), whose receives time
/// out after `timeout`, with a receive buffer of `rcvbuf` bytes when given.
pub fn route_socket(groups: u32, timeout: Duration, rcvbuf: Option<i32>) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned from here on.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_nl is plain data; zero is a valid starting value.
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as u16;
    addr.nl_groups = groups;
    // SAFETY: addr is a valid sockaddr_nl of the given size.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
            size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let timeout = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    // A receive without its timeout could block the caller forever: a refusal is an error.
    set_option(&fd, libc::SO_RCVTIMEO, &timeout)?;
    if let Some(bytes) = rcvbuf {
        set_option(&fd, libc::SO_RCVBUF, &bytes)?;
    }
    Ok(fd)
}

/// Sets a SOL_SOCKET option to `value`.
fn set_option<T>(fd: &OwnedFd, option: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: value is valid for reads of its size, which is the size given.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            value as *const T as *const libc::c_void,
            size_of::<T>() as u32,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sends one datagram.
pub fn send(socket: impl AsFd, msg: &[u8]) -> io::Result<()> {
    // SAFETY: msg is valid for reads of its length.
    let sent = unsafe {
        libc::send(
            socket.as_fd().as_raw_fd(),
            msg.as_ptr() as *const libc::c_void,
            msg.len(),
            0,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives one datagram into `buf`: how many bytes it filled.
pub fn recv(socket: impl AsFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: buf is valid for writes of its length.
    let n = unsafe {
        libc::recv(
            socket.as_fd().as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            0,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// The id the calling thread's namespace gives the namespace `netns` is open on
/// (RTM_GETNSID), if it gave it one.
pub fn nsid_of(netns: impl AsFd) -> io::Result<Option<i32>> {
    let socket = route_socket(0, Duration::from_secs(1), None)?;
    send(&socket, &nsid_request(netns.as_fd().as_raw_fd()))?;
    let mut buf = [0u8; 1024];
    let n = recv(&socket, &mut buf)?;
    parse_nsid(&buf[..n])
}

/// An RTM_GETNSID request for the namespace open on `fd`: nlmsghdr (16) + rtgenmsg (1,
/// aligned to 4) + NETNSA_FD (4 + 4).
fn nsid_request(fd: i32) -> Vec<u8> {
    let mut req = Vec::with_capacity(28);
    req.extend_from_slice(&28u32.to_ne_bytes());
    req.extend_from_slice(&RTM_GETNSID.to_ne_bytes());
    req.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    req.extend_from_slice(&0u32.to_ne_bytes()); // port: the kernel
    req.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    req.extend_from_slice(&8u16.to_ne_bytes());
    req.extend_from_slice(&NETNSA_FD.to_ne_bytes());
    req.extend_from_slice(&(fd as u32).to_ne_bytes());
    req
}

/// The NETNSA_NSID of an RTM_NEWNSID answer (`None`: not assigned), or the error (the
/// kernel's errno, or `InvalidData` for an answer that is not one).
pub fn parse_nsid(msg: &[u8]) -> io::Result<Option<i32>> {
    use std::io::{Error, ErrorKind};
    let field = |at: usize| -> Option<[u8; 4]> { msg.get(at..at + 4)?.try_into().ok() };
    let kind = msg
        .get(4..6)
        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
        .ok_or_else(|| Error::new(ErrorKind::InvalidData, "short netlink answer"))?;
    if kind == libc::NLMSG_ERROR as u16 {
        let errno = field(16).map(i32::from_ne_bytes).unwrap_or(0);
        return Err(Error::from_raw_os_error(-errno));
    }
    if kind != RTM_NEWNSID {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("RTM_GETNSID answered with netlink message type {kind}"),
        ));
    }
    let len = field(0).map(u32::from_ne_bytes).unwrap_or(0) as usize;
    let mut at = 20; // header + rtgenmsg
    while at + 4 <= len.min(msg.len()) {
        let alen = u16::from_ne_bytes([msg[at], msg[at + 1]]) as usize;
        let atype = u16::from_ne_bytes([msg[at + 2], msg[at + 3]]);
        if alen < 4 {
            break;
        }
        if atype == NETNSA_NSID {
            let id = field(at + 4)
                .map(i32::from_ne_bytes)
                .ok_or_else(|| Error::new(ErrorKind::InvalidData, "short NETNSA_NSID"))?;
            return Ok((id >= 0).then_some(id));
        }
        at += alen.div_ceil(4) * 4;
    }
    Ok(None)
}

/// (message type, ifindex, name) of each RTM_NEWLINK and RTM_DELLINK message in a
/// netlink datagram.
pub fn link_messages(buf: &[u8]) -> Vec<(u16, u32, Option<String>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 16 <= buf.len() {
        let len = u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().expect("2 bytes"));
        if len < 16 || at + len > buf.len() {
            break;
        }
        let msg = &buf[at + 16..at + len];
        if (kind == RTM_NEWLINK || kind == RTM_DELLINK) && msg.len() >= 16 {
            let ifindex = i32::from_ne_bytes(msg[4..8].try_into().expect("4 bytes")) as u32;
            let mut name = None;
            let mut a = 16;
            while a + 4 <= msg.len() {
                let alen = u16::from_ne_bytes(msg[a..a + 2].try_into().expect("2")) as usize;
                let atype = u16::from_ne_bytes(msg[a + 2..a + 4].try_into().expect("2"));
                if alen < 4 || a + alen > msg.len() {
                    break;
                }
                if atype == IFLA_IFNAME {
                    let raw = &msg[a + 4..a + alen];
                    let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
                    name = Some(String::from_utf8_lossy(&raw[..end]).into_owned());
                }
                a += alen.div_ceil(4) * 4;
            }
            out.push((kind, ifindex, name));
        }
        at += len.div_ceil(4) * 4;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_link_messages() {
        // nlmsghdr(16) + ifinfomsg(16) + IFLA_IFNAME "lxc1\0" (4 + 5, padded to 12).
        let mut m = Vec::new();
        m.extend_from_slice(&44u32.to_ne_bytes());
        m.extend_from_slice(&RTM_NEWLINK.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(&[0, 0, 0, 0]);
        m.extend_from_slice(&7i32.to_ne_bytes());
        m.extend_from_slice(&[0; 8]);
        m.extend_from_slice(&9u16.to_ne_bytes());
        m.extend_from_slice(&IFLA_IFNAME.to_ne_bytes());
        m.extend_from_slice(b"lxc1\0\0\0\0");
        assert_eq!(m.len(), 44);
        assert_eq!(
            link_messages(&m),
            vec![(RTM_NEWLINK, 7, Some("lxc1".to_string()))]
        );
    }

    /// An RTM_NEWNSID answer: nlmsghdr(16) + rtgenmsg(4) + the given attributes.
    fn nsid_answer(attrs: &[(u16, i32)]) -> Vec<u8> {
        let len = 20 + 8 * attrs.len();
        let mut m = Vec::new();
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&RTM_NEWNSID.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(&[0; 4]);
        for (kind, value) in attrs {
            m.extend_from_slice(&8u16.to_ne_bytes());
            m.extend_from_slice(&kind.to_ne_bytes());
            m.extend_from_slice(&value.to_ne_bytes());
        }
        m
    }

    #[test]
    fn parses_nsid_answers_and_errors() {
        assert_eq!(
            parse_nsid(&nsid_answer(&[(NETNSA_NSID, 3)])).unwrap(),
            Some(3)
        );
        // Another attribute first, then the id.
        assert_eq!(
            parse_nsid(&nsid_answer(&[(2, 9), (NETNSA_NSID, 0)])).unwrap(),
            Some(0)
        );
        // -1: the namespace has no id here.
        assert_eq!(
            parse_nsid(&nsid_answer(&[(NETNSA_NSID, -1)])).unwrap(),
            None
        );
        assert_eq!(parse_nsid(&nsid_answer(&[])).unwrap(), None);
        // NLMSG_ERROR carries the negated errno after the header.
        let mut error = vec![0u8; 20];
        error[0..4].copy_from_slice(&20u32.to_ne_bytes());
        error[4..6].copy_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
        error[16..20].copy_from_slice(&(-libc::EINVAL).to_ne_bytes());
        assert_eq!(
            parse_nsid(&error).unwrap_err().raw_os_error(),
            Some(libc::EINVAL)
        );
        assert_eq!(
            parse_nsid(&[1, 2]).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }

    #[test]
    fn nsid_requests_are_one_netlink_message() {
        let req = nsid_request(42);
        assert_eq!(req.len(), 28);
        assert_eq!(u32::from_ne_bytes(req[0..4].try_into().unwrap()), 28);
        assert_eq!(
            u16::from_ne_bytes(req[4..6].try_into().unwrap()),
            RTM_GETNSID
        );
        assert_eq!(
            u16::from_ne_bytes(req[22..24].try_into().unwrap()),
            NETNSA_FD
        );
        assert_eq!(u32::from_ne_bytes(req[24..28].try_into().unwrap()), 42);
    }
}
