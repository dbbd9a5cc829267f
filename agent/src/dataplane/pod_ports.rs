//! Which bridge port is a pod's. On a bridged CNI (flannel's cni0, kubenet's cbr0, Azure
//! CNI's azure0) every pod's host-side veth is a port of one bridge, and the route to any
//! pod address leads to the bridge: the route cannot tell pods apart.
//!
//! The veth pair can. A pod's network namespace (container runtimes keep them under
//! /run/netns) has an interface with the pod's address whose peer is in another namespace
//! (`link_index`, `link_netnsid` in `ip -j addr`); that peer's index is the port's in the
//! node namespace, and the port's own peer must be that interface, in that namespace (the
//! port's `link_netnsid` is the id the node gives the namespace file, which the kernel
//! answers: namespaces of other nodes or labs on the same host are ruled out, and nothing
//! is asked of a namespace no bridge port leads to). What a pod can
//! change in its own namespace cannot make this name another pod's port: it could add
//! another pod's address to its eth0, but then two namespaces claim the address and
//! neither is placed (refused, named in the error: fail closed, the port stays isolated as
//! a new pod), and its own port would carry two pods' addresses, which is refused too.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use crate::exec::{self, ExecError};

/// Where container runtimes (and `ip netns`, and `weir-lab`) keep pods' network
/// namespaces; the DaemonSet mounts the host's.
pub const DEFAULT_POD_NETNS_DIR: &str = "/run/netns";

/// Why the node's interfaces could not be read, or a pod's bridge port was not found (or
/// was refused). Cloned to every pod a failed listing concerns, hence the `Arc`s.
#[derive(Clone, Debug, thiserror::Error)]
pub enum PortError {
    #[error("`{command}`: {source}")]
    Tool {
        command: &'static str,
        #[source]
        source: Arc<ExecError>,
    },
    #[error("parse `{command}`: {source}")]
    Parse {
        command: &'static str,
        #[source]
        source: Arc<serde_json::Error>,
    },
    #[error("listing pod network namespaces in {}: {source}", dir.display())]
    ListNamespaces {
        dir: PathBuf,
        #[source]
        source: Arc<std::io::Error>,
    },
    #[error("setns: {0}")]
    Enter(#[source] Arc<std::io::Error>),
    #[error("the thread that entered the namespace panicked")]
    Panicked,
    #[error("address {addr} is on more than one interface (namespaces {}): refused", namespaces.join(", "))]
    OnManyInterfaces {
        addr: IpAddr,
        namespaces: Vec<String>,
    },
    #[error("addresses {first} and {second} are on different interfaces: refused")]
    OnDifferentInterfaces { first: IpAddr, second: IpAddr },
    #[error(
        "no namespace in {} has an interface with {} whose peer is in another namespace",
        dir.display(),
        addrs.iter().map(ToString::to_string).collect::<Vec<_>>().join(" or ")
    )]
    NotClaimed { dir: PathBuf, addrs: Vec<IpAddr> },
    #[error(
        "the peer of {addr}'s interface in namespace {netns} (index {ifindex}) is not in this namespace"
    )]
    PeerNotHere {
        addr: IpAddr,
        netns: String,
        ifindex: u32,
    },
    #[error(
        "interface {ifname} (index {ifindex}) is not the veth peer of {addr}'s interface in namespace {netns}"
    )]
    NotThePeer {
        ifname: String,
        ifindex: u32,
        addr: IpAddr,
        netns: String,
    },
    #[error("interface {0} is not a bridge port")]
    NotABridgePort(String),
    #[error("bridge port {port} carries the addresses of pods {}: refused", pods.join(", "))]
    Shared { port: String, pods: Vec<String> },
}

/// Runs `ip ARGS` (in the calling thread's namespace) and parses its JSON.
fn ip_json<T: serde::de::DeserializeOwned>(
    command: &'static str,
    args: &[&str],
) -> Result<T, PortError> {
    let out = exec::run_ok("ip", args, None).map_err(|e| PortError::Tool {
        command,
        source: Arc::new(e),
    })?;
    parse_json(command, &out)
}

fn parse_json<T: serde::de::DeserializeOwned>(
    command: &'static str,
    json: &str,
) -> Result<T, PortError> {
    serde_json::from_str(json).map_err(|e| PortError::Parse {
        command,
        source: Arc::new(e),
    })
}

/// A pod's port on a bridge, in the node namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    pub ifname: String,
    pub ifindex: u32,
}

#[derive(Clone, Debug, Deserialize)]
struct LinkInfo {
    info_kind: Option<String>,
}

/// One interface of `ip -j -d link show` / `ip -j addr show`.
#[derive(Clone, Debug, Deserialize)]
struct Link {
    ifindex: u32,
    ifname: String,
    master: Option<String>,
    /// The peer's index (a veth's other end), in `link_netnsid`'s namespace if given.
    link_index: Option<u32>,
    link_netnsid: Option<i64>,
    linkinfo: Option<LinkInfo>,
    #[serde(default)]
    addr_info: Vec<AddrInfo>,
}

#[derive(Clone, Debug, Deserialize)]
struct AddrInfo {
    local: Option<String>,
}

impl Link {
    fn kind(&self) -> Option<&str> {
        self.linkinfo.as_ref()?.info_kind.as_deref()
    }
}

const LINK_SHOW: &str = "ip -j -d link show";
const ADDR_SHOW: &str = "ip -j addr show";

/// The interfaces of the calling thread's network namespace (the node's).
#[derive(Clone, Debug, Default)]
pub struct NodeLinks {
    by_index: BTreeMap<u32, Link>,
}

impl NodeLinks {
    pub fn read() -> Result<Self, PortError> {
        let links: Vec<Link> = ip_json(LINK_SHOW, &["-j", "-d", "link", "show"])?;
        Ok(Self::from_links(links))
    }

    #[cfg(test)]
    fn parse(json: &str) -> Result<Self, PortError> {
        Ok(Self::from_links(parse_json(LINK_SHOW, json)?))
    }

    fn from_links(links: Vec<Link>) -> Self {
        NodeLinks {
            by_index: links.into_iter().map(|l| (l.ifindex, l)).collect(),
        }
    }

    /// Whether `ifname` is a bridge: the interface of many pods, never one pod's.
    pub fn is_bridge(&self, ifname: &str) -> bool {
        self.by_index
            .values()
            .any(|l| l.ifname == ifname && l.kind() == Some("bridge"))
    }

    /// Whether this namespace has a bridge (bridged pods are possible).
    pub fn has_bridge(&self) -> bool {
        self.by_index.values().any(|l| l.kind() == Some("bridge"))
    }

    /// Whether `port` is still there: same index, same name.
    pub fn has(&self, port: &Port) -> bool {
        self.by_index
            .get(&port.ifindex)
            .is_some_and(|l| l.ifname == port.ifname)
    }

    /// Names of the interfaces that are ports of a bridge.
    pub fn bridge_port_names(&self) -> BTreeSet<&str> {
        self.by_index
            .values()
            .filter(|l| l.master.as_deref().is_some_and(|m| self.is_bridge(m)))
            .map(|l| l.ifname.as_str())
            .collect()
    }
}

/// A namespace's interface that holds an address and has its peer in another namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Claim {
    netns: String,
    pod_ifindex: u32,
    port_ifindex: u32,
}

/// Each pod's bridge port, from the addresses of `pods` (pod key → its addresses), found
/// through the namespaces in `netns_dir`. A pod whose port is not found (or not only
/// its own) gets the reason instead.
pub fn locate(
    netns_dir: &Path,
    links: &NodeLinks,
    pods: &BTreeMap<String, Vec<IpAddr>>,
) -> BTreeMap<String, Result<Port, PortError>> {
    if pods.is_empty() {
        return BTreeMap::new();
    }
    let claims = match claims_in(netns_dir, links) {
        Ok(c) => c,
        Err(e) => return pods.keys().map(|p| (p.clone(), Err(e.clone()))).collect(),
    };
    resolve(netns_dir, links, &claims, pods)
}

fn resolve(
    netns_dir: &Path,
    links: &NodeLinks,
    claims: &BTreeMap<IpAddr, Vec<Claim>>,
    pods: &BTreeMap<String, Vec<IpAddr>>,
) -> BTreeMap<String, Result<Port, PortError>> {
    let mut out: BTreeMap<String, Result<Port, PortError>> = BTreeMap::new();
    for (pod, addrs) in pods {
        out.insert(pod.clone(), port_of(netns_dir, links, claims, addrs));
    }
    // A port that two pods' addresses lead to is neither's.
    let mut by_port: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for (pod, r) in &out {
        if let Ok(p) = r {
            by_port.entry(p.ifindex).or_default().push(pod.clone());
        }
    }
    for shared in by_port.values().filter(|pods| pods.len() > 1) {
        for pod in shared {
            let port = out[pod]
                .as_ref()
                .map(|p| p.ifname.clone())
                .unwrap_or_default();
            out.insert(
                pod.clone(),
                Err(PortError::Shared {
                    port,
                    pods: shared.clone(),
                }),
            );
        }
    }
    out
}

fn port_of(
    netns_dir: &Path,
    links: &NodeLinks,
    claims: &BTreeMap<IpAddr, Vec<Claim>>,
    addrs: &[IpAddr],
) -> Result<Port, PortError> {
    let mut found: Option<(IpAddr, &Claim)> = None;
    for addr in addrs {
        let Some(list) = claims.get(addr) else {
            continue;
        };
        if list.len() > 1 {
            let namespaces: BTreeSet<&str> = list.iter().map(|c| c.netns.as_str()).collect();
            return Err(PortError::OnManyInterfaces {
                addr: *addr,
                namespaces: namespaces.into_iter().map(str::to_owned).collect(),
            });
        }
        let claim = &list[0];
        match found {
            Some((other, c)) if c != claim => {
                return Err(PortError::OnDifferentInterfaces {
                    first: other,
                    second: *addr,
                })
            }
            _ => found = Some((*addr, claim)),
        }
    }
    let Some((addr, claim)) = found else {
        return Err(PortError::NotClaimed {
            dir: netns_dir.to_path_buf(),
            addrs: addrs.to_vec(),
        });
    };
    let port = links
        .by_index
        .get(&claim.port_ifindex)
        .ok_or_else(|| PortError::PeerNotHere {
            addr,
            netns: claim.netns.clone(),
            ifindex: claim.port_ifindex,
        })?;
    if port.kind() != Some("veth") || port.link_index != Some(claim.pod_ifindex) {
        return Err(PortError::NotThePeer {
            ifname: port.ifname.clone(),
            ifindex: port.ifindex,
            addr,
            netns: claim.netns.clone(),
        });
    }
    if !port.master.as_deref().is_some_and(|m| links.is_bridge(m)) {
        return Err(PortError::NotABridgePort(port.ifname.clone()));
    }
    Ok(Port {
        ifname: port.ifname.clone(),
        ifindex: port.ifindex,
    })
}

/// Address → the interfaces that hold it, over the namespaces in `dir` that a bridge
/// port of this namespace leads to, counting only interfaces whose peer is such a port. A
/// namespace that cannot be read (being deleted) is skipped: its pod is not placed.
fn claims_in(dir: &Path, node: &NodeLinks) -> Result<BTreeMap<IpAddr, Vec<Claim>>, PortError> {
    let entries = std::fs::read_dir(dir).map_err(|e| PortError::ListNamespaces {
        dir: dir.to_path_buf(),
        source: Arc::new(e),
    })?;
    let port_nsids: BTreeSet<i64> = node
        .by_index
        .values()
        .filter(|l| l.master.is_some())
        .filter_map(|l| l.link_netnsid)
        .collect();
    let mut claims: BTreeMap<IpAddr, Vec<Claim>> = BTreeMap::new();
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(file) = File::open(&path) else {
            continue;
        };
        // Every namespace a veth of this one leads to has an id here.
        let nsid = match crate::sys::netlink::nsid_of(&file) {
            Ok(Some(id)) if port_nsids.contains(&i64::from(id)) => i64::from(id),
            Ok(_) => continue, // no port of ours leads there
            Err(e) => {
                tracing::debug!(netns = %path.display(), "no namespace id: {e}");
                continue;
            }
        };
        let links = match addresses_in(&file) {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(netns = %path.display(), "not read: {e}");
                continue;
            }
        };
        for link in links {
            let (Some(port_ifindex), Some(_)) = (link.link_index, link.link_netnsid) else {
                continue; // no peer in another namespace: not a pod's uplink
            };
            // The peer must be a port of ours whose own peer is this very interface.
            let peered = node.by_index.get(&port_ifindex).is_some_and(|port| {
                port.link_netnsid == Some(nsid) && port.link_index == Some(link.ifindex)
            });
            if !peered {
                continue;
            }
            for addr in link.addr_info.iter().filter_map(|a| a.local.as_deref()) {
                let Ok(addr) = addr.parse::<IpAddr>() else {
                    continue;
                };
                claims.entry(addr).or_default().push(Claim {
                    netns: name.clone(),
                    pod_ifindex: link.ifindex,
                    port_ifindex,
                });
            }
        }
    }
    Ok(claims)
}

/// `ip -j addr show` inside the namespace pinned at `path`, from a thread that entered it
/// (`ip -n` only takes names under /run/netns).
fn addresses_in(file: &File) -> Result<Vec<Link>, PortError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            // Only this (scoped) thread moves.
            crate::sys::netns::enter_net(file).map_err(|e| PortError::Enter(Arc::new(e)))?;
            ip_json(ADDR_SHOW, &["-j", "addr", "show"])
        })
        .join()
        .unwrap_or(Err(PortError::Panicked))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE: &str = r#"[
        {"ifindex":1,"ifname":"lo"},
        {"ifindex":2,"ifname":"cni0","linkinfo":{"info_kind":"bridge"}},
        {"ifindex":5,"ifname":"lxca","master":"cni0","link_index":2,"link_netnsid":0,
         "linkinfo":{"info_kind":"veth"}},
        {"ifindex":6,"ifname":"lxcb","master":"cni0","link_index":2,"link_netnsid":1,
         "linkinfo":{"info_kind":"veth"}},
        {"ifindex":7,"ifname":"lxcc","link_index":2,"link_netnsid":2,
         "linkinfo":{"info_kind":"veth"}}
    ]"#;

    fn claim(ns: &str, port: u32) -> Claim {
        Claim {
            netns: ns.into(),
            pod_ifindex: 2,
            port_ifindex: port,
        }
    }

    fn pods(list: &[(&str, &[&str])]) -> BTreeMap<String, Vec<IpAddr>> {
        list.iter()
            .map(|(p, a)| {
                (
                    p.to_string(),
                    a.iter().map(|a| a.parse().unwrap()).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn finds_each_pods_own_port_and_refuses_ambiguity() {
        let links = NodeLinks::parse(NODE).unwrap();
        assert!(links.is_bridge("cni0"));
        assert!(!links.is_bridge("lxca"));
        assert_eq!(links.bridge_port_names(), BTreeSet::from(["lxca", "lxcb"]));
        let mut claims: BTreeMap<IpAddr, Vec<Claim>> = BTreeMap::new();
        let mut add = |a: &str, c: Claim| claims.entry(a.parse().unwrap()).or_default().push(c);
        add("10.0.0.2", claim("a", 5));
        add("fd00::2", claim("a", 5));
        add("10.0.0.3", claim("b", 6));
        // Not a bridge port.
        add("10.0.0.4", claim("c", 7));
        // Two namespaces claim one address (a pod added another's address).
        add("10.0.0.9", claim("x", 5));
        add("10.0.0.9", claim("y", 6));
        let dir = Path::new("/run/netns");
        let r = resolve(
            dir,
            &links,
            &claims,
            &pods(&[
                ("x/a", &["10.0.0.2", "fd00::2"]),
                ("x/b", &["10.0.0.3"]),
                ("x/c", &["10.0.0.4"]),
                ("x/d", &["10.0.0.5"]),
                ("x/e", &["10.0.0.9"]),
            ]),
        );
        assert_eq!(
            r["x/a"].as_ref().ok(),
            Some(&Port {
                ifname: "lxca".into(),
                ifindex: 5
            })
        );
        assert_eq!(r["x/b"].as_ref().unwrap().ifname, "lxcb");
        assert!(matches!(r["x/c"], Err(PortError::NotABridgePort(_))));
        assert!(matches!(r["x/d"], Err(PortError::NotClaimed { .. })));
        assert!(matches!(r["x/e"], Err(PortError::OnManyInterfaces { .. })));
    }

    #[test]
    fn a_port_two_pods_lead_to_is_neithers() {
        let links = NodeLinks::parse(NODE).unwrap();
        let mut claims: BTreeMap<IpAddr, Vec<Claim>> = BTreeMap::new();
        // Pod b's namespace also holds pod z's address (not anywhere else yet).
        claims.insert("10.0.0.3".parse().unwrap(), vec![claim("b", 6)]);
        claims.insert("10.0.0.8".parse().unwrap(), vec![claim("b", 6)]);
        let r = resolve(
            Path::new("/run/netns"),
            &links,
            &claims,
            &pods(&[("x/b", &["10.0.0.3"]), ("x/z", &["10.0.0.8"])]),
        );
        let shared = r["x/b"].as_ref().unwrap_err();
        assert!(matches!(shared, PortError::Shared { pods, .. } if pods == &["x/b", "x/z"]));
        assert!(shared.to_string().contains("x/b, x/z"));
        assert!(r["x/z"].is_err());
    }
}
