//! What the iptables dataplane and reset share about netfilter: which iptables backend
//! (legacy or nft) the node uses, the names that mark weir's chains and sets, and the
//! packet mark bits other agents' rules use.
pub mod backend;
pub mod marks;

/// weir's chains (`WEIR-*`) and sets (`weir-*`).
pub const WEIR_CHAIN_PREFIX: &str = "WEIR-";
pub const WEIR_SET_PREFIX: &str = "weir-";
/// The eBPF dataplane's one chain (from INPUT: Service traffic DNATed to the node), named
/// apart from `WEIR-*` so that the iptables dataplane, which owns those, leaves it alone
/// while both run during a switch.
pub const WEIR_EBPF_CHAIN: &str = "WEIRBPF-TO-NODE";

/// Whether a chain is weir's, of either dataplane.
pub fn is_weirs_chain(chain: &str) -> bool {
    chain.starts_with(WEIR_CHAIN_PREFIX) || chain == WEIR_EBPF_CHAIN
}
