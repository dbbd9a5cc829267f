//! The iptables dataplane's verdict tap: reads what its log rules send to
//! [`NFLOG_GROUP`] (nfnetlink_log, in the agent's network namespace) and turns each packet
//! into a [`VerdictRecord`], naming the pod from the hash in the rule's prefix.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::nflog::{
    config_request, ConfigCmd, ConfigMode, PacketNla, ULogMessage,
};
use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};
use netlink_sys::{constants::NETLINK_NETFILTER, Socket};

use super::names::PodsByHash;
use super::rules::{LogKind, LogPrefix, NFLOG_GROUP};
use crate::dataplane::DataplaneError;
use crate::exec::modules::ModuleError;
use crate::verdicts::{VerdictRecord, VerdictTap, VerdictTx};

/// Bytes of each packet the kernel copies: IPv6's header and the ports are enough.
const COPY_RANGE: u32 = 128;

/// Whether the kernel has the NFLOG target and the limit match: registered (listed in
/// /proc/net/ip_tables_*, which exists once ip_tables is loaded: built-in kernels), loaded,
/// or loadable. `Err` says why not: the log rules are then left out, and enforcement goes
/// on without them.
pub fn available() -> Result<(), ModuleError> {
    let registered = |list: &str, name: &str| {
        std::fs::read_to_string(format!("/proc/net/{list}"))
            .is_ok_and(|text| text.lines().any(|l| l.trim() == name))
    };
    for (list, name, module) in [
        ("ip_tables_targets", "NFLOG", "xt_NFLOG"),
        ("ip_tables_matches", "limit", "xt_limit"),
    ] {
        if registered(list, name) || crate::kernel::module_present(module) {
            continue;
        }
        if let Err(why) = crate::exec::modules::load(module) {
            tracing::warn!(%why, "the iptables dataplane will not log its verdicts");
            return Err(why);
        }
    }
    Ok(())
}

fn io(context: &str, source: std::io::Error) -> DataplaneError {
    DataplaneError::Io {
        context: context.into(),
        source,
    }
}

/// Sends one config request and reads its acknowledgement.
fn configure(
    socket: &Socket,
    group: u16,
    nlas: Vec<netlink_packet_netfilter::nflog::ConfigNla>,
) -> Result<(), DataplaneError> {
    let mut request = config_request(NetfilterProtoFamily::Unspec, group, nlas);
    request.finalize();
    let mut buf = vec![0; request.header.length as usize];
    request.serialize(&mut buf);
    socket
        .send(&buf, 0)
        .map_err(|e| io("send an nfnetlink_log request", e))?;
    let mut reply = vec![0; 4096];
    let n = socket
        .recv(&mut &mut reply[..], 0)
        .map_err(|e| io("read nfnetlink_log's answer", e))?;
    let message = NetlinkMessage::<NetfilterMessage>::deserialize(&reply[..n]).map_err(|e| {
        DataplaneError::Unsupported(format!("nfnetlink_log answered unreadably: {e}"))
    })?;
    match message.payload {
        NetlinkPayload::Error(e) if e.code.is_some() => Err(DataplaneError::Unsupported(format!(
            "nfnetlink_log refused group {group}: {}",
            e.to_io()
        ))),
        _ => Ok(()),
    }
}

/// Binds [`NFLOG_GROUP`] and reads it on a thread into `tx`.
pub fn tap(pods: PodsByHash, tx: Arc<VerdictTx>) -> Result<VerdictTap, DataplaneError> {
    let mut socket =
        Socket::new(NETLINK_NETFILTER).map_err(|e| io("open a netfilter netlink socket", e))?;
    socket
        .bind_auto()
        .map_err(|e| io("bind a netfilter netlink socket", e))?;
    configure(
        &socket,
        NFLOG_GROUP,
        vec![
            ConfigCmd::Bind.into(),
            ConfigMode::new_packet(COPY_RANGE).into(),
        ],
    )?;
    VerdictTap::spawn("weir-nflog-tap", move |stop| {
        let mut buf = vec![0u8; 1 << 16];
        while !stop.load(Ordering::Relaxed) {
            if !matches!(
                crate::sys::poll::readable(&socket, Duration::from_millis(200)),
                Ok(true)
            ) {
                continue;
            }
            let n = match socket.recv(&mut &mut buf[..], libc::MSG_DONTWAIT) {
                Ok(n) => n,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    tracing::warn!("NFLOG messages lost: the socket's buffer overflowed");
                    continue;
                }
                Err(_) => continue,
            };
            let mut offset = 0;
            while offset < n {
                let Ok(message) = NetlinkMessage::<NetfilterMessage>::deserialize(&buf[offset..n])
                else {
                    break;
                };
                let len = message.header.length as usize;
                if let Some(record) = record(&message, &pods) {
                    tx.offer(record);
                }
                if len == 0 {
                    break;
                }
                offset += len.next_multiple_of(4);
            }
        }
        let _ = configure(&socket, NFLOG_GROUP, vec![ConfigCmd::Unbind.into()]);
    })
    .map_err(|e| io("start the NFLOG verdict reader", e))
}

/// The record of one logged packet; `None` for messages that are not weir's.
fn record(message: &NetlinkMessage<NetfilterMessage>, pods: &PodsByHash) -> Option<VerdictRecord> {
    let NetlinkPayload::InnerMessage(NetfilterMessage {
        inner: NetfilterMessageInner::ULog(ULogMessage::Packet(nlas)),
        ..
    }) = &message.payload
    else {
        return None;
    };
    let mut prefix = None;
    let mut payload = None;
    for nla in nlas {
        match nla {
            PacketNla::Prefix(p) => {
                prefix = p.to_str().ok().and_then(|p| p.parse::<LogPrefix>().ok())
            }
            PacketNla::Payload(p) => payload = Some(p.as_slice()),
            _ => {}
        }
    }
    let prefix = prefix?;
    let packet = Packet::parse(payload?)?;
    let (verdict, reason, rule) = match prefix.kind {
        LogKind::Deny => ("drop", "policy-deny", None),
        LogKind::Audit => ("audit", "policy-allow", None),
        LogKind::Spoof => ("drop", "spoofed-source", Some("anti-spoofing")),
    };
    let mut r = VerdictRecord::packet(
        verdict,
        reason,
        prefix.direction.name(),
        packet.protocol,
        (packet.src, packet.sport),
        (packet.dst, packet.dport),
    );
    r.rule = rule.map(str::to_string);
    r.packet_len = packet.len;
    r.dataplane = "iptables".into();
    r.pod = pods.read().ok().and_then(|p| p.get(&prefix.hash).cloned());
    Some(r)
}

/// The addresses and ports of an IP packet (ports 0 for other protocols and fragments).
#[derive(Debug, PartialEq, Eq)]
struct Packet {
    protocol: u8,
    src: std::net::IpAddr,
    sport: u16,
    dst: std::net::IpAddr,
    dport: u16,
    len: u32,
}

impl Packet {
    fn parse(p: &[u8]) -> Option<Packet> {
        let ports = |l4: &[u8], protocol: u8| match (protocol, l4) {
            (6 | 17 | 132, [a, b, c, d, ..]) => {
                (u16::from_be_bytes([*a, *b]), u16::from_be_bytes([*c, *d]))
            }
            _ => (0, 0),
        };
        match p.first()? >> 4 {
            4 if p.len() >= 20 => {
                let ihl = usize::from(p[0] & 0x0f) * 4;
                let fragment = u16::from_be_bytes([p[6], p[7]]) & 0x1fff != 0;
                let protocol = p[9];
                let (sport, dport) = if fragment {
                    (0, 0)
                } else {
                    ports(p.get(ihl..).unwrap_or_default(), protocol)
                };
                Some(Packet {
                    protocol,
                    src: std::net::Ipv4Addr::from(<[u8; 4]>::try_from(&p[12..16]).ok()?).into(),
                    dst: std::net::Ipv4Addr::from(<[u8; 4]>::try_from(&p[16..20]).ok()?).into(),
                    sport,
                    dport,
                    len: u32::from(u16::from_be_bytes([p[2], p[3]])),
                })
            }
            6 if p.len() >= 40 => {
                let protocol = p[6];
                let (sport, dport) = ports(&p[40..], protocol);
                Some(Packet {
                    protocol,
                    src: std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&p[8..24]).ok()?).into(),
                    dst: std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&p[24..40]).ok()?).into(),
                    sport,
                    dport,
                    len: u32::from(u16::from_be_bytes([p[4], p[5]])) + 40,
                })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_of_both_families_are_read_and_fragments_have_no_ports() {
        let mut v4 = vec![
            0x45, 0, 0, 60, 0, 0, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ];
        v4.extend([0x1f, 0x90, 0, 80]);
        assert_eq!(
            Packet::parse(&v4),
            Some(Packet {
                protocol: 6,
                src: "10.0.0.1".parse().unwrap(),
                sport: 8080,
                dst: "10.0.0.2".parse().unwrap(),
                dport: 80,
                len: 60,
            })
        );
        // A later fragment: its first bytes are data, not ports.
        v4[6] = 0x00;
        v4[7] = 0x10;
        assert_eq!(Packet::parse(&v4).map(|p| (p.sport, p.dport)), Some((0, 0)));
        let mut v6 = vec![0x60, 0, 0, 0, 0, 8, 17, 64];
        v6.extend("fd00::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
        v6.extend("fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets());
        v6.extend([0, 53, 0, 53]);
        let p = Packet::parse(&v6).unwrap();
        assert_eq!((p.protocol, p.sport, p.dport, p.len), (17, 53, 53, 48));
        assert_eq!(Packet::parse(&[0x45, 0]), None, "truncated");
        assert_eq!(Packet::parse(&[]), None);
    }
}
