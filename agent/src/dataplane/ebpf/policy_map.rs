//! POLICY trie entries of one endpoint: {endpoint, identity, direction, protocol, port}
//! → rule id. "Any peer" is identity [`IDENTITY_ANY`] (the program looks it up second);
//! "all protocols" and "all ports" are shorter prefixes; a port range becomes at most 30
//! aligned prefixes (1–65535 is 16), never one entry per port.
//!
//! A direction that ClusterNetworkPolicy tiers judge is encoded differently
//! ([`tiered_entries`]): the agent evaluates the tiers and the NetworkPolicies for each
//! identity the rules name (and for [`IDENTITY_ANY`], the rest), and writes the outcome at
//! every point of the (protocol, port) space, allows as rule ids and drops with
//! [`TIER_DENY_BIT`]. The program still makes one or two lookups, however many policies
//! and tiers there are. A tiered egress direction also gets a table for each of the node's
//! addresses' identities: the tiers judge a pod's traffic to its node, the
//! NetworkPolicies never stop it.

use std::collections::{BTreeMap, BTreeSet};

use itertools::{EitherOrBoth, Itertools};
use serde::{Deserialize, Serialize};
use weir_common::{
    PolicyKey, AUDIT_RULE_BIT, COUNTER_HOST, COUNTER_NOT_ISOLATED, IDENTITY_ANY, IDENTITY_HOST_BIT,
    POLICY_PREFIX_ANY_PORT, POLICY_PREFIX_ANY_PROTOCOL, RULE_ID_FIRST, TIER_DENY_BIT,
};

use weir_policy::desired::{
    Action, Direction, DirectionPolicy, Endpoint, Peer, Ports, Protocol, Rule, RuleOrigin, SetId,
    Tier, TierRule,
};

/// A POLICY trie key with its prefix length (bits).
pub type PolicyEntry = (u32, PolicyKey);

/// What a rule id stands for; also the name `weir monitor` prints.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RuleName {
    pub policy: String,
    pub direction: Direction,
    pub rule_index: u32,
    /// A ClusterNetworkPolicy's rule: its tier (`policy` is then the policy's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<Tier>,
    /// A ClusterNetworkPolicy rule's action: what its counter counts (a Deny's drops).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
}

impl RuleName {
    pub fn is_audit(&self) -> bool {
        self.rule_index == RuleOrigin::AUDIT
    }
}

impl std::fmt::Display for RuleName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dir = self.direction.name();
        if let Some(tier) = self.tier {
            let action = self.action.map(|a| format!(" ({a})")).unwrap_or_default();
            return write!(
                f,
                "{tier} tier clusternetworkpolicy {} {dir} rule {}{action}",
                self.policy, self.rule_index
            );
        }
        if self.is_audit() {
            return write!(f, "{} {dir} audit: would be dropped", self.policy);
        }
        write!(f, "{} {dir} rule {}", self.policy, self.rule_index)
    }
}

/// A [`RuleName`] borrowed from the desired state: what a change's rule ids are planned
/// and looked up by, so that planning them builds no strings (every rule of every
/// endpoint, at every change). Its order is [`RuleName`]'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RuleKey<'a> {
    pub policy: &'a str,
    pub direction: Direction,
    pub rule_index: u32,
    pub tier: Option<Tier>,
    pub action: Option<Action>,
}

impl RuleKey<'_> {
    fn to_name(self) -> RuleName {
        RuleName {
            policy: self.policy.to_owned(),
            direction: self.direction,
            rule_index: self.rule_index,
            tier: self.tier,
            action: self.action,
        }
    }
}

impl RuleName {
    fn key(&self) -> RuleKey<'_> {
        RuleKey {
            policy: &self.policy,
            direction: self.direction,
            rule_index: self.rule_index,
            tier: self.tier,
            action: self.action,
        }
    }
}

/// Rule id allocation, stable across changes and restarts (persisted in records).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleTable {
    pub by_id: BTreeMap<u32, RuleName>,
}

impl RuleTable {
    /// Ids for every rule of `endpoints`; names no longer used are released.
    pub fn plan<'a>(
        &mut self,
        endpoints: impl IntoIterator<Item = &'a Endpoint>,
    ) -> BTreeMap<RuleKey<'a>, u32> {
        let wanted: BTreeSet<RuleKey<'a>> = endpoints
            .into_iter()
            .flat_map(|ep| {
                [Direction::Ingress, Direction::Egress]
                    .into_iter()
                    .flat_map(move |d| {
                        let p = ep.direction(d);
                        let tiered = [Tier::Admin, Tier::Baseline]
                            .into_iter()
                            .flat_map(move |t| {
                                p.tier(t).iter().map(move |r| tier_rule_key(d, t, r))
                            });
                        p.rules.iter().map(move |r| key(d, r)).chain(tiered)
                    })
            })
            .collect();
        // The ids held now, by key, merged with the keys wanted: kept, released or new.
        let mut held: Vec<(RuleKey<'_>, u32)> =
            self.by_id.iter().map(|(id, n)| (n.key(), *id)).collect();
        held.sort_unstable();
        let mut by_key: BTreeMap<RuleKey<'a>, u32> = BTreeMap::new();
        let (mut released, mut new) = (Vec::new(), Vec::new());
        for pair in wanted.into_iter().merge_join_by(held, |w, (h, _)| w.cmp(h)) {
            match pair {
                EitherOrBoth::Both(k, (_, id)) => {
                    by_key.insert(k, id);
                }
                EitherOrBoth::Left(k) => new.push(k),
                EitherOrBoth::Right((_, id)) => released.push(id),
            }
        }
        for id in released {
            self.by_id.remove(&id);
        }
        let mut next = RULE_ID_FIRST;
        for k in new {
            while self.by_id.contains_key(&next) {
                next += 1;
            }
            self.by_id.insert(next, k.to_name());
            by_key.insert(k, next);
        }
        by_key
    }
}

/// The key of a NetworkPolicy rule of direction `direction`.
pub fn key(direction: Direction, rule: &Rule) -> RuleKey<'_> {
    RuleKey {
        policy: &rule.origin.policy,
        direction,
        rule_index: rule.origin.rule_index,
        tier: None,
        action: None,
    }
}

/// The key of a ClusterNetworkPolicy rule of `tier` and direction `direction`.
pub fn tier_rule_key(direction: Direction, tier: Tier, rule: &TierRule) -> RuleKey<'_> {
    RuleKey {
        policy: &rule.origin.policy,
        direction,
        rule_index: rule.origin.rule_index,
        tier: Some(tier),
        action: Some(rule.action),
    }
}

pub fn kernel_direction(d: Direction) -> weir_common::Direction {
    match d {
        Direction::Ingress => weir_common::Direction::Ingress,
        Direction::Egress => weir_common::Direction::Egress,
    }
}

pub fn direction_code(d: Direction) -> u8 {
    kernel_direction(d) as u8
}

/// The key of `identity` at the endpoint's `d`, protocol and port 0 (a prefix of
/// [`POLICY_PREFIX_ANY_PROTOCOL`] bits matches every protocol).
fn base_key(endpoint_id: u32, identity: u32, d: Direction) -> PolicyKey {
    PolicyKey {
        endpoint_id,
        identity,
        direction: direction_code(d),
        protocol: 0,
        port: [0; 2],
    }
}

/// Splits `first..=last` into aligned (value, prefix bits) blocks, largest first.
pub fn port_prefixes(first: u16, last: u16) -> Vec<(u16, u32)> {
    let mut out = Vec::new();
    let (mut lo, hi) = (u32::from(first), u32::from(last));
    while lo <= hi {
        // Largest block that starts at lo (alignment) and stays within hi.
        let mut size = if lo == 0 {
            1 << 16
        } else {
            1u32 << lo.trailing_zeros()
        };
        while lo + size - 1 > hi {
            size >>= 1;
        }
        out.push((lo as u16, 16 - size.trailing_zeros()));
        lo += size;
    }
    out
}

/// Adds the entries of `ep` (endpoint id `endpoint_id`) to `out`. A key produced by two
/// rules keeps the lower rule id, so the result does not depend on iteration order.
/// `host_identities`: the IDENTITY values of the node's addresses, which a tiered egress
/// direction judges too.
pub fn endpoint_entries(
    endpoint_id: u32,
    ep: &Endpoint,
    identities_of_set: &BTreeMap<SetId, Vec<u32>>,
    host_identities: &BTreeSet<u32>,
    rule_ids: &BTreeMap<RuleKey<'_>, u32>,
    out: &mut BTreeMap<PolicyEntry, u32>,
) {
    for d in [Direction::Ingress, Direction::Egress] {
        let policy = ep.direction(d);
        if policy.is_tiered() {
            let hosts = match d {
                Direction::Egress => host_identities,
                Direction::Ingress => &BTreeSet::new(),
            };
            let of = Identities {
                of_set: identities_of_set,
                hosts,
            };
            tiered_entries(endpoint_id, d, policy, of, rule_ids, out);
            continue;
        }
        if !policy.isolated {
            continue;
        }
        for rule in &policy.rules {
            let rule_id = np_rule_value(d, rule, rule_ids);
            let identities: &[u32] = match rule.peer {
                Peer::Any => &[IDENTITY_ANY],
                Peer::Set(id) => identities_of_set.get(&id).map_or(&[], Vec::as_slice),
            };
            for &identity in identities {
                let base = base_key(endpoint_id, identity, d);
                let mut put = |prefix: u32, key: PolicyKey| {
                    let v = out.entry((prefix, key)).or_insert(rule_id);
                    *v = (*v).min(rule_id);
                };
                match rule.ports {
                    Ports::All => put(POLICY_PREFIX_ANY_PROTOCOL, base),
                    Ports::Protocol { protocol, range } => {
                        let key = PolicyKey {
                            protocol: protocol.number(),
                            ..base
                        };
                        match range {
                            None => put(POLICY_PREFIX_ANY_PORT, key),
                            Some(r) => {
                                for (port, bits) in port_prefixes(r.first, r.last) {
                                    let port = PolicyKey {
                                        port: port.to_be_bytes(),
                                        ..key
                                    };
                                    put(POLICY_PREFIX_ANY_PORT + bits, port);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A NetworkPolicy rule's POLICY value: its id, with [`AUDIT_RULE_BIT`] for the audit rule
/// (higher than any rule id, so a real rule with the same key wins the tie).
fn np_rule_value(d: Direction, rule: &Rule, rule_ids: &BTreeMap<RuleKey<'_>, u32>) -> u32 {
    match rule_ids[&key(d, rule)] {
        id if rule.origin.is_audit() => id | AUDIT_RULE_BIT,
        id => id,
    }
}

/// What a tiered direction decides for traffic with a peer of one identity, at a
/// protocol (`None`: one that is not TCP, UDP or SCTP, which only all-protocol rules
/// match) and destination port: a POLICY value.
struct TieredDirection<'a> {
    d: Direction,
    policy: &'a DirectionPolicy,
    rule_ids: &'a BTreeMap<RuleKey<'a>, u32>,
}

/// Whom a table of decisions is for: a peer of some identity, or the node itself, which
/// the NetworkPolicies always admit (weir_policy::verdict::egress_to_node).
#[derive(Clone, Copy, PartialEq, Eq)]
enum PeerKind {
    Peer,
    Node,
}

/// The three steps of a tiered direction's evaluation, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    Admin,
    NetworkPolicy,
    Baseline,
}

/// A rule that matches the peer: its step, its rank there (the lowest active rank of a
/// step decides: a tier rule's position, a NetworkPolicy rule's value), where it applies,
/// and what it decides (`None`: a Pass, which skips the rest of its tier).
struct Candidate {
    step: Step,
    rank: u32,
    ports: Ports,
    value: Option<u32>,
}

/// The rules in force over one piece of the port space: (step, rank) → how many active
/// rules have that key, and their decision.
type Active = BTreeMap<(Step, u32), (usize, Option<u32>)>;

impl TieredDirection<'_> {
    /// The direction's rules that match a peer `peer_in` admits.
    fn candidates(&self, peer_in: &dyn Fn(Peer) -> bool) -> Vec<Candidate> {
        let mut out = Vec::new();
        for (step, tier) in [(Step::Admin, Tier::Admin), (Step::Baseline, Tier::Baseline)] {
            for (rank, rule) in self.policy.tier(tier).iter().enumerate() {
                if !peer_in(rule.peer) {
                    continue;
                }
                let id = self.rule_ids[&tier_rule_key(self.d, tier, rule)];
                let value = match rule.action {
                    Action::Accept => Some(id),
                    Action::Deny => Some(id | TIER_DENY_BIT),
                    Action::Pass => None,
                };
                out.push(Candidate {
                    step,
                    rank: rank as u32,
                    ports: rule.ports,
                    value,
                });
            }
        }
        if self.policy.isolated {
            for rule in self.policy.rules.iter().filter(|r| peer_in(r.peer)) {
                let value = np_rule_value(self.d, rule, self.rule_ids);
                out.push(Candidate {
                    step: Step::NetworkPolicy,
                    rank: value,
                    ports: rule.ports,
                    value: Some(value),
                });
            }
        }
        out
    }

    /// The POLICY value where the `active` rules apply: Admin, then the NetworkPolicies
    /// (when they isolate), then Baseline, then allowed.
    fn decide(&self, active: &Active, kind: PeerKind) -> u32 {
        let first = |step: Step| {
            active
                .range((step, 0)..=(step, u32::MAX))
                .next()
                .map(|(_, (_, value))| *value)
        };
        if let Some(Some(v)) = first(Step::Admin) {
            return v;
        }
        if self.policy.isolated {
            return match kind {
                PeerKind::Node => COUNTER_HOST,
                // The NetworkPolicies' default deny when none matches.
                PeerKind::Peer => first(Step::NetworkPolicy)
                    .flatten()
                    .unwrap_or(TIER_DENY_BIT),
            };
        }
        if let Some(Some(v)) = first(Step::Baseline) {
            return v;
        }
        // Allowed by default: counted as a direction no policy isolates, or as the node's.
        match kind {
            PeerKind::Peer => COUNTER_NOT_ISOLATED,
            PeerKind::Node => COUNTER_HOST,
        }
    }

    fn rules(&self) -> impl Iterator<Item = Peer> + '_ {
        let np = self
            .policy
            .rules
            .iter()
            .filter(|_| self.policy.isolated)
            .map(|r| r.peer);
        let tiers = self.policy.admin.iter().chain(&self.policy.baseline);
        np.chain(tiers.map(|r| r.peer))
    }
}

/// The identities a tiered direction's entries are for.
#[derive(Clone, Copy)]
struct Identities<'a> {
    /// Each set's identities, ascending.
    of_set: &'a BTreeMap<SetId, Vec<u32>>,
    /// The node's addresses' (IDENTITY_HOST_BIT with the identity whose sets they are in).
    hosts: &'a BTreeSet<u32>,
}

/// The entries of a tiered direction: per identity its rules name (and
/// [`IDENTITY_ANY`]), and per host identity of `of.hosts`, the decision over the whole
/// (protocol, port) space: one all-protocol entry, and per protocol an all-port entry and
/// port ranges where they differ.
fn tiered_entries(
    endpoint_id: u32,
    d: Direction,
    policy: &DirectionPolicy,
    of: Identities,
    rule_ids: &BTreeMap<RuleKey<'_>, u32>,
    out: &mut BTreeMap<PolicyEntry, u32>,
) {
    let tiered = TieredDirection {
        d,
        policy,
        rule_ids,
    };
    let of_set = |set: SetId| of.of_set.get(&set).map_or(&[][..], Vec::as_slice);
    let mut identities: BTreeSet<u32> = tiered
        .rules()
        .filter_map(|peer| match peer {
            Peer::Set(id) => Some(id),
            Peer::Any => None,
        })
        .flat_map(|set| of_set(set).iter().copied())
        .collect();
    identities.insert(IDENTITY_ANY);
    // An identity whose decisions are the any-peer identity's needs no entries: its own
    // lookup misses, and the program looks up IDENTITY_ANY.
    let any = decisions(&tiered, &|peer| peer == Peer::Any, PeerKind::Peer);
    for identity in identities {
        let peer_in = |peer: Peer| match peer {
            Peer::Any => true,
            Peer::Set(set) => {
                identity != IDENTITY_ANY && of_set(set).binary_search(&identity).is_ok()
            }
        };
        let table = match identity {
            IDENTITY_ANY => any.clone(),
            _ => decisions(&tiered, &peer_in, PeerKind::Peer),
        };
        if identity != IDENTITY_ANY && table == any {
            continue;
        }
        table.encode(base_key(endpoint_id, identity, d), out);
    }
    // Every host identity gets its table: the programs look the node up without falling
    // back to the any-peer entries.
    for &host in of.hosts {
        let peer_in = |peer: Peer| match peer {
            Peer::Any => true,
            Peer::Set(set) => {
                host & IDENTITY_HOST_BIT != 0
                    && of_set(set)
                        .binary_search(&(host & !IDENTITY_HOST_BIT))
                        .is_ok()
            }
        };
        decisions(&tiered, &peer_in, PeerKind::Node).encode(base_key(endpoint_id, host, d), out);
    }
}

/// Ports `first..=last` and the POLICY value there.
type Piece = (u16, u16, u32);

/// One identity's decisions: for protocols other than TCP, UDP and SCTP, and per
/// protocol as port pieces, neighbours with equal values merged.
#[derive(Clone, PartialEq, Eq)]
struct Decisions {
    other: u32,
    by_protocol: Vec<(Protocol, Vec<Piece>)>,
}

/// The decisions for a peer `peer_in` admits: a sweep over each protocol's ports, where
/// the rules that match the peer start and end, so its cost grows with those rules only.
fn decisions(
    tiered: &TieredDirection,
    peer_in: &dyn Fn(Peer) -> bool,
    kind: PeerKind,
) -> Decisions {
    let candidates = tiered.candidates(peer_in);
    let activate = |active: &mut Active, c: &Candidate| {
        active.entry((c.step, c.rank)).or_insert((0, c.value)).0 += 1;
    };
    let mut all_protocols = Active::new();
    for c in candidates.iter().filter(|c| c.ports == Ports::All) {
        activate(&mut all_protocols, c);
    }
    let by_protocol = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
        .into_iter()
        .map(|protocol| {
            // Port → the candidates that start there, and those that end just before.
            let mut events: BTreeMap<u16, (Vec<usize>, Vec<usize>)> = BTreeMap::new();
            events.entry(0).or_default();
            for (i, c) in candidates.iter().enumerate() {
                let (first, last) = match c.ports {
                    Ports::All => (0, u16::MAX),
                    Ports::Protocol { protocol: p, range } if p == protocol => {
                        range.map_or((0, u16::MAX), |r| (r.first, r.last))
                    }
                    Ports::Protocol { .. } => continue,
                };
                events.entry(first).or_default().0.push(i);
                if let Some(next) = last.checked_add(1) {
                    events.entry(next).or_default().1.push(i);
                }
            }
            let mut active = Active::new();
            let mut pieces: Vec<Piece> = Vec::new();
            let points: Vec<u16> = events.keys().copied().collect();
            for (n, (&first, (starts, ends))) in events.iter().enumerate() {
                for &i in ends {
                    let c = &candidates[i];
                    if let Some(e) = active.get_mut(&(c.step, c.rank)) {
                        e.0 -= 1;
                        if e.0 == 0 {
                            active.remove(&(c.step, c.rank));
                        }
                    }
                }
                for &i in starts {
                    activate(&mut active, &candidates[i]);
                }
                let last = points.get(n + 1).map_or(u16::MAX, |next| next - 1);
                let value = tiered.decide(&active, kind);
                match pieces.last_mut() {
                    Some(p) if p.2 == value => p.1 = last,
                    _ => pieces.push((first, last, value)),
                }
            }
            (protocol, pieces)
        })
        .collect();
    Decisions {
        other: tiered.decide(&all_protocols, kind),
        by_protocol,
    }
}

impl Decisions {
    /// The entries under `base` (the identity's all-protocol key): one for every
    /// protocol, per protocol an all-port entry where its widest value differs, and port
    /// ranges where a piece differs from that.
    fn encode(self, base: PolicyKey, out: &mut BTreeMap<PolicyEntry, u32>) {
        out.insert((POLICY_PREFIX_ANY_PROTOCOL, base), self.other);
        for (protocol, pieces) in self.by_protocol {
            let mut width: BTreeMap<u32, u32> = BTreeMap::new();
            for (first, last, value) in &pieces {
                *width.entry(*value).or_default() += u32::from(*last - *first) + 1;
            }
            let widest = width
                .iter()
                .max_by_key(|(value, w)| (**w, std::cmp::Reverse(**value)))
                .map(|(value, _)| *value)
                .unwrap_or(self.other);
            let key = PolicyKey {
                protocol: protocol.number(),
                ..base
            };
            if widest != self.other {
                out.insert((POLICY_PREFIX_ANY_PORT, key), widest);
            }
            for (first, last, value) in pieces.into_iter().filter(|p| p.2 != widest) {
                for (port, bits) in port_prefixes(first, last) {
                    let key = PolicyKey {
                        port: port.to_be_bytes(),
                        ..key
                    };
                    out.insert((POLICY_PREFIX_ANY_PORT + bits, key), value);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn covers(prefixes: &[(u16, u32)], port: u16) -> bool {
        prefixes.iter().any(|&(v, bits)| {
            let mask: u16 = if bits == 0 {
                0
            } else {
                u16::MAX << (16 - bits)
            };
            port & mask == v
        })
    }

    /// A rule keeps its id while it exists; a new one takes the lowest id free, a
    /// released one included; the table names what each id stands for.
    #[test]
    fn rule_ids_stay_with_their_rules() {
        let rule = |policy: &str| Rule {
            peer: Peer::Any,
            ports: Ports::All,
            origin: weir_policy::desired::RuleOrigin {
                policy: policy.into(),
                rule_index: 0,
            },
        };
        let endpoint = |policies: &[&str]| Endpoint {
            pod: "x/a".into(),
            ipv4: None,
            ipv6: None,
            ingress: DirectionPolicy {
                isolated: true,
                rules: policies.iter().map(|p| rule(p)).collect(),
                ..Default::default()
            },
            egress: DirectionPolicy::default(),
        };
        let mut table = RuleTable::default();
        let mut plan = |policies: &[&str]| -> Vec<(String, u32)> {
            let ep = endpoint(policies);
            let ids: Vec<(String, u32)> = table
                .plan([&ep])
                .into_iter()
                .map(|(k, id)| (k.policy.to_string(), id))
                .collect();
            let named: Vec<(String, u32)> = table
                .by_id
                .iter()
                .map(|(id, n)| (n.policy.clone(), *id))
                .collect();
            let mut by_name = ids.clone();
            by_name.sort_by_key(|(_, id)| *id);
            assert_eq!(named, by_name);
            ids
        };
        let first = RULE_ID_FIRST;
        let ids = plan(&["x/p", "x/q", "x/r"]);
        assert_eq!(
            ids,
            [
                ("x/p".into(), first),
                ("x/q".into(), first + 1),
                ("x/r".into(), first + 2)
            ]
        );
        let ids = plan(&["x/p", "x/r", "x/s", "x/t"]);
        assert_eq!(
            ids,
            [
                ("x/p".into(), first),
                ("x/r".into(), first + 2),
                ("x/s".into(), first + 1),
                ("x/t".into(), first + 3)
            ]
        );
    }

    #[test]
    fn whole_port_space_is_cheap() {
        assert_eq!(port_prefixes(1, 65535).len(), 16);
        assert_eq!(port_prefixes(0, 65535), vec![(0, 0)]);
        assert_eq!(port_prefixes(80, 80), vec![(80, 16)]);
    }

    proptest! {
        #[test]
        fn port_prefixes_cover_exactly_the_range(a: u16, b: u16) {
            let (first, last) = (a.min(b), a.max(b));
            let p = port_prefixes(first, last);
            prop_assert!(p.len() <= 30);
            for port in [first, last, first.saturating_sub(1), last.saturating_add(1), first / 2 + last / 2] {
                prop_assert_eq!(covers(&p, port), (first..=last).contains(&port), "port {}", port);
            }
        }
    }
}
