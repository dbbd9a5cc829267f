//! Address sets: what a peer selects, written canonically (the [`SetDef`]), and the
//! addresses that currently satisfy it.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;

use super::selector::Selector;
use super::spec::{NamespaceScope, PeerSpec};
use crate::desired::{Member, Protocol};
use crate::model::{ClusterModel, PodInfo};

/// What an address set selects. Its canonical text ([`SetDef::definition`]) is what the
/// set id is derived from.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SetDef {
    Peer(PeerSpec),
    /// The pods that the group's `base` selects on which the named port
    /// `name`/`protocol` is `number`. Egress named ports resolve per destination pod, so
    /// a peer is split by the number its pods give the name.
    NamedPort(NamedPortGroup, u16),
}

/// An egress peer with a named port, before the split by resolved number.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamedPortGroup {
    /// The peer; a rule without peers has every pod ([`PeerSpec::every_pod`]), so that
    /// equal selections have equal definitions.
    pub base: PeerSpec,
    pub name: String,
    pub protocol: Protocol,
}

impl SetDef {
    pub fn definition(&self) -> String {
        match self {
            SetDef::Peer(p) => p.definition(),
            SetDef::NamedPort(g, number) => format!(
                "{} port({}/{}={number})",
                g.base.definition(),
                g.name,
                g.protocol
            ),
        }
    }

    /// The members `pod` contributes to this set (CIDR sets get none from pods).
    pub fn pod_members(&self, model: &ClusterModel, pod: &PodInfo) -> Vec<Member> {
        let addresses = match self {
            SetDef::Peer(PeerSpec::Block { .. } | PeerSpec::Nodes(_)) => Vec::new(),
            SetDef::Peer(peer) => peer.pod_addresses(model, pod),
            SetDef::NamedPort(g, number) => {
                if pod.named_port(&g.name, g.protocol) == Some(*number) {
                    g.pod_addresses(model, pod)
                } else {
                    Vec::new()
                }
            }
        };
        addresses.into_iter().map(host_member).collect()
    }

    /// Every member, computed from the model.
    pub fn members(&self, model: &ClusterModel) -> BTreeSet<Member> {
        match self {
            SetDef::Peer(PeerSpec::Block { cidr, except }) => {
                let holes = except.iter().map(|net| Member {
                    net: *net,
                    except: true,
                });
                std::iter::once(Member {
                    net: *cidr,
                    except: false,
                })
                .chain(holes)
                .collect()
            }
            SetDef::Peer(PeerSpec::Nodes(sel)) => model
                .nodes()
                .filter(|n| sel.matches(&n.labels))
                .flat_map(|n| model.node_addresses(n).map(host_member))
                .collect(),
            SetDef::Peer(peer) => candidates(model, peer)
                .into_iter()
                .flat_map(|pod| self.pod_members(model, pod))
                .collect(),
            SetDef::NamedPort(g, _) => candidates(model, &g.base)
                .into_iter()
                .flat_map(|pod| self.pod_members(model, pod))
                .collect(),
        }
    }

    /// The namespace selector that decides membership, if namespace labels do.
    pub fn namespace_selector(&self) -> Option<&Selector> {
        match self {
            SetDef::Peer(p) => p.namespace_selector(),
            SetDef::NamedPort(g, _) => g.namespace_selector(),
        }
    }
}

impl NamedPortGroup {
    fn pod_addresses(&self, model: &ClusterModel, pod: &PodInfo) -> Vec<IpAddr> {
        self.base.pod_addresses(model, pod)
    }

    /// Whether `pod` is in the base and serves the named port.
    pub fn resolves_on(&self, model: &ClusterModel, pod: &PodInfo) -> bool {
        pod.named_port(&self.name, self.protocol).is_some()
            && !self.pod_addresses(model, pod).is_empty()
    }

    /// The numbers the name resolves to across the base's pods.
    pub fn numbers(&self, model: &ClusterModel) -> BTreeSet<u16> {
        candidates(model, &self.base)
            .into_iter()
            .filter(|pod| !self.pod_addresses(model, pod).is_empty())
            .filter_map(|pod| pod.named_port(&self.name, self.protocol))
            .collect()
    }

    pub fn namespace_selector(&self) -> Option<&Selector> {
        self.base.namespace_selector()
    }
}

impl PeerSpec {
    /// Every (selectable) pod of every namespace.
    pub fn every_pod() -> Self {
        PeerSpec::Pods {
            namespaces: NamespaceScope::Selected(Selector::default()),
            pods: Selector::default(),
        }
    }

    /// Canonical text of what the peer selects, namespace scoping included.
    pub fn definition(&self) -> String {
        match self {
            PeerSpec::Pods {
                namespaces: NamespaceScope::Named(ns),
                pods,
            } => {
                format!("pods(namespace={ns}; pods={pods})")
            }
            PeerSpec::Pods {
                namespaces: NamespaceScope::Selected(sel),
                pods,
            } => {
                format!("pods(namespaces={sel}; pods={pods})")
            }
            PeerSpec::Block { cidr, except } if except.is_empty() => format!("cidr({cidr})"),
            PeerSpec::Block { cidr, except } => {
                let holes: Vec<String> = except.iter().map(IpNet::to_string).collect();
                format!("cidr({cidr} except {})", holes.join(","))
            }
            PeerSpec::Nodes(sel) => format!("nodes({sel})"),
        }
    }

    /// The addresses of `pod` that this peer selects.
    pub fn pod_addresses(&self, model: &ClusterModel, pod: &PodInfo) -> Vec<IpAddr> {
        if !pod.selectable() {
            return Vec::new();
        }
        match self {
            PeerSpec::Pods { namespaces, pods } => {
                let ns_ok = match namespaces {
                    NamespaceScope::Named(ns) => *ns == pod.namespace,
                    NamespaceScope::Selected(sel) => {
                        sel.matches(&model.namespace_labels(&pod.namespace))
                    }
                };
                if ns_ok && pods.matches(&pod.labels) {
                    pod.addresses().collect()
                } else {
                    Vec::new()
                }
            }
            PeerSpec::Block { cidr, except } => pod
                .addresses()
                .filter(|a| cidr.contains(a) && !except.iter().any(|e| e.contains(a)))
                .collect(),
            // A pod is never a node (a host-network pod, which has the node's address, is
            // not selectable).
            PeerSpec::Nodes(_) => Vec::new(),
        }
    }

    pub fn namespace_selector(&self) -> Option<&Selector> {
        match self {
            PeerSpec::Pods {
                namespaces: NamespaceScope::Selected(sel),
                ..
            } => Some(sel),
            _ => None,
        }
    }
}

fn host_member(addr: IpAddr) -> Member {
    Member {
        net: IpNet::from(addr),
        except: false,
    }
}

/// Pods that may be selected by `peer`, narrowed through the model's indexes; callers
/// still check each one.
pub fn candidates<'m>(model: &'m ClusterModel, peer: &PeerSpec) -> Vec<&'m PodInfo> {
    match peer {
        PeerSpec::Pods {
            namespaces: NamespaceScope::Named(ns),
            pods,
        } => pods_in_namespace_matching(model, ns, pods),
        PeerSpec::Pods {
            namespaces: NamespaceScope::Selected(sel),
            pods,
        } => model
            .namespace_names()
            .into_iter()
            .filter(|ns| sel.matches(&model.namespace_labels(ns)))
            .flat_map(|ns| pods_in_namespace_matching(model, ns, pods))
            .collect(),
        PeerSpec::Block { .. } => model.pods().collect(),
        PeerSpec::Nodes(_) => Vec::new(),
    }
}

/// The selectable pods of `namespace` whose labels match `selector`.
pub fn pods_in_namespace_matching<'m>(
    model: &'m ClusterModel,
    namespace: &str,
    selector: &Selector,
) -> Vec<&'m PodInfo> {
    let in_namespace = model.pod_keys_in_namespace(namespace);
    let namespace_size = in_namespace.map_or(0, BTreeSet::len);
    let keys: Box<dyn Iterator<Item = &String>> = match selector.index_hint() {
        Some((key, values)) => {
            let lists: Vec<_> = values
                .iter()
                .filter_map(|v| model.pods_labelled(key, v))
                .collect();
            if lists.iter().map(|l| l.len()).sum::<usize>() < namespace_size {
                Box::new(lists.into_iter().flatten())
            } else {
                Box::new(in_namespace.into_iter().flatten())
            }
        }
        None => Box::new(in_namespace.into_iter().flatten()),
    };
    keys.filter_map(|k| model.pod(k))
        .filter(|p| p.namespace == namespace && p.selectable() && selector.matches(&p.labels))
        .collect()
}
