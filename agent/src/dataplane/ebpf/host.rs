//! The node's own addresses. Traffic between a pod and the node it runs on is always
//! allowed (Kubernetes NetworkPolicy semantics: kubelet probes, node-local DNS caches),
//! as with an iptables dataplane that filters forwarded traffic only. They go into the
//! IDENTITY trie as /32 or /128 entries with the reserved host identity.

use std::net::IpAddr;

use serde::Deserialize;

use super::identities::Prefix;
use crate::dataplane::DataplaneError;

/// kube-proxy's ipvs mode puts every Service address on this dummy device. They are
/// Service frontends, judged after IPVS picks a backend, not the node's: were they host
/// addresses, egress to a Service weir does not know yet would pass as traffic to the node.
pub const IPVS_DEVICE: &str = "kube-ipvs0";

#[derive(Deserialize)]
struct Link {
    #[serde(default)]
    ifname: String,
    #[serde(default)]
    addr_info: Vec<AddrInfo>,
}

#[derive(Deserialize)]
struct AddrInfo {
    local: Option<IpAddr>,
}

/// Addresses of this network namespace (`ip -j addr show`), as host prefixes.
pub fn node_prefixes() -> Result<Vec<Prefix>, DataplaneError> {
    let out = crate::exec::run_ok("ip", &["-j", "addr", "show"], None)
        .map_err(|e| DataplaneError::tool("list the node's addresses", e))?;
    Ok(node_addresses(&out)
        .map_err(|source| DataplaneError::ToolOutput {
            tool: "ip -j addr show",
            source,
        })?
        .into_iter()
        .map(|a| Prefix::from_net(&a.into()))
        .collect())
}

/// The node's addresses in `ip -j addr show` output: every interface's but
/// [`IPVS_DEVICE`]'s.
fn node_addresses(json: &str) -> Result<Vec<IpAddr>, serde_json::Error> {
    let links: Vec<Link> = serde_json::from_str(json)?;
    Ok(links
        .iter()
        .filter(|l| l.ifname != IPVS_DEVICE)
        .flat_map(|l| l.addr_info.iter().filter_map(|a| a.local))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipvs_service_addresses_are_not_the_nodes() {
        let json = r#"[
            {"ifindex":1,"ifname":"lo","addr_info":[{"family":"inet","local":"127.0.0.1","prefixlen":8}]},
            {"ifindex":2,"ifname":"eth0","addr_info":[{"family":"inet6","local":"fd00::1","prefixlen":64}]},
            {"ifindex":3,"ifname":"kube-ipvs0","addr_info":[{"family":"inet","local":"10.96.0.10","prefixlen":32}]},
            {"ifindex":4,"ifname":"veth0"}
        ]"#;
        let addrs: Vec<String> = node_addresses(json)
            .unwrap()
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(addrs, ["127.0.0.1", "fd00::1"]);
        assert!(node_addresses("not json").is_err());
    }
}
