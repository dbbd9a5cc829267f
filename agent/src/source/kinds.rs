//! The kinds of object weir reads from a cluster, by the names `/readyz`, the status and
//! the relay's keys give them.

use weir_policy::model::Kind;

/// What the first complete state needs, as `/readyz` names it.
pub const KINDS: [&str; 6] = [
    "pods",
    "namespaces",
    "networkpolicies",
    "nodes",
    "services",
    "clusternetworkpolicies",
];

/// The name of `kind` in [`KINDS`].
pub fn label(kind: Kind) -> &'static str {
    match kind {
        Kind::Pod => KINDS[0],
        Kind::Namespace => KINDS[1],
        Kind::NetworkPolicy => KINDS[2],
        Kind::Node => KINDS[3],
        Kind::Service => KINDS[4],
        Kind::ClusterNetworkPolicy => KINDS[5],
    }
}
