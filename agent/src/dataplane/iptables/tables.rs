//! The `iptables-restore --noflush` script for one family: in full (start-up and repair:
//! every weir chain that differs from the kernel's rewritten, stale ones deleted, hook
//! jumps ensured) or as the delta between what was programmed and what is desired (only
//! changed endpoint chains, and the dispatch chain when a jump comes or goes). Declaring
//! a chain (`:CHAIN - [0:0]`) creates or flushes it, and each table commits atomically,
//! so no packet sees a half-written chain.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use crate::netfilter::WEIR_CHAIN_PREFIX;
use crate::reset::iptables_save::{self, SaveParseError, SavedTable};
use weir_policy::desired::{Desired, Direction, Endpoint};

use super::names::SPOOF_CHAIN;
use super::names::{
    endpoint_chain, passed_chain, set_name, ChainNames, DISPATCH_CHAIN, FORMER_TABLE, FORWARD_HOOK,
    HOOKS, IPVS_HOOK, KNOWN_ENDPOINTS_SET, NEW_FROM_POD_CHAIN, NEW_TO_POD_CHAIN, TABLE,
    TO_NODE_CHAIN,
};
use super::rules::conntrack_rules;
use super::rules::{
    dispatch_rules, endpoint_rules, pod_tunnel_rules, to_node_chain, to_node_rule, EndpointChains,
};
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
            let saved = iptables_save::parse(saved)?;
            remove_former(&saved, &mut former);
            let mut all = String::new();
            full(
                names,
                new,
                family,
                &saved,
                new_pods,
                node,
                spoof.unwrap_or(&[]),
                &mut all,
            );
            body = without_unchanged_chains(&all, &saved);
        }
        None => {
            if let Some(rules) = spoof {
                write_chain(&mut body, SPOOF_CHAIN, rules);
            }
            delta(names, old, new, family, node, new_pods, &mut body)
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
fn remove_former(tables: &[SavedTable], out: &mut String) {
    let Some(table) = tables.iter().find(|t| t.name == FORMER_TABLE) else {
        return;
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
}

/// `script` without the chains that `saved` already holds rule for rule: a full write
/// (start-up on an adopted node, the periodic repair) leaves what is right alone, so it
/// costs nothing when nothing drifted, and a chain left alone keeps its counters. A chain
/// whose rules `iptables-save` prints differently from how they were written is simply
/// written again.
fn without_unchanged_chains(script: &str, tables: &[SavedTable]) -> String {
    let Some(table) = tables.iter().find(|t| t.name == TABLE) else {
        return script.to_string();
    };
    let mut present: std::collections::BTreeMap<&str, Vec<&str>> = table
        .chains
        .iter()
        .map(|c| (c.as_str(), Vec::new()))
        .collect();
    for r in &table.rules {
        if let Some(rules) = present.get_mut(r.chain.as_str()) {
            rules.push(r.spec.as_str());
        }
    }
    let mut out = String::new();
    let mut lines = script.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(chain) = line
            .strip_prefix(':')
            .and_then(|d| d.strip_suffix(" - [0:0]"))
        else {
            let _ = writeln!(out, "{line}");
            continue;
        };
        let append = format!("-A {chain} ");
        let mut rules = Vec::new();
        while let Some(rule) = lines.peek().and_then(|l| l.strip_prefix(append.as_str())) {
            rules.push(rule);
            lines.next();
        }
        let differs = match present.get(chain) {
            None => Some(("(no such chain)".to_string(), String::new())),
            Some(saved) if saved.len() != rules.len() => Some((
                format!("{} rules", saved.len()),
                format!("{} rules", rules.len()),
            )),
            Some(saved) => saved
                .iter()
                .zip(&rules)
                .find(|(s, r)| **s != save_order(r))
                .map(|(s, r)| (s.to_string(), save_order(r).into_owned())),
        };
        let Some((kernel, written)) = differs else {
            continue;
        };
        tracing::debug!(
            chain,
            kernel,
            written,
            "chain differs from the kernel's: written again"
        );
        let _ = writeln!(out, "{line}");
        for rule in rules {
            let _ = writeln!(out, "{append}{rule}");
        }
    }
    out
}

/// `rule` with its address, interface and protocol options (`-s`, `-d`, `-i`, `-o`, `-p`,
/// each with its `!`) first and in that order, as `iptables-save` prints them wherever
/// they were written (they are the rule's IP header part, not matches). Everything else
/// keeps its order; a quoted value (a comment) is one token, and nothing from the target
/// (`-j`, `-g`) on is moved.
fn save_order(rule: &str) -> std::borrow::Cow<'_, str> {
    const ORDER: [&str; 5] = ["-s", "-d", "-i", "-o", "-p"];
    let mut tokens: Vec<String> = Vec::new();
    let mut quoted = false;
    for word in rule.split(' ') {
        match tokens.last_mut() {
            Some(last) if quoted => {
                last.push(' ');
                last.push_str(word);
            }
            _ => tokens.push(word.to_string()),
        }
        let escaped = word.matches("\\\"").count();
        if (word.matches('"').count() - escaped) % 2 == 1 {
            quoted = !quoted;
        }
    }
    let (mut header, mut rest) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < tokens.len() {
        if matches!(tokens[i].as_str(), "-j" | "-g") {
            rest.extend(tokens.drain(i..));
            break;
        }
        let at = i + usize::from(tokens[i] == "!");
        let rank = tokens
            .get(at)
            .and_then(|t| ORDER.iter().position(|o| o == t))
            .filter(|_| at + 1 < tokens.len());
        match rank {
            Some(rank) => {
                header.push((rank, tokens[i..at + 2].join(" ")));
                i = at + 2;
            }
            None => {
                rest.push(std::mem::take(&mut tokens[i]));
                i += 1;
            }
        }
    }
    header.sort_by_key(|(rank, _)| *rank);
    let ordered: Vec<String> = header
        .into_iter()
        .map(|(_, text)| text)
        .chain(rest)
        .collect();
    let ordered = ordered.join(" ");
    if ordered == rule {
        rule.into()
    } else {
        ordered.into()
    }
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
fn new_pod_dispatch(new_pods: &NewPodIsolation, family: Family, bridged: bool) -> Vec<String> {
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
    dispatch
}

/// The chains the [`new_pod_dispatch`] rules jump to.
fn new_pod_chains(new_pods: &NewPodIsolation, family: Family, bridged: bool, out: &mut String) {
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
}

/// The dispatch chain in full: its head, every egress jump, every ingress jump, then the
/// new-pod catch-all. Written whole whenever a jump comes or goes, so the kernel always
/// holds it in this order and a repair finds it unchanged.
fn dispatch_chain(
    names: &mut ChainNames,
    desired: &Desired,
    family: Family,
    node: NodeShape,
    new_pods: &NewPodIsolation,
) -> Vec<String> {
    let mut dispatch = dispatch_head(family, node.bridged);
    let mut to_pods = Vec::new();
    for ep in desired.endpoints.values() {
        let hash = names.hash_for(&ep.pod);
        for (direction, spec) in dispatch_rules(ep, hash, family) {
            match direction {
                Direction::Egress => dispatch.push(spec),
                Direction::Ingress => to_pods.push(spec),
            }
        }
    }
    dispatch.extend(to_pods);
    if new_pods.enabled() {
        dispatch.extend(new_pod_dispatch(new_pods, family, node.bridged));
    }
    dispatch
}

/// Pods on one bridge resolve each other with their own addresses (a solicited
/// advertisement is unicast, global to global); br_netfilter shows that to FORWARD. At
/// hop limit 255 it was bridged, not routed: outside NetworkPolicy, as on eBPF.
/// Written as `iptables-save` prints them back: the protocol first, types as numbers
/// (135 neighbour solicitation, 136 advertisement).
fn bridged_neighbour_discovery() -> Vec<String> {
    [135, 136]
        .iter()
        .map(|t| {
            format!(
                "-p ipv6-icmp -m physdev --physdev-is-bridged -m icmp6 --icmpv6-type {t} \
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
    tables: &[SavedTable],
    new_pods: &NewPodIsolation,
    node: NodeShape,
    spoof: &[String],
    out: &mut String,
) {
    let filter = tables.iter().find(|t| t.name == TABLE);
    let mut wanted = BTreeSet::from([
        DISPATCH_CHAIN.to_string(),
        SPOOF_CHAIN.to_string(),
        TO_NODE_CHAIN.to_string(),
    ]);
    // Anti-spoofing before anything else, the conntrack shortcut included.
    write_chain(out, SPOOF_CHAIN, spoof);
    let mut to_node = Vec::new();
    for ep in new.endpoints.values() {
        let hash = names.hash_for(&ep.pod);
        to_node.extend(to_node_rule(ep, hash, family));
        for d in DIRECTIONS {
            if let Some(chains) = endpoint_rules(ep, d, family, hash, node.verdict_log) {
                // The passed chain first: the endpoint chain's `-g` names it, and so do
                // the index chains', which come before the endpoint chain.
                if let Some(passed) = &chains.passed {
                    let chain = passed_chain(hash, d);
                    write_chain(out, &chain, passed);
                    wanted.insert(chain);
                }
                for (chain, rules) in &chains.index {
                    write_chain(out, chain, rules);
                    wanted.insert(chain.clone());
                }
                let chain = endpoint_chain(hash, d);
                write_chain(out, &chain, &chains.main);
                wanted.insert(chain);
            }
        }
    }
    if new_pods.enabled() {
        new_pod_chains(new_pods, family, node.bridged, out);
        wanted.insert(NEW_FROM_POD_CHAIN.to_string());
        wanted.insert(NEW_TO_POD_CHAIN.to_string());
    }
    let dispatch = dispatch_chain(names, new, family, node, new_pods);
    write_chain(out, DISPATCH_CHAIN, &dispatch);
    write_chain(
        out,
        TO_NODE_CHAIN,
        &to_node_rules(to_node, family, new_pods, node.bridged),
    );
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
}

/// [`TO_NODE_CHAIN`] whole: the pods' tunnels to the node dropped first, then
/// [`to_node_chain`].
fn to_node_rules(
    jumps: Vec<String>,
    family: Family,
    new_pods: &NewPodIsolation,
    bridged: bool,
) -> Vec<String> {
    let mut rules = pod_tunnel_rules(&new_pods.prefixes, bridged);
    rules.extend(to_node_chain(jumps, family));
    rules
}

/// The dispatch chain's first rules, before the endpoints' jumps: anti-spoofing (before
/// anything else, the conntrack shortcut included), the conntrack shortcut, and on a
/// bridge, IPv6 neighbour discovery.
fn dispatch_head(family: Family, bridged: bool) -> Vec<String> {
    let mut head = vec![format!("-j {SPOOF_CHAIN}")];
    head.extend(conntrack_rules(family));
    if bridged && family == Family::V6 {
        head.extend(bridged_neighbour_discovery());
    }
    head
}

/// When a dispatch jump comes or goes, the dispatch chain is written whole
/// ([`dispatch_chain`]): every egress jump stays ahead of every ingress one (see
/// [`dispatch_rules`]), in the order a full write would give.
fn delta(
    names: &mut ChainNames,
    old: &Desired,
    new: &Desired,
    family: Family,
    node: NodeShape,
    new_pods: &NewPodIsolation,
    out: &mut String,
) {
    let log = node.verdict_log;
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
            // The passed chain before the index and endpoint chains that name it; each
            // removed after.
            match (was_passed, is_passed) {
                (was, Some(is)) if was != Some(is) => write_chain(out, &passed, is),
                (Some(_), None) => removed_chains.push(passed),
                _ => {}
            }
            let index = |c: &Option<EndpointChains>| -> BTreeMap<String, Vec<String>> {
                c.as_ref()
                    .map(|c| c.index.iter().cloned().collect())
                    .unwrap_or_default()
            };
            let (was_index, is_index) = (index(&was), index(&is));
            // Children first, as `index` lists them.
            for (chain, rules) in is.iter().flat_map(|c| &c.index) {
                if was_index.get(chain) != Some(rules) {
                    write_chain(out, chain, rules);
                }
            }
            removed_chains.extend(
                was_index
                    .into_keys()
                    .filter(|chain| !is_index.contains_key(chain)),
            );
            match (was.map(|c| c.main), is.map(|c| c.main)) {
                (was, Some(is)) if was.as_ref() != Some(&is) => write_chain(out, &main, &is),
                (Some(_), None) => removed_chains.push(main),
                _ => {}
            }
        }
    }
    // After the endpoint chains it names are written, before any is removed.
    if old_to_node != new_to_node {
        let rules = to_node_rules(new_to_node, family, new_pods, node.bridged);
        write_chain(out, TO_NODE_CHAIN, &rules);
    }
    if old_dispatch != new_dispatch {
        let dispatch = dispatch_chain(names, new, family, node, new_pods);
        write_chain(out, DISPATCH_CHAIN, &dispatch);
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

    /// What `iptables-save` would print after `script` ran on a node with an empty mangle
    /// table: its declarations and rules, the hook jumps (`-I CHAIN 1 ...`) appended.
    fn as_saved(script: &str) -> String {
        let mut body = String::from("*mangle\n:FORWARD ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n");
        for line in script.lines().filter(|l| *l != "*mangle" && *l != "COMMIT") {
            match line.strip_prefix("-I ").and_then(|l| l.split_once(" 1 ")) {
                Some((chain, rule)) => body.push_str(&format!("-A {chain} {rule}\n")),
                None => body.push_str(&format!("{line}\n")),
            }
        }
        body + "COMMIT\n"
    }

    #[test]
    fn rules_compare_in_the_order_iptables_save_prints() {
        assert_eq!(
            save_order("-i lxc1 ! -s 10.0.0.1/32 -m comment --comment \"a -s b\" -j DROP"),
            "! -s 10.0.0.1/32 -i lxc1 -m comment --comment \"a -s b\" -j DROP"
        );
        assert_eq!(
            save_order("-o lxc+ -d 10.0.0.1/32 -j X"),
            "-d 10.0.0.1/32 -o lxc+ -j X"
        );
        let in_order = "-s 10.0.0.1/32 -p tcp -m tcp --dport 80 -j RETURN";
        assert!(matches!(save_order(in_order), std::borrow::Cow::Borrowed(r) if r == in_order));
        // After a match too: the header part is printed first all the same.
        assert_eq!(
            save_order(
                "-m physdev --physdev-in v ! -s 1.2.3.4/32 -m comment --comment \"x -d y\" -j DROP"
            ),
            "! -s 1.2.3.4/32 -m physdev --physdev-in v -m comment --comment \"x -d y\" -j DROP"
        );
        assert_eq!(
            save_order("-m physdev --physdev-is-bridged -s fe80::/10 -d ff02::/16 -j RETURN"),
            "-s fe80::/10 -d ff02::/16 -m physdev --physdev-is-bridged -j RETURN"
        );
        // The target's own options are never taken for the header's.
        let nflog = "-p tcp -j NFLOG --nflog-prefix \"-s x\"";
        assert_eq!(save_order(nflog), nflog);
    }

    #[test]
    fn a_full_write_leaves_alone_the_chains_already_right() {
        let mut names = ChainNames::default();
        let new = desired(&[("x/a", "10.0.0.1", true), ("x/b", "10.0.0.2", true)]);
        let full = |names: &mut ChainNames, saved: &str| {
            let off = NewPodIsolation::off();
            let node = NodeShape::default();
            script(
                names,
                &Desired::default(),
                &new,
                Family::V4,
                Some(saved),
                &off,
                node,
                None,
            )
            .unwrap()
        };
        let bare = "*mangle\n:FORWARD ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\nCOMMIT\n";
        let first = full(&mut names, bare).unwrap();
        let saved = as_saved(&first);
        // Nothing drifted: nothing to write.
        assert_eq!(full(&mut names, &saved), None, "{saved}");
        // One rule deleted by hand: that chain, and only it, is written again.
        let chain = saved
            .lines()
            .find_map(|l| l.strip_prefix(":WEIR-I-"))
            .map(|c| format!("WEIR-I-{}", c.trim_end_matches(" - [0:0]")))
            .expect("an ingress chain");
        let drifted: String = saved
            .lines()
            .filter(|l| !l.starts_with(&format!("-A {chain} ")))
            .map(|l| format!("{l}\n"))
            .collect();
        let repair = full(&mut names, &drifted).expect("a repair");
        let declared: Vec<&str> = repair.lines().filter(|l| l.starts_with(':')).collect();
        assert_eq!(declared, [format!(":{chain} - [0:0]")], "{repair}");
        let wanted: Vec<&str> = first
            .lines()
            .filter(|l| l.starts_with(&format!("-A {chain} ")))
            .collect();
        let written: Vec<&str> = repair.lines().filter(|l| l.starts_with("-A ")).collect();
        assert_eq!(written, wanted);
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
        let a_chain = endpoint_chain(names.hash_for("x/a"), Direction::Ingress);
        let [established, related] = conntrack_rules(Family::V4);
        assert_eq!(
            s,
            format!(
                "*mangle\n:WEIR-FILTER - [0:0]\n-A WEIR-FILTER -j WEIR-SPOOF\n\
                 -A WEIR-FILTER {established}\n-A WEIR-FILTER {related}\n\
                 -A WEIR-FILTER -d 10.0.0.1/32 -j {a_chain}\n\
                 -F {b_chain}\n-X {b_chain}\nCOMMIT\n"
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
        // A pod that becomes egress-isolated later has its jump after the head
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
        let dispatch: Vec<&str> = s
            .lines()
            .filter_map(|l| l.strip_prefix("-A WEIR-FILTER "))
            .collect();
        let at = |spec: &str| dispatch.iter().position(|r| r.starts_with(spec));
        let a = at(&format!("-s 10.0.0.1/32 -j {a_out}")).expect("a's egress jump");
        assert!(at("-m conntrack") < Some(a), "{s}");
        assert!(Some(a) < at("-d "), "{s}");
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
