//! One verdict as the stream carries it (a JSON line) and `weir monitor` prints it.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// A verdict of either dataplane. The fields up to `packet_len` are what `weir monitor
/// --output json` printed before the stream existed, with the same meaning; eBPF-only
/// fields are 0 on iptables.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerdictRecord {
    /// Kernel monotonic clock (ns) at the verdict (eBPF), or when the agent read it.
    pub timestamp_ns: u64,
    /// `drop`, `allow`, `audit` (allowed, but an audit-mode policy would drop it), or
    /// `suppressed` (a summary of what the rate limit held back for `pod`).
    pub verdict: String,
    pub reason: String,
    /// `ingress` (to the pod) or `egress` (from the pod).
    pub direction: String,
    pub protocol: u8,
    pub src: IpAddr,
    pub sport: u16,
    pub dst: IpAddr,
    pub dport: u16,
    /// The pod whose policy decided (`namespace/name`).
    pub pod: Option<String>,
    pub endpoint_id: u32,
    pub ifindex: u32,
    pub rule_id: u32,
    /// `ns/policy direction rule N` for allows by a rule; `ns/policy,... direction audit:
    /// would be dropped` for audit verdicts; `default deny by ns/policy,... (direction)`
    /// for policy drops, or `<Tier> tier clusternetworkpolicy <name> <direction> rule <i>
    /// (Deny)` for a ClusterNetworkPolicy's; `anti-spoofing`, `no tagged frames from pods` or `unreadable IP
    /// header` for the drops made before policy.
    pub rule: Option<String>,
    pub packet_len: u32,
    /// Wall clock when the agent read it (RFC 3339).
    #[serde(default)]
    pub time: String,
    /// `ebpf` or `iptables`.
    #[serde(default)]
    pub dataplane: String,
    /// The pods at either end, when the agent knows their addresses.
    #[serde(default)]
    pub src_pod: Option<String>,
    #[serde(default)]
    pub dst_pod: Option<String>,
    /// Records of this pod the rate limit held back since its previous record.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub suppressed: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
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

impl VerdictRecord {
    /// A record with the packet's fields; the rest default.
    pub fn packet(
        verdict: &str,
        reason: &str,
        direction: &str,
        protocol: u8,
        (src, sport): (IpAddr, u16),
        (dst, dport): (IpAddr, u16),
    ) -> VerdictRecord {
        VerdictRecord {
            timestamp_ns: crate::kernel::monotonic_ns(),
            verdict: verdict.into(),
            reason: reason.into(),
            direction: direction.into(),
            protocol,
            src,
            sport,
            dst,
            dport,
            pod: None,
            endpoint_id: 0,
            ifindex: 0,
            rule_id: 0,
            rule: None,
            packet_len: 0,
            time: String::new(),
            dataplane: String::new(),
            src_pod: None,
            dst_pod: None,
            suppressed: 0,
        }
    }

    pub fn render(&self, format: OutputFormat) -> String {
        match format {
            OutputFormat::Json => serde_json::to_string(self).expect("a record serializes"),
            OutputFormat::Text if self.verdict == "suppressed" => format!(
                "SUPPRESSED {} more verdicts of pod={} (rate limit)",
                self.suppressed,
                self.pod.as_deref().unwrap_or("?"),
            ),
            OutputFormat::Text => {
                let mut line = format!(
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
                );
                if self.suppressed > 0 {
                    line.push_str(&format!(" [+{} suppressed]", self.suppressed));
                }
                line
            }
        }
    }
}
