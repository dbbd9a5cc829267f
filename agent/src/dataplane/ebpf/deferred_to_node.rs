//! Service traffic that kube-proxy DNATs to the node itself (a host-network backend: the
//! API server on a control-plane node, a node-local cache) is delivered locally, past
//! every pod's TC hook, so the client's egress verdict that `weir_from_pod` deferred to
//! the backend's hook would never be taken, and a ClusterNetworkPolicy deny to the node
//! would not hold through a Service. The socket filter `weir_deferred_to_node` takes that
//! verdict, run by the iptables `bpf` match from [`WEIR_EBPF_CHAIN`], which the node's
//! INPUT jumps to first (both families, on the node's iptables backend). A packet that
//! carries no deferred client returns at the chain's first rule.
//!
//! kube-proxy's ipvs mode DNATs after INPUT's filter table, so there the packet still has
//! the Service address and the filter lets it pass (see ARCHITECTURE.md).

use std::fmt::Write as _;
use std::path::Path;

use weir_common::DEFER_MARK_MASK;

use crate::dataplane::DataplaneError;
use crate::netfilter::backend::{Backend, Family};
use crate::netfilter::WEIR_EBPF_CHAIN;

/// The `iptables-restore --noflush` script for one family: declaring the chain flushes it,
/// so its rules take the program pinned at `program` now; INPUT's jump is added unless
/// `filter` (that family's `iptables-save -t filter`) has it.
pub fn script(filter: &str, program: &Path) -> String {
    let jump = format!("-A INPUT -j {WEIR_EBPF_CHAIN}");
    let has_jump = filter.lines().any(|l| l.trim_end() == jump);
    let mut out = String::new();
    let _ = writeln!(out, "*filter");
    let _ = writeln!(out, ":{WEIR_EBPF_CHAIN} - [0:0]");
    let _ = writeln!(
        out,
        "-A {WEIR_EBPF_CHAIN} -m mark --mark 0x0/{DEFER_MARK_MASK:#x} -j RETURN"
    );
    let _ = writeln!(
        out,
        "-A {WEIR_EBPF_CHAIN} -m bpf --object-pinned {} -m comment --comment \"weir: a pod's Service traffic to this node, judged as its egress\" -j DROP",
        program.display()
    );
    if !has_jump {
        let _ = writeln!(out, "-I INPUT 1 -j {WEIR_EBPF_CHAIN}");
    }
    let _ = writeln!(out, "COMMIT");
    out
}

/// Writes the chain and INPUT's jump into both families of `backend`'s filter table.
pub fn ensure(backend: Backend, program: &Path) -> Result<(), DataplaneError> {
    for family in Family::ALL {
        let what = format!("{WEIR_EBPF_CHAIN} ({family}, {backend:?})");
        let filter = backend
            .save_table(family, "filter")
            .map_err(|e| DataplaneError::tool(format!("read the filter table for {what}"), e))?;
        backend
            .restore(family, &script(&filter, program))
            .map_err(|e| DataplaneError::tool(format!("write {what}"), e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_jump_is_added_once_and_the_chain_rewritten_each_time() {
        let program = Path::new("/sys/fs/bpf/weir/progs/weir_deferred_to_node");
        let first = script("*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n", program);
        assert!(first.contains("-I INPUT 1 -j WEIRBPF-TO-NODE\n"), "{first}");
        assert!(first.contains(":WEIRBPF-TO-NODE - [0:0]\n"), "{first}");
        assert!(
            first.contains("-m mark --mark 0x0/0xfff80000 -j RETURN"),
            "{first}"
        );
        assert!(
            first.contains("-m bpf --object-pinned /sys/fs/bpf/weir/progs/weir_deferred_to_node"),
            "{first}"
        );
        let again = script(
            "*filter\n:INPUT ACCEPT [0:0]\n:WEIRBPF-TO-NODE - [0:0]\n-A INPUT -j WEIRBPF-TO-NODE\nCOMMIT\n",
            program,
        );
        assert!(!again.contains("-I INPUT"), "{again}");
        assert!(again.contains(":WEIRBPF-TO-NODE - [0:0]\n"), "{again}");
    }
}
