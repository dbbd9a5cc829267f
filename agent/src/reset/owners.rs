//! Whose state reset removes: weir's own names (unless weir's iptables dataplane is the
//! one enforcing), Azure NPM's when migrating from it or when the node carries it.

use crate::netfilter::{WEIR_CHAIN_PREFIX, WEIR_EBPF_CHAIN, WEIR_SET_PREFIX};

/// Azure NPM's chains (`AZURE-NPM`, `AZURE-NPM-INGRESS`, ...) and sets (`azure-npm-<hash>`).
pub const NPM_CHAIN_PREFIX: &str = "AZURE-NPM";
pub const NPM_SET_PREFIX: &str = "azure-npm-";
/// Program-name prefix of weir's BPF programs, used to find its TC filters.
pub const WEIR_PROGRAM_PREFIX: &str = "weir_";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owners {
    /// The iptables dataplane's chains and sets.
    pub weir: bool,
    /// The eBPF dataplane's one chain ([`WEIR_EBPF_CHAIN`]).
    pub weir_ebpf: bool,
    pub azure_npm: bool,
}

impl Owners {
    pub fn owns_chain(&self, chain: &str) -> bool {
        (self.weir && chain.starts_with(WEIR_CHAIN_PREFIX))
            || (self.weir_ebpf && chain == WEIR_EBPF_CHAIN)
            || (self.azure_npm && chain.starts_with(NPM_CHAIN_PREFIX))
    }

    pub fn owns_set(&self, set: &str) -> bool {
        (self.weir && set.starts_with(WEIR_SET_PREFIX))
            || (self.azure_npm && set.starts_with(NPM_SET_PREFIX))
    }
}

/// Whether any of these chain or set names is Azure NPM's.
pub fn carries_azure_npm<'a>(
    chains: impl IntoIterator<Item = &'a str>,
    sets: impl IntoIterator<Item = &'a str>,
) -> bool {
    chains.into_iter().any(|c| c.starts_with(NPM_CHAIN_PREFIX))
        || sets.into_iter().any(|s| s.starts_with(NPM_SET_PREFIX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npm_names_are_owned_only_when_asked() {
        let weir_only = Owners {
            weir: true,
            weir_ebpf: false,
            azure_npm: false,
        };
        let with_npm = Owners {
            weir: true,
            weir_ebpf: false,
            azure_npm: true,
        };
        let npm_only = Owners {
            weir: false,
            weir_ebpf: false,
            azure_npm: true,
        };
        let ebpf_only = Owners {
            weir: false,
            weir_ebpf: true,
            azure_npm: false,
        };
        // Each dataplane's reset leaves the other's chains: both run during a switch.
        assert!(ebpf_only.owns_chain(WEIR_EBPF_CHAIN));
        assert!(!ebpf_only.owns_chain("WEIR-FILTER"));
        assert!(!weir_only.owns_chain(WEIR_EBPF_CHAIN));
        assert!(npm_only.owns_chain("AZURE-NPM-INGRESS"));
        assert!(npm_only.owns_set("azure-npm-1"));
        assert!(!npm_only.owns_chain("WEIR-FILTER"));
        assert!(!npm_only.owns_set("weir-0123"));
        assert!(weir_only.owns_chain("WEIR-INGRESS"));
        assert!(!weir_only.owns_chain("AZURE-NPM-INGRESS"));
        assert!(with_npm.owns_chain("AZURE-NPM"));
        assert!(with_npm.owns_set("azure-npm-1234"));
        assert!(!with_npm.owns_set("KUBE-X"));
        assert!(!with_npm.owns_chain("FORWARD"));
        assert!(carries_azure_npm(["FORWARD", "AZURE-NPM"], []));
        assert!(carries_azure_npm([], ["azure-npm-1"]));
        assert!(!carries_azure_npm(["FORWARD"], ["weir-1"]));
    }
}
