//! The cluster as the engine sees it: namespaces, pods and nodes, indexed for the
//! queries the compiler makes (pods by namespace, by label and by address).
//! NetworkPolicies are kept by the engine in their validated form.

mod index;
mod labels;
mod object;
mod pod;

use std::borrow::Cow;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

pub use index::LabelIndex;
pub use labels::Labels;
pub use object::{Kind, Object, ObjectRef, DEFAULT_NAMESPACE};
pub use pod::{parse_protocol, ContainerPort, PodInfo, ProtocolError};

/// `namespace/name` of a pod.
pub type PodKey = String;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// IANA protocol number, as in the IP header.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The label the API server puts on every namespace, with the namespace's name.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// What the engine keeps of a Node: its labels and the IP addresses in
/// `status.addresses` (what a ClusterNetworkPolicy `nodes` peer matches).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    pub labels: Labels,
    pub addresses: BTreeSet<IpAddr>,
}

/// An object that was refused, or could not be enforced or removed, and why. The object is
/// named so an operator can find it (`pod x/a`, `networkpolicy x/deny`, `ipset weir-…`, a
/// map); everything else stays enforced. The one type for every such report: sources'
/// unreadable objects, dataplanes' failures, reset's undeletable sets, the agent's status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectError {
    pub object: String,
    pub reason: String,
}

/// A problem with one field of an object; the engine adds which object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub reason: String,
}

impl FieldError {
    pub fn new(field: &str, reason: impl Into<String>) -> Self {
        FieldError {
            field: field.to_owned(),
            reason: reason.into(),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct ClusterModel {
    namespaces: BTreeMap<String, Labels>,
    nodes: BTreeMap<String, NodeInfo>,
    /// One node's addresses as its own interfaces hold them (gateways, bridges,
    /// link-local ones), which its Node's `status.addresses` does not list: the agent
    /// knows them for its own node only.
    own_addresses: Option<(String, BTreeSet<IpAddr>)>,
    pods: HashMap<PodKey, PodInfo>,
    pods_by_namespace: HashMap<String, BTreeSet<PodKey>>,
    pods_by_label: LabelIndex,
    /// Sorted keys per address: an address has one pod but for a moment of reuse, and a
    /// B-tree set's first node is 280 bytes (a tenth of a pod's memory).
    pods_by_address: HashMap<IpAddr, Vec<PodKey>>,
}

impl ClusterModel {
    /// Labels of a namespace with the API server's `kubernetes.io/metadata.name` added,
    /// as it does on every namespace. A namespace known only from its pods has only that.
    pub fn namespace_labels(&self, name: &str) -> Cow<'_, Labels> {
        match self.namespaces.get(name) {
            Some(labels) => Cow::Borrowed(labels),
            None => Cow::Owned(Labels::from([(NAMESPACE_NAME_LABEL, name)])),
        }
    }

    /// Every namespace that has an object or a pod.
    pub fn namespace_names(&self) -> BTreeSet<&str> {
        self.namespaces
            .keys()
            .chain(self.pods_by_namespace.keys())
            .map(String::as_str)
            .collect()
    }

    /// Stores a namespace's labels; returns the previous ones.
    pub fn upsert_namespace(&mut self, name: &str, labels: Labels) -> Option<Labels> {
        let labels = labels.with(NAMESPACE_NAME_LABEL, name);
        self.namespaces.insert(name.to_owned(), labels)
    }

    pub fn remove_namespace(&mut self, name: &str) -> Option<Labels> {
        self.namespaces.remove(name)
    }

    pub fn upsert_node(&mut self, node: NodeInfo) -> Option<NodeInfo> {
        self.nodes.insert(node.name.clone(), node)
    }

    pub fn remove_node(&mut self, name: &str) -> Option<NodeInfo> {
        self.nodes.remove(name)
    }

    pub fn node(&self, name: &str) -> Option<&NodeInfo> {
        self.nodes.get(name)
    }

    pub fn nodes(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes.values()
    }

    /// Records `node`'s own interface addresses; whether they changed.
    pub fn set_own_addresses(&mut self, node: &str, addresses: BTreeSet<IpAddr>) -> bool {
        let new = Some((node.to_owned(), addresses));
        let changed = self.own_addresses != new;
        self.own_addresses = new;
        changed
    }

    /// Every address of `node` a `nodes` peer covers: its status's and, for the node whose
    /// own addresses are known, those too.
    pub fn node_addresses<'a>(&'a self, node: &'a NodeInfo) -> impl Iterator<Item = IpAddr> + 'a {
        let own = self
            .own_addresses
            .iter()
            .filter(move |(name, _)| *name == node.name)
            .flat_map(|(_, addrs)| addrs.iter());
        node.addresses.iter().chain(own).copied()
    }

    pub fn pod(&self, key: &str) -> Option<&PodInfo> {
        self.pods.get(key)
    }

    pub fn pods(&self) -> impl Iterator<Item = &PodInfo> {
        self.pods.values()
    }

    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    pub fn pods_in_namespace(&self, namespace: &str) -> impl Iterator<Item = &PodInfo> {
        self.pod_keys_in_namespace(namespace)
            .into_iter()
            .flatten()
            .filter_map(|k| self.pods.get(k))
    }

    pub fn pod_keys_in_namespace(&self, namespace: &str) -> Option<&BTreeSet<PodKey>> {
        self.pods_by_namespace.get(namespace)
    }

    /// Keys of the pods labelled `key=value`.
    pub fn pods_labelled(&self, key: &str, value: &str) -> Option<&BTreeSet<PodKey>> {
        self.pods_by_label.get(key, value)
    }

    /// Pods that currently claim `addr`.
    pub fn pods_with_address(&self, addr: IpAddr) -> impl Iterator<Item = &PodInfo> {
        self.pods_by_address
            .get(&addr)
            .into_iter()
            .flatten()
            .filter_map(|k| self.pods.get(k))
    }

    /// Stores a pod; returns the previous version.
    pub fn upsert_pod(&mut self, info: PodInfo) -> Option<PodInfo> {
        let key = info.key();
        let old = self.remove_pod(&key);
        self.pods_by_namespace
            .entry(info.namespace.clone())
            .or_default()
            .insert(key.clone());
        self.pods_by_label.insert(&key, &info.labels);
        for addr in info.addresses() {
            match self.pods_by_address.entry(addr) {
                // Exactly one key's room, the usual case.
                Entry::Vacant(v) => {
                    v.insert(vec![key.clone()]);
                }
                Entry::Occupied(mut o) => {
                    let keys = o.get_mut();
                    if let Err(at) = keys.binary_search(&key) {
                        keys.insert(at, key.clone());
                    }
                }
            }
        }
        self.pods.insert(key, info);
        old
    }

    pub fn remove_pod(&mut self, key: &str) -> Option<PodInfo> {
        let old = self.pods.remove(key)?;
        if let Some(keys) = self.pods_by_namespace.get_mut(&old.namespace) {
            keys.remove(key);
            if keys.is_empty() {
                self.pods_by_namespace.remove(&old.namespace);
            }
        }
        self.pods_by_label.remove(key, &old.labels);
        for addr in old.addresses() {
            if let Some(keys) = self.pods_by_address.get_mut(&addr) {
                keys.retain(|k| k != key);
                if keys.is_empty() {
                    self.pods_by_address.remove(&addr);
                }
            }
        }
        Some(old)
    }
}
