//! The iptables dataplane's verdict counts, read from its own rules' counters
//! (`iptables-save -c`): each allow rule carries its policy and rule in its comment, each
//! endpoint chain ends in a default-deny DROP, and WEIR-SPOOF's DROPs are anti-spoofing.
//! A direction only audit-mode policies isolate ends in an audit rule instead, a RETURN
//! whose comment names those policies. A ClusterNetworkPolicy rule's comment names its
//! policy and action: an Accept's packets are allowed by it, a Deny's are denied (as on
//! eBPF, where a Pass counts nothing).

use std::collections::BTreeSet;

use super::names::chain_direction;
use super::names::SPOOF_CHAIN;
use super::rules::{comment_origin, tier_comment_origin};
use crate::dataplane::{VerdictCounts, DROP_SPOOFED};
use crate::reset::iptables_save::SavedTable;
use weir_policy::desired::Action;

/// Adds the counters of weir's rules in `tables` (one family's saved table) to `counts`.
pub fn add(tables: &[SavedTable], counts: &mut VerdictCounts) {
    add_chains(tables, |_| true, counts);
}

/// The chains a restore script makes again (`:CHAIN`), flushes or deletes: their rules'
/// counters start from zero, or go, once it runs.
pub fn rewritten_chains(script: &str) -> BTreeSet<&str> {
    script
        .lines()
        .filter_map(|l| {
            l.strip_prefix(':')
                .and_then(|c| c.split_whitespace().next())
                .or_else(|| l.strip_prefix("-F ").or_else(|| l.strip_prefix("-X ")))
        })
        .map(str::trim)
        .collect()
}

/// [`add`], for the rules of the chains `chosen` picks.
pub fn add_chains(
    tables: &[SavedTable],
    chosen: impl Fn(&str) -> bool,
    counts: &mut VerdictCounts,
) {
    for rule in tables
        .iter()
        .flat_map(|t| &t.rules)
        .filter(|r| chosen(&r.chain))
    {
        let Some(packets) = rule.packets else {
            continue;
        };
        if rule.chain == SPOOF_CHAIN {
            if rule.target.as_deref() == Some("DROP") {
                *counts.drops.entry(DROP_SPOOFED).or_default() += packets;
            }
            continue;
        }
        let (Some(direction), Some(comment)) = (chain_direction(&rule.chain), &rule.comment) else {
            continue;
        };
        if let Some((policy, action)) = tier_comment_origin(comment) {
            match action {
                Action::Accept => counts.add_rule(policy, false, direction, packets),
                Action::Deny => *counts.denied.entry(direction).or_default() += packets,
                Action::Pass => {}
            }
            continue;
        }
        match rule.target.as_deref() {
            Some("DROP") if comment.ends_with(" default deny") => {
                *counts.denied.entry(direction).or_default() += packets;
            }
            Some("RETURN") => {
                if let Some((policy, audit)) = comment_origin(comment) {
                    counts.add_rule(policy, audit, direction, packets);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reset::iptables_save::parse;
    use weir_policy::desired::Direction;

    #[test]
    fn allows_denies_and_spoofing_drops_are_counted_per_policy_and_direction() {
        let saved = "*mangle\n:WEIR-I-00000000000000ab - [0:0]\n\
            [3:180] -A WEIR-SPOOF -i lxca ! -s 10.0.0.2/32 -m comment --comment \"x/a anti-spoofing\" -j DROP\n\
            [9:540] -A WEIR-FILTER -s 10.0.0.2/32 -j WEIR-E-00000000000000ab\n\
            [7:420] -A WEIR-I-00000000000000ab -p tcp --dport 80 -m comment --comment \"x/allow rule 0\" -j RETURN\n\
            [2:120] -A WEIR-I-00000000000000ab -m comment --comment \"x/allow rule 1\" -j RETURN\n\
            [12:720] -A WEIR-I-00000000000000ab -m comment --comment \"x/a Ingress default deny\" -j DROP\n\
            [5:300] -A WEIR-E-00000000000000ab -m comment --comment \"y/out rule 0\" -j RETURN\n\
            [1:60] -A WEIR-E-00000000000000ab -m comment --comment \"x/a Egress default deny\" -j DROP\n\
            [8:480] -A WEIR-E-00000000000000cd -m comment --comment \"x/try,y/try audit\" -j RETURN\n\
            [4:240] -A KUBE-FORWARD -m comment --comment \"kube rule 1\" -j RETURN\n\
            COMMIT\n";
        let mut counts = VerdictCounts::default();
        add(&parse(saved).unwrap(), &mut counts);
        // The other family's table adds to the same counts.
        add(&parse(saved).unwrap(), &mut counts);
        assert_eq!(
            counts.allowed,
            [
                (("x/allow".to_string(), Direction::Ingress), 18),
                (("y/out".to_string(), Direction::Egress), 10),
            ]
            .into()
        );
        assert_eq!(
            counts.denied,
            [(Direction::Ingress, 24), (Direction::Egress, 2)].into()
        );
        assert_eq!(counts.drops, [(DROP_SPOOFED, 6)].into());
        assert_eq!(
            counts.audited,
            [
                (("x/try".to_string(), Direction::Egress), 16),
                (("y/try".to_string(), Direction::Egress), 16),
            ]
            .into()
        );
    }

    #[test]
    fn only_the_chains_a_script_makes_again_or_removes_are_carried() {
        let script = "*mangle\n:WEIR-I-00000000000000ab - [0:0]\n\
            -A WEIR-I-00000000000000ab -m comment --comment \"x/allow rule 0\" -j RETURN\n\
            -F WEIR-E-00000000000000cd\n-X WEIR-E-00000000000000cd\nCOMMIT\n";
        let rewritten = rewritten_chains(script);
        assert_eq!(
            rewritten,
            ["WEIR-E-00000000000000cd", "WEIR-I-00000000000000ab"].into()
        );
        let saved = "*mangle\n\
            [7:420] -A WEIR-I-00000000000000ab -m comment --comment \"x/allow rule 0\" -j RETURN\n\
            [5:300] -A WEIR-E-00000000000000ab -m comment --comment \"y/out rule 0\" -j RETURN\n\
            [8:480] -A WEIR-E-00000000000000cd -m comment --comment \"x/try audit\" -j RETURN\n\
            COMMIT\n";
        let mut carried = VerdictCounts::default();
        add_chains(
            &parse(saved).unwrap(),
            |c| rewritten.contains(c),
            &mut carried,
        );
        assert_eq!(
            carried.allowed,
            [(("x/allow".to_string(), Direction::Ingress), 7)].into()
        );
        assert_eq!(
            carried.audited,
            [(("x/try".to_string(), Direction::Egress), 8)].into()
        );
    }
}
