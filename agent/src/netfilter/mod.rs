//! What the iptables dataplane and reset share about netfilter: which iptables backend
//! (legacy or nft) the node uses, the names that mark weir's chains and sets, and the
//! packet mark bits other agents' rules use.
pub mod backend;
pub mod marks;

/// weir's chains (`WEIR-*`) and sets (`weir-*`).
pub const WEIR_CHAIN_PREFIX: &str = "WEIR-";
pub const WEIR_SET_PREFIX: &str = "weir-";
