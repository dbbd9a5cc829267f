//! The node's own addresses, one list for both dataplanes. NetworkPolicies never stop a
//! pod's traffic to its node (kubelet probes, node-local DNS caches); ClusterNetworkPolicy
//! tiers judge it. eBPF puts them in its IDENTITY trie as host entries; iptables in an
//! ipset that `WEIR-TO-NODE` matches, so a packet to any other local address (a Service's,
//! under kube-proxy's ipvs mode) is not judged as the node's.

use std::net::IpAddr;

use serde::Deserialize;

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

/// The node's addresses in this network namespace (`ip -j addr show`).
pub fn read() -> Result<Vec<IpAddr>, DataplaneError> {
    let out = crate::exec::run_ok("ip", &["-j", "addr", "show"], None)
        .map_err(|e| DataplaneError::tool("list the node's addresses", e))?;
    node_addresses(&out).map_err(|source| DataplaneError::ToolOutput {
        tool: "ip -j addr show",
        source,
    })
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
