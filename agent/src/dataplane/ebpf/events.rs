//! The programs' verdict events, decoded from the kernel's [`VerdictEvent`] into the
//! stream's [`VerdictRecord`], named with the records (pod, rule).

use std::net::{IpAddr, Ipv6Addr};

use weir_common::{rule_id, Direction, Reason, Verdict, VerdictEvent};

use super::records::Records;
use crate::verdicts::VerdictRecord;

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
        Reason::UnlistedFrontend => "unlisted-frontend",
    }
}

/// The record of one kernel event, named with the records when they know its pod and rule.
pub fn decode(ev: &VerdictEvent, records: Option<&Records>) -> VerdictRecord {
    let verdict = Verdict::try_from(ev.verdict);
    let drop = verdict == Ok(Verdict::Drop);
    // A drop names its rule only when a ClusterNetworkPolicy Deny made it.
    let named = records
        .and_then(|r| r.rules.by_id.get(&rule_id(ev.rule_id)))
        .map(ToString::to_string);
    let rule = if drop {
        Some(match Reason::try_from(ev.reason) {
            Ok(Reason::Spoofed) => "anti-spoofing".to_string(),
            Ok(Reason::Tagged) => "no tagged frames from pods".to_string(),
            Ok(Reason::Malformed) => "unreadable IP header".to_string(),
            _ => named.unwrap_or_else(|| "default deny".to_string()),
        })
    } else {
        named
    };
    VerdictRecord {
        timestamp_ns: ev.timestamp_ns,
        verdict: match verdict {
            Ok(Verdict::Drop) => "drop",
            Ok(Verdict::Allow) => "allow",
            Ok(Verdict::Audit) => "audit",
            Err(_) => "unknown",
        }
        .into(),
        reason: reason(ev.reason).into(),
        direction: match Direction::try_from(ev.direction) {
            Ok(Direction::Ingress) => "ingress",
            Ok(Direction::Egress) => "egress",
            Err(_) => "unknown",
        }
        .into(),
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
        time: String::new(),
        dataplane: "ebpf".into(),
        src_pod: None,
        dst_pod: None,
        suppressed: 0,
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
        let e = decode(&ev, None);
        assert_eq!(
            (e.verdict.as_str(), e.reason.as_str(), e.direction.as_str()),
            ("drop", "spoofed-source", "egress")
        );
        assert_eq!(e.rule.as_deref(), Some("anti-spoofing"));
        assert_eq!(e.src, std::net::IpAddr::from([10, 0, 0, 9]));
        let tagged = decode(
            &VerdictEvent {
                reason: Reason::Tagged as u8,
                ..ev
            },
            None,
        );
        assert_eq!(tagged.reason, "tagged-frame");
        let established = decode(
            &VerdictEvent {
                verdict: Verdict::Allow as u8,
                reason: Reason::Established as u8,
                ..ev
            },
            None,
        );
        assert_eq!(
            (established.verdict.as_str(), established.reason.as_str()),
            ("allow", "established")
        );
    }
}
