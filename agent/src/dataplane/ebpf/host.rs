//! The node's own addresses. Traffic between a pod and the node it runs on is always
//! allowed (Kubernetes NetworkPolicy semantics: kubelet probes, node-local DNS caches),
//! as with an iptables dataplane that filters forwarded traffic only. They go into the
//! IDENTITY trie as /32 or /128 entries with the reserved host identity.

use std::net::IpAddr;

use serde::Deserialize;

use super::identities::Prefix;

#[derive(Deserialize)]
struct Link {
    #[serde(default)]
    addr_info: Vec<AddrInfo>,
}

#[derive(Deserialize)]
struct AddrInfo {
    local: Option<IpAddr>,
}

/// Addresses of this network namespace (`ip -j addr show`), as host prefixes.
pub fn node_prefixes() -> Result<Vec<Prefix>, String> {
    let out = crate::reset::exec::run_ok("ip", &["-j", "addr", "show"], None)
        .map_err(|e| e.to_string())?;
    let links: Vec<Link> =
        serde_json::from_str(&out).map_err(|e| format!("parse `ip -j addr show`: {e}"))?;
    Ok(links
        .iter()
        .flat_map(|l| l.addr_info.iter().filter_map(|a| a.local))
        .map(|a| Prefix::from_net(&a.into()))
        .collect())
}
