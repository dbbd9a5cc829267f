//! Anti-spoofing on the iptables dataplane: a packet forwarded from a pod's interface
//! whose source is not one of that pod's addresses is dropped, in `WEIR-SPOOF`, which
//! `WEIR-FILTER` enters before anything else (before the conntrack rule: a packet dropped
//! in FORWARD never confirms a conntrack entry, so it leaves no state either).
//!
//! A pod's interface is the device of its host route (`/32`, `/128`), as CNIs with one
//! veth per pod install. A device that carries the host routes of more than one endpoint
//! gets no `-i` rule: it is not one pod's. On a bridge (no host routes; br_netfilter
//! passes bridged packets to FORWARD) a pod's interface is its bridge port, found through
//! its namespace ([`crate::dataplane::pod_ports`]) and matched with `-m physdev
//! --physdev-in`, which also matches what the bridge passes up to be routed. Routed IPv6
//! link-local sources are never forwarded, so neighbour discovery (INPUT) is untouched;
//! bridged neighbour discovery is, and passes as on the eBPF dataplane: a link-local or
//! unspecified source only towards link scope.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde::Deserialize;

use crate::dataplane::new_pods::NewPodIsolation;
use crate::dataplane::DataplaneError;
use crate::exec;
use weir_policy::desired::{Desired, Direction};

use super::names::{set_name, ChainNames, KNOWN_ENDPOINTS_SET};
use super::rules::{log_rule, LogKind, LogPrefix};

use crate::netfilter::backend::Family;

#[derive(Deserialize)]
struct Route {
    dst: Option<String>,
    dev: Option<String>,
}

/// Host routes (a `dst` without a prefix length, or with /32, /128) → device, from
/// `ip -j route show` output.
pub fn parse_host_routes(json: &str) -> Result<BTreeMap<IpAddr, String>, DataplaneError> {
    let routes: Vec<Route> =
        serde_json::from_str(json).map_err(|source| DataplaneError::ToolOutput {
            tool: "ip -j route show",
            source,
        })?;
    let mut out = BTreeMap::new();
    for r in routes {
        let (Some(dst), Some(dev)) = (r.dst, r.dev) else {
            continue;
        };
        let addr = match dst.split_once('/') {
            None => dst.parse().ok(),
            Some((a, "32" | "128")) => a.parse().ok(),
            Some(_) => None,
        };
        if let Some(addr) = addr {
            out.insert(addr, dev);
        }
    }
    Ok(out)
}

/// The node's host routes, both families.
pub fn host_routes() -> Result<BTreeMap<IpAddr, String>, DataplaneError> {
    let mut all = BTreeMap::new();
    for family in ["-4", "-6"] {
        let out = exec::run_ok("ip", &[family, "-j", "route", "show"], None).map_err(|e| {
            DataplaneError::Tool {
                context: format!("ip {family} -j route show"),
                source: Box::new(e),
            }
        })?;
        all.extend(parse_host_routes(&out)?);
    }
    Ok(all)
}

/// Rule specs (after `-A WEIR-SPOOF `) for `family`: per pod interface, drop what does not
/// come from the pod's address of that family (everything, if it has none).
/// `bridge_ports`: pod → its bridge port; `bridged`: the node has a bridge. `log`: the
/// endpoint hashes, when each drop is logged first.
///
/// With `new_pods` (new-pod isolation on), a programmed pod's address may come only from
/// that pod's interface: what passed its interface's check returns, and then a packet from
/// any other pod interface (by name prefix) whose source is a programmed endpoint's (the
/// [`KNOWN_ENDPOINTS_SET`]) is dropped. Without it, an interface not programmed yet could
/// speak as a programmed pod: the new-pod catch-all drops only unknown sources. Devices
/// shared by several endpoints' routes (not one pod's) return unchecked, as before.
pub fn rules(
    desired: &Desired,
    routes: &BTreeMap<IpAddr, String>,
    bridge_ports: &BTreeMap<String, String>,
    bridged: bool,
    family: Family,
    mut log: Option<&mut ChainNames>,
    new_pods: Option<&NewPodIsolation>,
) -> Vec<String> {
    let mut dev_of: BTreeMap<&str, &str> = BTreeMap::new();
    let mut owners: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for ep in desired.endpoints.values() {
        let addrs = [ep.ipv4.map(IpAddr::V4), ep.ipv6.map(IpAddr::V6)];
        let dev = addrs.iter().flatten().find_map(|a| routes.get(a));
        if let Some(dev) = dev {
            dev_of.insert(ep.pod.as_str(), dev.as_str());
            owners
                .entry(dev.as_str())
                .or_default()
                .insert(ep.pod.as_str());
        }
        // Another family's host route on another device also belongs to this pod.
        for a in addrs.iter().flatten() {
            if let Some(d) = routes.get(a) {
                owners
                    .entry(d.as_str())
                    .or_default()
                    .insert(ep.pod.as_str());
            }
        }
    }
    let mut out = Vec::new();
    if bridged && family == Family::V6 {
        // A pod is not the node's router: its router advertisements and redirects would
        // turn its bridge neighbours' traffic to it. Before the link-scope pass below.
        for prefix in new_pods.iter().flat_map(|n| &n.prefixes) {
            for ty in [134, 137] {
                out.push(format!(
                    "-p ipv6-icmp -m physdev --physdev-in {prefix}+ -m icmp6 --icmpv6-type {ty} \
                     -m comment --comment \"router advertisement or redirect from a pod\" -j DROP"
                ));
            }
        }
        for (source, dest) in [
            ("fe80::/10", "ff02::/16"),
            ("fe80::/10", "fe80::/10"),
            ("::/128", "ff02::/16"),
        ] {
            out.push(format!(
                "-m physdev --physdev-is-bridged -s {source} -d {dest} \
                 -m comment --comment \"bridged link-scope traffic\" -j RETURN"
            ));
        }
    }
    // What passed a pod interface's own check (with new-pod isolation on).
    let mut anchored = BTreeSet::new();
    for ep in desired.endpoints.values() {
        let comment = format!("\"{} anti-spoofing\"", ep.pod.replace(['"', '\\'], ""));
        let source = match family {
            Family::V4 => ep.ipv4.map(|a| format!("! -s {a}/32 ")),
            Family::V6 => ep.ipv6.map(|a| format!("! -s {a}/128 ")),
        }
        .unwrap_or_default();
        let interface = if let Some(port) = bridge_ports.get(&ep.pod) {
            format!("-m physdev --physdev-in {port} ")
        } else {
            let Some(dev) = dev_of.get(ep.pod.as_str()) else {
                continue;
            };
            if owners.get(dev).is_some_and(|o| o.len() > 1) {
                anchored.insert(format!("-i {dev} "));
                continue;
            }
            format!("-i {dev} ")
        };
        let matches = format!("{interface}{source}");
        anchored.insert(interface);
        if let Some(names) = log.as_deref_mut() {
            let prefix = LogPrefix {
                kind: LogKind::Spoof,
                direction: Direction::Egress,
                hash: names.hash_for(&ep.pod),
            };
            out.push(log_rule(&matches, prefix));
        }
        out.push(format!("{matches}-m comment --comment {comment} -j DROP"));
    }
    let Some(new_pods) = new_pods.filter(|n| n.enabled()) else {
        return out;
    };
    out.extend(anchored.iter().map(|i| format!("{i}-j RETURN")));
    let known = set_name(KNOWN_ENDPOINTS_SET, family);
    let comment = "-m comment --comment \"a programmed pod address from another pod interface\"";
    for prefix in &new_pods.prefixes {
        out.push(format!(
            "-i {prefix}+ -m set --match-set {known} src {comment} -j DROP"
        ));
        if bridged {
            out.push(format!(
                "-m physdev --physdev-in {prefix}+ -m set --match-set {known} src {comment} -j DROP"
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::desired::{DirectionPolicy, Endpoint};

    fn ep(pod: &str, v4: Option<&str>, v6: Option<&str>) -> Endpoint {
        Endpoint {
            pod: pod.into(),
            ipv4: v4.map(|a| a.parse().unwrap()),
            ipv6: v6.map(|a| a.parse().unwrap()),
            ingress: DirectionPolicy::default(),
            egress: DirectionPolicy::default(),
        }
    }

    #[test]
    fn host_routes_only() {
        let json = r#"[{"dst":"10.244.0.2","dev":"lxca","scope":"link","flags":[]},
            {"dst":"10.244.0.0/16","dev":"cni0"},{"dst":"default","gateway":"10.0.0.1","dev":"eth0"},
            {"dst":"fd00::3/128","dev":"lxcb"},{"dst":"fd00::4","dev":"lxcb"}]"#;
        let r = parse_host_routes(json).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(r[&"10.244.0.2".parse::<IpAddr>().unwrap()], "lxca");
        assert_eq!(r[&"fd00::3".parse::<IpAddr>().unwrap()], "lxcb");
    }

    #[test]
    fn one_rule_per_pod_interface_and_family() {
        let mut d = Desired::default();
        for e in [
            ep("x/a", Some("10.0.0.2"), Some("fd00::2")),
            ep("x/b", Some("10.0.0.3"), None),
            // Shares a device with x/d: a bridge, not one pod's interface.
            ep("x/c", Some("10.0.0.4"), None),
            ep("x/d", Some("10.0.0.5"), None),
            // No host route at all.
            ep("x/e", Some("10.0.0.6"), None),
        ] {
            d.endpoints.insert(e.pod.clone(), e);
        }
        let routes: BTreeMap<IpAddr, String> = [
            ("10.0.0.2", "lxca"),
            ("fd00::2", "lxca"),
            ("10.0.0.3", "lxcb"),
            ("10.0.0.4", "br0"),
            ("10.0.0.5", "br0"),
        ]
        .into_iter()
        .map(|(a, d)| (a.parse().unwrap(), d.to_string()))
        .collect();
        let none = BTreeMap::new();
        assert_eq!(
            rules(&d, &routes, &none, false, Family::V4, None, None),
            [
                "-i lxca ! -s 10.0.0.2/32 -m comment --comment \"x/a anti-spoofing\" -j DROP",
                "-i lxcb ! -s 10.0.0.3/32 -m comment --comment \"x/b anti-spoofing\" -j DROP",
            ]
        );
        assert_eq!(
            rules(&d, &routes, &none, false, Family::V6, None, None),
            [
                "-i lxca ! -s fd00::2/128 -m comment --comment \"x/a anti-spoofing\" -j DROP",
                // x/b has no IPv6 address: nothing IPv6 may be forwarded from it.
                "-i lxcb -m comment --comment \"x/b anti-spoofing\" -j DROP",
            ]
        );
    }

    /// With new-pod isolation, a programmed pod's address is dropped from every pod
    /// interface but its own: each checked interface returns, then the catch-all.
    #[test]
    fn programmed_addresses_only_from_their_own_interface() {
        let mut d = Desired::default();
        for e in [
            ep("x/a", Some("10.0.0.2"), None),
            ep("x/c", Some("10.0.0.4"), None),
            ep("x/d", Some("10.0.0.5"), None),
        ] {
            d.endpoints.insert(e.pod.clone(), e);
        }
        let routes: BTreeMap<IpAddr, String> = [
            ("10.0.0.2", "lxca"),
            ("10.0.0.4", "br0"),
            ("10.0.0.5", "br0"),
        ]
        .into_iter()
        .map(|(a, d)| (a.parse().unwrap(), d.to_string()))
        .collect();
        let new_pods = NewPodIsolation {
            prefixes: vec!["lxc".into()],
            exempt: Vec::new(),
        };
        let known = set_name(KNOWN_ENDPOINTS_SET, Family::V4);
        let comment =
            "-m comment --comment \"a programmed pod address from another pod interface\"";
        assert_eq!(
            rules(
                &d,
                &routes,
                &BTreeMap::new(),
                false,
                Family::V4,
                None,
                Some(&new_pods)
            ),
            [
                "-i lxca ! -s 10.0.0.2/32 -m comment --comment \"x/a anti-spoofing\" -j DROP"
                    .to_string(),
                // A device shared by several endpoints is not one pod's: unchecked.
                "-i br0 -j RETURN".to_string(),
                "-i lxca -j RETURN".to_string(),
                format!("-i lxc+ -m set --match-set {known} src {comment} -j DROP"),
            ]
        );
        // Off: nothing added.
        assert_eq!(
            rules(
                &d,
                &routes,
                &BTreeMap::new(),
                false,
                Family::V4,
                None,
                Some(&NewPodIsolation::off())
            )
            .len(),
            1
        );
    }

    #[test]
    fn bridge_ports_match_with_physdev() {
        let mut d = Desired::default();
        for e in [
            ep("x/a", Some("10.0.0.2"), Some("fd00::2")),
            // On the bridge, but its port was not found: no rule.
            ep("x/b", Some("10.0.0.3"), None),
        ] {
            d.endpoints.insert(e.pod.clone(), e);
        }
        let ports = BTreeMap::from([("x/a".to_string(), "lxca".to_string())]);
        assert_eq!(
            rules(&d, &BTreeMap::new(), &ports, true, Family::V4, None, None),
            ["-m physdev --physdev-in lxca ! -s 10.0.0.2/32 -m comment --comment \"x/a anti-spoofing\" -j DROP"]
        );
        let v6 = rules(&d, &BTreeMap::new(), &ports, true, Family::V6, None, None);
        assert_eq!(v6.len(), 4, "{v6:?}");
        assert!(v6[..3].iter().all(|r| r.ends_with("-j RETURN")));
        assert_eq!(
            v6[3],
            "-m physdev --physdev-in lxca ! -s fd00::2/128 -m comment --comment \"x/a anti-spoofing\" -j DROP"
        );
    }
}
