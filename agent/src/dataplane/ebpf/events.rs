//! Verdict events as `weir monitor` shows them: decoded from the kernel's
//! [`VerdictEvent`], named with the records (pod, rule), printed as text or JSON lines.

use std::net::{IpAddr, Ipv6Addr};

use serde::Serialize;
use weir_common::{rule_id, Direction, Reason, Verdict, VerdictEvent};

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
    /// `drop`, `allow`, or `audit` (allowed, but an audit-mode policy would drop it).
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
    /// `ns/policy direction rule N` for allows by a rule; `ns/policy,... direction audit:
    /// would be dropped` for audit verdicts; `default deny` for policy drops,
    /// `anti-spoofing`, `no tagged frames from pods` or `unreadable IP header` for the
    /// drops made before policy.
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
    let Ok(reason) = Reason::try_from(code) else {
        return "unknown";
    };
    match reason {
        Reason::PolicyDeny => "policy-deny",
        Reason::PolicyAllow => "policy-allow",
        Reason::Reply => "reply",
        Reason::NotIsolated => "not-isolated",
        Reason::IcmpError => "icmp-error-of-tracked-flow",
        Reason::Host => "node-address",
        Reason::Spoofed => "spoofed-source",
        Reason::Tagged => "tagged-frame",
        Reason::Established => "established",
        Reason::Malformed => "malformed",
        Reason::ServiceDeferred => "service-deferred",
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
        let verdict = Verdict::try_from(ev.verdict);
        let drop = verdict == Ok(Verdict::Drop);
        let rule = if drop {
            Some(
                match Reason::try_from(ev.reason) {
                    Ok(Reason::Spoofed) => "anti-spoofing",
                    Ok(Reason::Tagged) => "no tagged frames from pods",
                    Ok(Reason::Malformed) => "unreadable IP header",
                    _ => "default deny",
                }
                .to_string(),
            )
        } else {
            records
                .and_then(|r| r.rules.by_id.get(&rule_id(ev.rule_id)))
                .map(ToString::to_string)
        };
        MonitorEvent {
            timestamp_ns: ev.timestamp_ns,
            verdict: match verdict {
                Ok(Verdict::Drop) => "drop",
                Ok(Verdict::Allow) => "allow",
                Ok(Verdict::Audit) => "audit",
                Err(_) => "unknown",
            },
            reason: reason(ev.reason),
            direction: match Direction::try_from(ev.direction) {
                Ok(Direction::Ingress) => "ingress",
                Ok(Direction::Egress) => "egress",
                Err(_) => "unknown",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_before_policy_are_named() {
        let ev = VerdictEvent {
            saddr: std::net::Ipv4Addr::new(10, 0, 0, 9)
                .to_ipv6_mapped()
                .octets(),
            family: 4,
            direction: Direction::Egress as u8,
            verdict: Verdict::Drop as u8,
            reason: Reason::Spoofed as u8,
            ..Default::default()
        };
        let e = MonitorEvent::decode(&ev, None);
        assert_eq!(
            (e.verdict, e.reason, e.direction),
            ("drop", "spoofed-source", "egress")
        );
        assert_eq!(e.rule.as_deref(), Some("anti-spoofing"));
        assert_eq!(e.src, std::net::IpAddr::from([10, 0, 0, 9]));
        let tagged = MonitorEvent::decode(
            &VerdictEvent {
                reason: Reason::Tagged as u8,
                ..ev
            },
            None,
        );
        assert_eq!(tagged.reason, "tagged-frame");
        let established = MonitorEvent::decode(
            &VerdictEvent {
                verdict: Verdict::Allow as u8,
                reason: Reason::Established as u8,
                ..ev
            },
            None,
        );
        assert_eq!(
            (established.verdict, established.reason),
            ("allow", "established")
        );
    }
}
