//! The `iptables-restore --noflush` script for one family: in full (start-up and repair:
//! every weir chain rewritten, stale ones deleted, hook jumps ensured) or as the delta
//! between what was programmed and what is desired (only changed endpoint chains and
//! dispatch rules). Declaring a chain (`:CHAIN - [0:0]`) creates or flushes it, and each
//! table commits atomically, so no packet sees a half-written chain.

use std::collections::BTreeSet;
use std::fmt::Write;

use crate::netfilter::WEIR_CHAIN_PREFIX;
use crate::reset::iptables_save::{self, SaveParseError};
use weir_policy::desired::{Desired, Direction, Endpoint};

use super::names::SPOOF_CHAIN;
use super::names::{
    endpoint_chain, passed_chain, set_name, ChainNames, DISPATCH_CHAIN, FORMER_TABLE, FORWARD_HOOK,
    HOOKS, IPVS_HOOK, KNOWN_ENDPOINTS_SET, NEW_FROM_POD_CHAIN, NEW_TO_POD_CHAIN, TABLE,
    TO_NODE_CHAIN,
};
use super::rules::CONNTRACK_RULE;
use super::rules::{dispatch_rules, endpoint_rules, to_node_chain, to_node_rule};
use crate::dataplane::new_pods::NewPodIsolation;
use crate::netfilter::backend::Family;

const DIRECTIONS: [Direction; 2] = [Direction::Ingress, Direction::Egress];

/// What the node has that shapes the rules; a change asks for a full write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeShape {
    /// A bridge, whose ports the new-pod catch-all matches with physdev.
    pub bridged: bool,
    /// IPVS (kube-proxy's ipvs mode): what it forwards goes through [`IPVS_HOOK`].
    pub ipvs: bool,
    /// The kernel has NFLOG: drops and audit verdicts are logged ([`super::rules::log_rule`]).
    pub verdict_log: bool,
}

/// `saved` (the backend's current `iptables-save` for `family`) asks for a full
/// rewrite; without it, only the difference from `old` is written. `spoof`: the
/// anti-spoofing rules, when they changed (always given for a full rewrite). `None`:
/// nothing to do.
#[allow(clippy::too_many_arguments)]
pub fn script(
    names: &mut ChainNames,
    old: &Desired,
    new: &Desired,
    family: Family,
    saved: Option<&str>,
    new_pods: &NewPodIsolation,
    node: NodeShape,
    spoof: Option<&[String]>,
) -> Result<Option<String>, SaveParseError> {
    let mut body = String::new();
    let mut former = String::new();
    match saved {
        Some(saved) => {
            remove_former(saved, &mut former)?;
            full(
                names,
                new,
                family,
                saved,
                new_pods,
                node,
                spoof.unwrap_or(&[]),
                &mut body,
            )?
        }
        None => {
            if let Some(rules) = spoof {
                write_chain(&mut body, SPOOF_CHAIN, rules);
            }
            delta(names, old, new, family, node, &mut body)
        }
    }
    let mut script = String::new();
    if !body.is_empty() {
        script = format!("*{TABLE}\n{body}COMMIT\n");
    }
    // After the new table's commit: enforcement moves without a gap.
    if !former.is_empty() {
        script.push_str(&format!("*{FORMER_TABLE}\n{former}COMMIT\n"));
    }
    Ok((!script.is_empty()).then_some(script))
}

/// Removes weir's hook jumps and chains from the table an earlier release used.
fn remove_former(saved: &str, out: &mut String) -> Result<(), SaveParseError> {
    let tables = iptables_save::parse(saved)?;
    let Some(table) = tables.iter().find(|t| t.name == FORMER_TABLE) else {
        return Ok(());
    };
    for r in table
        .rules
        .iter()
        .filter(|r| r.chain == FORWARD_HOOK.chain && r.target.as_deref() == Some(DISPATCH_CHAIN))
    {
        let _ = writeln!(out, "-D {} {}", r.chain, r.spec);
    }
    let ours: Vec<&String> = table
        .chains
        .iter()
        .filter(|c| c.starts_with(WEIR_CHAIN_PREFIX))
        .collect();
    for chain in &ours {
        let _ = writeln!(out, "-F {chain}");
    }
    for chain in &ours {
        let _ = writeln!(out, "-X {chain}");
    }
    Ok(())
}

fn write_chain(out: &mut String, chain: &str, rules: &[String]) {
    let _ = writeln!(out, ":{chain} - [0:0]");
    for r in rules {
        let _ = writeln!(out, "-A {chain} {r}");
    }
}

/// The catch-all for pod interfaces whose endpoint is not programmed: traffic in from or
/// out to an interface with a pod-interface prefix, whose pod-side address is none of the
/// programmed endpoints' (the [`KNOWN_ENDPOINTS_SET`]), goes to a chain that RETURNs for
/// exempt interfaces and DROPs the rest. It does not depend on the order of the dispatch
/// rules: it only matches unknown addresses, they only known ones.
///
/// On a node with a bridge, pod interfaces are bridge ports: matched with physdev too
/// (`--physdev-out` only sees bridged packets, from pods on the same bridge), and
/// link-scope IPv6 (neighbour discovery between the bridge's pods) passes.
fn new_pod_rules(
    new_pods: &NewPodIsolation,
    family: Family,
    bridged: bool,
    out: &mut String,
) -> Vec<String> {
    let known = set_name(KNOWN_ENDPOINTS_SET, family);
    let mut dispatch = Vec::new();
    for prefix in &new_pods.prefixes {
        dispatch.push(format!(
            "-i {prefix}+ -m set ! --match-set {known} src -j {NEW_FROM_POD_CHAIN}"
        ));
        dispatch.push(format!(
            "-o {prefix}+ -m set ! --match-set {known} dst -j {NEW_TO_POD_CHAIN}"
        ));
        if bridged {
            dispatch.push(format!(
                "-m physdev --physdev-in {prefix}+ -m set ! --match-set {known} src \
                 -j {NEW_FROM_POD_CHAIN}"
            ));
            dispatch.push(format!(
                "-m physdev --physdev-out {prefix}+ --physdev-is-bridged \
                 -m set ! --match-set {known} dst -j {NEW_TO_POD_CHAIN}"
            ));
        }
    }
    let exempt = new_pods.exempt_iptables();
    let link_scope: &[&str] = match (bridged, family) {
        (true, Family::V6) => &[
            "-s fe80::/10 -d ff02::/16",
            "-s fe80::/10 -d fe80::/10",
            "-s ::/128 -d ff02::/16",
        ],
        _ => &[],
    };
    for (chain, side, physdev) in [
        (NEW_FROM_POD_CHAIN, "-i", "--physdev-in"),
        (NEW_TO_POD_CHAIN, "-o", "--physdev-out"),
    ] {
        let mut rules: Vec<String> = exempt
            .iter()
            .map(|e| format!("{side} {e} -m comment --comment \"exempt new pod\" -j RETURN"))
            .collect();
        if bridged {
            rules.extend(exempt.iter().map(|e| {
                format!(
                    "-m physdev {physdev} {e} -m comment --comment \"exempt new pod\" -j RETURN"
                )
            }));
        }
        rules.extend(
            link_scope.iter().map(|m| {
                format!("{m} -m comment --comment \"bridged link-scope traffic\" -j RETURN")
            }),
        );
        if bridged && family == Family::V6 && chain == NEW_TO_POD_CHAIN {
            // Neighbour solicitations of known pods go to solicited-node multicast.
            rules.push(
                "-d ff02::/16 -m comment --comment \"bridged link-scope traffic\" -j RETURN"
                    .to_string(),
            );
        }
        rules.push("-m comment --comment \"pod interface not programmed yet\" -j DROP".to_string());
        write_chain(out, chain, &rules);
    }
    dispatch
}

/// Pods on one bridge resolve each other with their own addresses (a solicited
/// advertisement is unicast, global to global); br_netfilter shows that to FORWARD. At
/// hop limit 255 it was bridged, not routed: outside NetworkPolicy, as on eBPF.
fn bridged_neighbour_discovery() -> Vec<String> {
    ["neighbour-solicitation", "neighbour-advertisement"]
        .iter()
        .map(|t| {
            format!(
                "-m physdev --physdev-is-bridged -p ipv6-icmp -m icmp6 --icmpv6-type {t} \
                 -m hl --hl-eq 255 -m comment --comment \"bridged neighbour discovery\" \
                 -j RETURN"
            )
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn full(
    names: &mut ChainNames,
    new: &Desired,
    family: Family,
    saved: &str,
    new_pods: &NewPodIsolation,
    node: NodeShape,
    spoof: &[String],
    out: &mut String,
) -> Result<(), SaveParseError> {
    let tables = iptables_save::parse(saved)?;
    let filter = tables.iter().find(|t| t.name == TABLE);
    let mut wanted = BTreeSet::from([
        DISPATCH_CHAIN.to_string(),
        SPOOF_CHAIN.to_string(),
        TO_NODE_CHAIN.to_string(),
    ]);
    // Anti-spoofing before anything else, the conntrack shortcut included.
    write_chain(out, SPOOF_CHAIN, spoof);
    let mut dispatch = dispatch_head(family, node.bridged);
    let mut to_pods = Vec::new();
    let mut to_node = Vec::new();
    for ep in new.endpoints.values() {
        let hash = names.hash_for(&ep.pod);
        to_node.extend(to_node_rule(ep, hash, family));
        for d in DIRECTIONS {
            if let Some(chains) = endpoint_rules(ep, d, family, hash, node.verdict_log) {
                // The passed chain first: the endpoint chain's `-g` names it.
                if let Some(passed) = &chains.passed {
                    let chain = passed_chain(hash, d);
                    write_chain(out, &chain, passed);
                    wanted.insert(chain);
                }
                let chain = endpoint_chain(hash, d);
                write_chain(out, &chain, &chains.main);
                wanted.insert(chain);
            }
        }
        for (direction, spec) in dispatch_rules(ep, hash, family) {
            match direction {
                Direction::Egress => dispatch.push(spec),
                Direction::Ingress => to_pods.push(spec),
            }
        }
    }
    dispatch.extend(to_pods);
    if new_pods.enabled() {
        dispatch.extend(new_pod_rules(new_pods, family, node.bridged, out));
        wanted.insert(NEW_FROM_POD_CHAIN.to_string());
        wanted.insert(NEW_TO_POD_CHAIN.to_string());
    }
    write_chain(out, DISPATCH_CHAIN, &dispatch);
    write_chain(out, TO_NODE_CHAIN, &to_node_chain(to_node, family));
    let existing = filter.map(|t| t.chains.as_slice()).unwrap_or_default();
    let stale: Vec<&String> = existing
        .iter()
        .filter(|c| c.starts_with(WEIR_CHAIN_PREFIX) && !wanted.contains(*c))
        .collect();
    for chain in &stale {
        let _ = writeln!(out, "-F {chain}");
    }
    for chain in &stale {
        let _ = writeln!(out, "-X {chain}");
    }
    for hook in HOOKS {
        let wanted = hook != IPVS_HOOK || node.ipvs;
        let rules: Vec<_> = filter
            .into_iter()
            .flat_map(|t| &t.rules)
            .filter(|r| r.chain == hook.chain)
            .collect();
        let is_jump = |r: &iptables_save::SavedRule| r.target.as_deref() == Some(hook.target);
        let jumps: Vec<_> = rules.iter().copied().filter(|r| is_jump(r)).collect();
        let first = rules
            .first()
            .is_some_and(|r| is_jump(r) && r.spec == hook.spec());
        // The jump must be the hook's first rule: kube-proxy or another agent inserting
        // ahead of it (an ACCEPT) would bypass every policy. Re-asserted at each resync,
        // in the same atomic commit: delete every jump but a first one, then insert.
        let keep = usize::from(first && wanted);
        for r in &jumps[keep..] {
            let _ = writeln!(out, "-D {} {}", hook.chain, r.spec);
        }
        if wanted && !first {
            let _ = writeln!(out, "-I {} 1 {}", hook.chain, hook.spec());
        }
    }
    Ok(())
}

/// The dispatch chain's first rules, before the endpoints' jumps: anti-spoofing (before
/// anything else, the conntrack shortcut included), the conntrack shortcut, and on a
/// bridge, IPv6 neighbour discovery.
fn dispatch_head(family: Family, bridged: bool) -> Vec<String> {
    let mut head = vec![format!("-j {SPOOF_CHAIN}"), CONNTRACK_RULE.to_string()];
    if bridged && family == Family::V6 {
        head.extend(bridged_neighbour_discovery());
    }
    head
}

/// Egress jumps go in right after the [`dispatch_head`], ingress jumps at the end, so every
/// egress jump stays ahead of every ingress one (see [`dispatch_rules`]).
fn delta(
    names: &mut ChainNames,
    old: &Desired,
    new: &Desired,
    family: Family,
    node: NodeShape,
    out: &mut String,
) {
    let log = node.verdict_log;
    let first_jump = dispatch_head(family, node.bridged).len() + 1;
    let mut removed_chains = Vec::new();
    let (mut old_dispatch, mut new_dispatch) = (BTreeSet::new(), BTreeSet::new());
    let (mut old_to_node, mut new_to_node) = (Vec::new(), Vec::new());
    let pods: BTreeSet<&String> = old.endpoints.keys().chain(new.endpoints.keys()).collect();
    for pod in pods {
        let hash = names.hash_for(pod);
        let (before, after) = (old.endpoints.get(pod), new.endpoints.get(pod));
        if let Some(ep) = before {
            old_dispatch.extend(dispatch_rules(ep, hash, family));
            old_to_node.extend(to_node_rule(ep, hash, family));
        }
        if let Some(ep) = after {
            new_dispatch.extend(dispatch_rules(ep, hash, family));
            new_to_node.extend(to_node_rule(ep, hash, family));
        }
        if before == after {
            continue;
        }
        for d in DIRECTIONS {
            let rules =
                |ep: Option<&Endpoint>| ep.and_then(|e| endpoint_rules(e, d, family, hash, log));
            let (was, is) = (rules(before), rules(after));
            let (main, passed) = (endpoint_chain(hash, d), passed_chain(hash, d));
            let (was_passed, is_passed) = (
                was.as_ref().and_then(|c| c.passed.as_ref()),
                is.as_ref().and_then(|c| c.passed.as_ref()),
            );
            // The passed chain before the endpoint chain that names it; removed after.
            match (was_passed, is_passed) {
                (was, Some(is)) if was != Some(is) => write_chain(out, &passed, is),
                (Some(_), None) => removed_chains.push(passed),
                _ => {}
            }
            match (was.map(|c| c.main), is.map(|c| c.main)) {
                (was, Some(is)) if was.as_ref() != Some(&is) => write_chain(out, &main, &is),
                (Some(_), None) => removed_chains.push(main),
                _ => {}
            }
        }
    }
    // After the endpoint chains it names are written, before any is removed.
    if old_to_node != new_to_node {
        let rules = to_node_chain(new_to_node, family);
        write_chain(out, TO_NODE_CHAIN, &rules);
    }
    for (direction, spec) in new_dispatch.difference(&old_dispatch) {
        let _ = match direction {
            Direction::Egress => writeln!(out, "-I {DISPATCH_CHAIN} {first_jump} {spec}"),
            Direction::Ingress => writeln!(out, "-A {DISPATCH_CHAIN} {spec}"),
        };
    }
    for (_, spec) in old_dispatch.difference(&new_dispatch) {
        let _ = writeln!(out, "-D {DISPATCH_CHAIN} {spec}");
    }
    for chain in &removed_chains {
        let _ = writeln!(out, "-F {chain}");
    }
    for chain in &removed_chains {
        let _ = writeln!(out, "-X {chain}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::desired::{DirectionPolicy, Peer, Ports, Rule, RuleOrigin};

    fn desired(pods: &[(&str, &str, bool)]) -> Desired {
        let mut d = Desired::default();
        for (pod, ip, isolated) in pods {
            let rules = BTreeSet::from([Rule {
                peer: Peer::Any,
                ports: Ports::All,
                origin: RuleOrigin {
                    policy: "x/p".into(),
                    rule_index: 0,
                },
            }]);
            d.endpoints.insert(
                pod.to_string(),
                Endpoint {
                    pod: pod.to_string(),
                    ipv4: Some(ip.parse().unwrap()),
                    ipv6: None,
                    ingress: DirectionPolicy {
                        isolated: *isolated,
                        rules,
                        ..DirectionPolicy::default()
                    },
                    egress: DirectionPolicy::default(),
                },
            );
        }
        d
    }

    #[test]
    fn full_script_keeps_one_hook_and_deletes_stale_chains() {
        let saved = "*mangle\n:FORWARD ACCEPT [0:0]\n:WEIR-FILTER - [0:0]\n:WEIR-I-dead - [0:0]\n\
                     -A FORWARD -j WEIR-FILTER\n-A FORWARD -j WEIR-FILTER\nCOMMIT\n";
        let mut names = ChainNames::default();
        let new = desired(&[("x/a", "10.0.0.1", true)]);
        let s = script(
            &mut names,
            &Desired::default(),
            &new,
            Family::V4,
            Some(saved),
            &NewPodIsolation::off(),
            NodeShape::default(),
            None,
        )
        .unwrap()
        .unwrap();
        assert!(!s.contains("-I FORWARD"));
        assert_eq!(s.matches("-D FORWARD -j WEIR-FILTER").count(), 1);
        assert!(s.contains("-F WEIR-I-dead\n") && s.contains("-X WEIR-I-dead\n"));
        assert!(s.contains("-A WEIR-FILTER -d 10.0.0.1/32 -j WEIR-I-"));
        // Anti-spoofing comes first, before the conntrack shortcut.
        let spoof = s.find("-A WEIR-FILTER -j WEIR-SPOOF").unwrap();
        let ct = s.find("-A WEIR-FILTER -m conntrack").unwrap();
        assert!(spoof < ct, "{s}");
        assert!(s.contains(":WEIR-SPOOF - [0:0]\n"));
        assert!(s.ends_with("COMMIT\n"));
    }

    #[test]
    fn a_rule_inserted_ahead_of_the_jump_puts_the_jump_back_first() {
        let saved = "*mangle\n:FORWARD ACCEPT [0:0]\n:WEIR-FILTER - [0:0]\n\
                     -A FORWARD -j ACCEPT\n-A FORWARD -j WEIR-FILTER\nCOMMIT\n";
        let mut names = ChainNames::default();
        let s = script(
            &mut names,
            &Desired::default(),
            &Desired::default(),
            Family::V4,
            Some(saved),
            &NewPodIsolation::off(),
            NodeShape::default(),
            None,
        )
        .unwrap()
        .unwrap();
        assert!(
            s.contains("-D FORWARD -j WEIR-FILTER\n-I FORWARD 1 -j WEIR-FILTER\n"),
            "{s}"
        );
        // Already first: nothing moves.
        let first = "*mangle\n:FORWARD ACCEPT [0:0]\n-A FORWARD -j WEIR-FILTER\n\
                     -A FORWARD -j ACCEPT\nCOMMIT\n";
        let s = script(
            &mut names,
            &Desired::default(),
            &Desired::default(),
            Family::V4,
            Some(first),
            &NewPodIsolation::off(),
            NodeShape::default(),
            None,
        )
        .unwrap()
        .unwrap();
        assert!(!s.contains("FORWARD"), "{s}");
    }

    #[test]
    fn the_ipvs_hook_follows_ipvs() {
        let mut names = ChainNames::default();
        let full = |names: &mut ChainNames, saved: &str, ipvs: bool| {
            let node = NodeShape {
                bridged: false,
                ipvs,
                ..NodeShape::default()
            };
            let (d, off) = (Desired::default(), NewPodIsolation::off());
            script(names, &d, &d, Family::V4, Some(saved), &off, node, None)
                .unwrap()
                .unwrap()
        };
        let bare = "*mangle\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";
        let s = full(&mut names, bare, true);
        assert!(
            s.contains("-I OUTPUT 1 -m ipvs --ipvs -j WEIR-FILTER\n"),
            "{s}"
        );
        assert!(s.contains("-I FORWARD 1 -j WEIR-FILTER\n"), "{s}");
        assert!(!full(&mut names, bare, false).contains("OUTPUT"));
        // In place and first: left alone; IPVS gone: removed.
        let hooked = "*mangle\n:OUTPUT ACCEPT [0:0]\n-A OUTPUT -m ipvs --ipvs -j WEIR-FILTER\n\
                      -A OUTPUT -j ACCEPT\nCOMMIT\n";
        assert!(!full(&mut names, hooked, true).contains("OUTPUT"));
        assert!(
            full(&mut names, hooked, false).contains("-D OUTPUT -m ipvs --ipvs -j WEIR-FILTER\n")
        );
        // A jump without the match would police the node's own traffic: replaced.
        let unmatched = "*mangle\n:OUTPUT ACCEPT [0:0]\n-A OUTPUT -j WEIR-FILTER\nCOMMIT\n";
        let s = full(&mut names, unmatched, true);
        assert!(
            s.contains("-D OUTPUT -j WEIR-FILTER\n-I OUTPUT 1 -m ipvs --ipvs -j WEIR-FILTER\n"),
            "{s}"
        );
    }

    #[test]
    fn delta_touches_only_what_changed() {
        let mut names = ChainNames::default();
        let old = desired(&[("x/a", "10.0.0.1", true), ("x/b", "10.0.0.2", true)]);
        assert_eq!(
            script(
                &mut names,
                &old,
                &old,
                Family::V4,
                None,
                &NewPodIsolation::off(),
                NodeShape::default(),
                None
            )
            .unwrap(),
            None
        );
        // b stops being isolated: its dispatch rule and chain go, a is untouched.
        let new = desired(&[("x/a", "10.0.0.1", true), ("x/b", "10.0.0.2", false)]);
        let s = script(
            &mut names,
            &old,
            &new,
            Family::V4,
            None,
            &NewPodIsolation::off(),
            NodeShape::default(),
            None,
        )
        .unwrap()
        .unwrap();
        let b_chain = endpoint_chain(names.hash_for("x/b"), Direction::Ingress);
        assert_eq!(
            s,
            format!(
                "*mangle\n-D WEIR-FILTER -d 10.0.0.2/32 -j {b_chain}\n-F {b_chain}\n\
                 -X {b_chain}\nCOMMIT\n"
            )
        );
    }

    #[test]
    fn egress_jumps_stay_ahead_of_ingress_jumps() {
        let egress = |d: &mut Desired, pod: &str| {
            let ep = d.endpoints.get_mut(pod).unwrap();
            ep.egress = ep.ingress.clone();
        };
        let mut old = desired(&[("x/a", "10.0.0.1", true), ("x/b", "10.0.0.2", true)]);
        egress(&mut old, "x/b");
        let mut names = ChainNames::default();
        let saved = "*mangle\n:FORWARD ACCEPT [0:0]\nCOMMIT\n";
        let off = NewPodIsolation::off();
        let full = script(
            &mut names,
            &Desired::default(),
            &old,
            Family::V4,
            Some(saved),
            &off,
            NodeShape::default(),
            None,
        )
        .unwrap()
        .unwrap();
        let jumps: Vec<&str> = full
            .lines()
            .filter(|l| l.starts_with("-A WEIR-FILTER -s") || l.starts_with("-A WEIR-FILTER -d"))
            .collect();
        // a's ingress sorts before b, yet b's egress comes first.
        assert!(
            jumps[0].starts_with("-A WEIR-FILTER -s 10.0.0.2/32"),
            "{full}"
        );
        assert_eq!(jumps.len(), 3, "{full}");
        // A pod that becomes egress-isolated later has its jump inserted after the head
        // (anti-spoofing and the conntrack shortcut), ahead of every ingress jump.
        let mut new = old.clone();
        egress(&mut new, "x/a");
        let s = script(
            &mut names,
            &old,
            &new,
            Family::V4,
            None,
            &off,
            NodeShape::default(),
            None,
        )
        .unwrap()
        .unwrap();
        let a_out = endpoint_chain(names.hash_for("x/a"), Direction::Egress);
        assert!(
            s.contains(&format!("-I WEIR-FILTER 3 -s 10.0.0.1/32 -j {a_out}\n")),
            "{s}"
        );
    }

    #[test]
    fn chains_an_earlier_release_left_in_filter_go_after_the_new_ones_are_in() {
        let saved = "*filter\n:FORWARD ACCEPT [0:0]\n:WEIR-FILTER - [0:0]\n:WEIR-I-old - [0:0]\n\
                     -A FORWARD -j WEIR-FILTER\n-A WEIR-FILTER -d 10.0.0.1/32 -j WEIR-I-old\n\
                     COMMIT\n*mangle\n:FORWARD ACCEPT [0:0]\nCOMMIT\n";
        let mut names = ChainNames::default();
        let new = desired(&[("x/a", "10.0.0.1", true)]);
        let s = script(
            &mut names,
            &Desired::default(),
            &new,
            Family::V4,
            Some(saved),
            &NewPodIsolation::off(),
            NodeShape::default(),
            None,
        )
        .unwrap()
        .unwrap();
        let mangle = s.find("*mangle\n").unwrap();
        let filter = s.find("*filter\n").unwrap();
        assert!(mangle < filter, "{s}");
        assert!(
            s[mangle..filter].contains("-I FORWARD 1 -j WEIR-FILTER\n"),
            "{s}"
        );
        let former = &s[filter..];
        assert!(former.contains("-D FORWARD -j WEIR-FILTER\n"), "{s}");
        assert!(former.contains("-F WEIR-I-old\n") && former.contains("-X WEIR-FILTER\n"));
    }
}
