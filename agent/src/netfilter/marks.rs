//! The packet mark bits other agents' rules use, read from `iptables-save`, so that the
//! eBPF dataplane, which carries a Service client's identity in `skb->mark` bits
//! ([`weir_common::DEFER_MARK_ALL`]) from the pod's hook to the backend's, never shares a
//! bit with them: a rule of kube-proxy, Calico, Istio or any other that sets or matches
//! one of those bits would either overwrite the client's identity (a packet judged as
//! another pod's egress) or be misled by weir's bits. A collision keeps the node off eBPF
//! (it falls back to iptables, which uses no marks) and names the rule.
//!
//! What counts, in the forms `iptables-save` prints: `MARK --set-xmark V/M` (bits V|M),
//! `--set-mark V[/M]`, `-m mark --mark V[/M]` (M, or every bit without one), and
//! `CONNMARK --restore-mark` (`--nfmask`, or every bit: it overwrites the mark). The
//! caller says which chains not to count: weir's own, and those the start-up cleanup
//! removes anyway (Azure NPM's, whose `--set-mark 0x2000` overwrites every bit). Only
//! what `iptables-save` shows is read: rules in native nftables tables (kube-proxy's
//! nftables mode) are not.

use crate::netfilter::backend::{Backend, Family};

/// A rule that uses some of the bits asked about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkUse {
    pub family: Family,
    pub table: String,
    /// The rule as `iptables-save` prints it (`-A CHAIN ...`).
    pub rule: String,
    /// The bits it sets or matches that are also in the mask asked about.
    pub bits: u32,
}

impl std::fmt::Display for MarkUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} table {}: `{}` uses mark bits {:#010x}",
            self.family, self.table, self.rule, self.bits
        )
    }
}

/// `0x4000` or `16384`.
fn number(text: &str) -> Option<u32> {
    match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// `V/M` → (V, M); `V` → (V, all bits).
fn value_mask(text: &str) -> Option<(u32, u32)> {
    match text.split_once('/') {
        Some((v, m)) => Some((number(v)?, number(m)?)),
        None => Some((number(text)?, u32::MAX)),
    }
}

/// The mark bits one rule's specification sets or matches.
fn rule_bits(spec: &str) -> u32 {
    let words: Vec<&str> = spec.split_whitespace().collect();
    let mut bits = 0;
    let mut restores = false;
    let mut nfmask = None;
    for (i, w) in words.iter().enumerate() {
        let next = words.get(i + 1).copied().unwrap_or_default();
        match *w {
            "--set-xmark" => {
                if let Some((v, m)) = value_mask(next) {
                    bits |= v | m;
                }
            }
            "--set-mark" => {
                if let Some((_, m)) = value_mask(next) {
                    bits |= m;
                }
            }
            // `-m mark --mark`; connmark's `--mark` matches the connection's mark, not
            // the packet's.
            "--mark" if words[..i].ends_with(&["-m", "mark"]) => {
                if let Some((_, m)) = value_mask(next) {
                    bits |= m;
                }
            }
            "--restore-mark" => restores = true,
            "--nfmask" | "--mask" => nfmask = number(next),
            _ => {}
        }
    }
    if restores {
        bits |= nfmask.unwrap_or(u32::MAX);
    }
    bits
}

/// The rules of one `iptables-save` text that use any of `mask`, except in the chains
/// `skip` names.
pub fn uses(saved: &str, family: Family, mask: u32, skip: &dyn Fn(&str) -> bool) -> Vec<MarkUse> {
    let mut table = String::new();
    let mut out = Vec::new();
    for line in saved.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.trim().to_string();
            continue;
        }
        let Some(rule) = line.strip_prefix("-A ") else {
            continue;
        };
        if skip(rule.split_whitespace().next().unwrap_or_default()) {
            continue;
        }
        let bits = rule_bits(rule) & mask;
        if bits != 0 {
            out.push(MarkUse {
                family,
                table: table.clone(),
                rule: line.to_string(),
                bits,
            });
        }
    }
    out
}

/// Whether the eBPF dataplane's mark bits are free on this node (outside the chains
/// `skip` names): `Err` names the rules (at most three) that use them. A family whose
/// rules cannot be read is not in the way.
pub fn check_ebpf_bits(backend: Backend, skip: &dyn Fn(&str) -> bool) -> Result<(), MarkBitsTaken> {
    let ours = weir_common::DEFER_MARK_ALL;
    let found: Vec<MarkUse> = Family::ALL
        .iter()
        .filter_map(|f| backend.save(*f).ok().map(|s| uses(&s, *f, ours, skip)))
        .flatten()
        .collect();
    if found.is_empty() {
        return Ok(());
    }
    Err(MarkBitsTaken {
        bits: ours,
        uses: found,
    })
}

/// The eBPF dataplane's mark bits are used by other rules on this node.
#[derive(Debug, thiserror::Error)]
#[error(
    "packet mark bits {bits:#010x}, which the eBPF dataplane uses to carry a Service \
     client's identity, are used by {} rule(s) of another agent: {}{}",
    uses.len(),
    uses.iter().take(3).map(ToString::to_string).collect::<Vec<_>>().join("; "),
    if uses.len() > 3 { "; ..." } else { "" }
)]
pub struct MarkBitsTaken {
    pub bits: u32,
    /// Every rule that uses them (the text names the first three).
    pub uses: Vec<MarkUse>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weir_chain(chain: &str) -> bool {
        chain.starts_with(crate::netfilter::WEIR_CHAIN_PREFIX)
    }

    const SAVED: &str = "\
*mangle
:PREROUTING ACCEPT [0:0]
-A PREROUTING -j MARK --set-xmark 0x40000/0x40000
-A PREROUTING -m mark --mark 0x100000/0x100000 -j ACCEPT
-A PREROUTING -m connmark --mark 0x80000000/0x80000000 -j ACCEPT
-A WEIR-FILTER -m mark --mark 0x80000/0x80000 -j RETURN
COMMIT
*nat
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A ISTIO-OUTPUT -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
";

    #[test]
    fn rules_that_set_or_match_our_bits_are_named() {
        let found = uses(SAVED, Family::V4, weir_common::DEFER_MARK_ALL, &weir_chain);
        let rules: Vec<(&str, u32)> = found.iter().map(|u| (u.rule.as_str(), u.bits)).collect();
        assert_eq!(
            rules,
            [
                (
                    "-A PREROUTING -j MARK --set-xmark 0x40000/0x40000",
                    0x40000
                ),
                (
                    "-A PREROUTING -m mark --mark 0x100000/0x100000 -j ACCEPT",
                    0x100000
                ),
                (
                    "-A ISTIO-OUTPUT -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
                    weir_common::DEFER_MARK_ALL
                ),
            ]
        );
        assert_eq!(found[0].table, "mangle");
        assert_eq!(found[2].table, "nat");
    }

    #[test]
    fn kube_proxy_and_azure_npm_bits_are_not_ours() {
        // kube-proxy's masquerade and drop marks, Azure NPM's bits 12, 13 and 16.
        let saved = "*nat\n-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n\
                     -A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000\n\
                     *filter\n-A AZURE-NPM -m mark --mark 0x3000/0x3000 -j ACCEPT\n\
                     -A AZURE-NPM-EGRESS -j MARK --set-xmark 0x10000/0xffffffff\n";
        let found = uses(saved, Family::V4, weir_common::DEFER_MARK_ALL, &weir_chain);
        // The last sets the whole mark (`--set-mark`): that does overwrite ours, unless
        // its chain is one the caller skips (the cleanup removes Azure NPM's).
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].rule.contains("AZURE-NPM-EGRESS"));
        let npm_too = |c: &str| weir_chain(c) || c.starts_with("AZURE-NPM");
        assert_eq!(
            uses(saved, Family::V4, weir_common::DEFER_MARK_ALL, &npm_too),
            []
        );
    }
}
