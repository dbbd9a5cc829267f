//! Verdict events as `weir monitor` shows them: decoded from the kernel's
//! [`VerdictEvent`], named with the records (pod, rule), printed as text or JSON lines.

use std::net::{IpAddr, Ipv6Addr};

use serde::Serialize;
use weir_common::{
    VerdictEvent, DIR_INGRESS, REASON_HOST, REASON_ICMP_ERROR, REASON_NOT_ISOLATED,
    REASON_POLICY_ALLOW, REASON_POLICY_DENY, REASON_REPLY, VERDICT_DROP,
};

use super::records::Records;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MonitorEvent {
    /// Kernel monotonic clock (ns) at the verdict.
    pub timestamp_ns: u64,
    pub verdict: &'static str,
    pub reason: &'static str,
    /// `ingress` (to the pod) or `egress` (from the pod).
    pub direction: &'static str,
    pub protocol: u8,
    pub src: IpAddr,
    pub sport: u16,
    pub dst: IpAddr,
    pub dport: u16,
    pub pod: Option<String>,
    pub endpoint_id: u32,
    pub ifindex: u32,
    pub rule_id: u32,
    /// `ns/policy direction rule N` for allows by a rule; `default deny` for drops.
    pub rule: Option<String>,
    pub packet_len: u32,
}

fn addr(bytes: [u8; 16], family: u8) -> IpAddr {
    let v6 = Ipv6Addr::from(bytes);
    match (family, v6.to_ipv4_mapped()) {
        (4, Some(v4)) => IpAddr::V4(v4),
        _ => IpAddr::V6(v6),
    }
}

fn reason(code: u8) -> &'static str {
    match code {
        REASON_POLICY_DENY => "policy-deny",
        REASON_POLICY_ALLOW => "policy-allow",
        REASON_REPLY => "reply",
        REASON_NOT_ISOLATED => "not-isolated",
        REASON_ICMP_ERROR => "icmp-error-of-tracked-flow",
        REASON_HOST => "node-address",
        _ => "unknown",
    }
}

fn protocol_name(p: u8) -> String {
    match p {
        1 => "ICMP".into(),
        6 => "TCP".into(),
        17 => "UDP".into(),
        58 => "ICMPv6".into(),
        132 => "SCTP".into(),
        n => format!("proto-{n}"),
    }
}

impl MonitorEvent {
    pub fn decode(ev: &VerdictEvent, records: Option<&Records>) -> MonitorEvent {
        let drop = ev.verdict == VERDICT_DROP;
        let rule = if drop {
            Some("default deny".to_string())
        } else {
            records
                .and_then(|r| r.rules.by_id.get(&ev.rule_id))
                .map(ToString::to_string)
        };
        MonitorEvent {
            timestamp_ns: ev.timestamp_ns,
            verdict: if drop { "drop" } else { "allow" },
            reason: reason(ev.reason),
            direction: if ev.direction == DIR_INGRESS {
                "ingress"
            } else {
                "egress"
            },
            protocol: ev.protocol,
            src: addr(ev.saddr, ev.family),
            sport: ev.sport,
            dst: addr(ev.daddr, ev.family),
            dport: ev.dport,
            pod: records
                .and_then(|r| r.endpoint_name(ev.endpoint_id))
                .map(str::to_string),
            endpoint_id: ev.endpoint_id,
            ifindex: ev.ifindex,
            rule_id: ev.rule_id,
            rule,
            packet_len: ev.packet_len,
        }
    }

    pub fn render(&self, format: OutputFormat) -> String {
        match format {
            OutputFormat::Json => serde_json::to_string(self).expect("event serializes"),
            OutputFormat::Text => format!(
                "{} {} {} {} {}:{} -> {}:{} pod={} rule={} ({})",
                self.verdict.to_uppercase(),
                self.direction,
                protocol_name(self.protocol),
                self.reason,
                self.src,
                self.sport,
                self.dst,
                self.dport,
                self.pod.as_deref().unwrap_or("?"),
                self.rule.as_deref().unwrap_or("?"),
                self.rule_id,
            ),
        }
    }
}
