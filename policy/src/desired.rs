//! The dataplane-neutral desired state: what the compiler produces and both dataplanes
//! enforce. Nothing here knows about Kubernetes objects or about a dataplane.
//!
//! - Per local pod ([`Endpoint`]) and [`Direction`]: isolated or not, and the allow
//!   [`Rule`]s (OR-ed). A non-isolated direction allows everything.
//! - Peers are [`AddressSet`]s, identified by a stable [`SetId`] derived from what the set
//!   *selects* (not from its members), so a pod joining a selector is a member delta,
//!   not a new set.
//! - [`Desired::diff`] turns two desired states into a [`Delta`]; the dataplanes take
//!   the whole [`Desired`], never a delta.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv6Net};
use serde::{Deserialize, Serialize};

// The model's pod key and protocol, which every part of the desired state names.
pub use crate::model::{PodKey, Protocol};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Direction {
    /// Traffic to the pod.
    Ingress,
    /// Traffic from the pod.
    Egress,
}

impl Direction {
    /// `ingress` or `egress`, as weir prints and labels it.
    pub fn name(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// Inclusive destination port range; `first == last` for a single port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

/// What a rule admits on the (protocol, destination port) axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Ports {
    /// `ports` absent: every protocol (TCP, UDP, SCTP, ICMP, ...) and every port.
    All,
    /// One protocol; `range: None` means every port of it.
    Protocol {
        protocol: Protocol,
        range: Option<PortRange>,
    },
}

/// Stable, collision-checked identifier of an address set. Rendered as 16 hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SetId(pub u64);

impl fmt::Display for SetId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// One entry of an address set. `except` entries carve holes out of the others
/// (ipBlock `except`; the longest matching prefix decides).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Member {
    pub net: IpNet,
    pub except: bool,
}

/// A resolved peer: pods by selector, namespaces by selector, or a CIDR minus excepts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddressSet {
    pub id: SetId,
    /// What the set selects, human-readable and canonical (the id is derived from it).
    pub definition: String,
    pub members: BTreeSet<Member>,
}

impl AddressSet {
    /// A set from CIDR strings (a leading `!` marks an except), defined as `test-<id>`:
    /// for tests of what consumes sets.
    pub fn from_cidrs(id: u64, nets: &[&str]) -> Result<AddressSet, ipnet::AddrParseError> {
        let members = nets
            .iter()
            .map(|n| {
                Ok(Member {
                    net: n.trim_start_matches('!').parse()?,
                    except: n.starts_with('!'),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(AddressSet {
            id: SetId(id),
            definition: format!("test-{id}"),
            members,
        })
    }

    /// Whether `addr` is in the set: the longest matching member decides, and an
    /// `except` member means "not in the set". An IPv4-mapped IPv6 address is in no set
    /// (see [`is_ipv4_mapped`]).
    pub fn contains(&self, addr: std::net::IpAddr) -> bool {
        !is_ipv4_mapped(addr)
            && self
                .members
                .iter()
                .filter(|m| m.net.contains(&addr))
                .max_by_key(|m| (m.net.prefix_len(), m.except))
                .is_some_and(|m| !m.except)
    }
}

/// The IPv4-mapped IPv6 range, ::ffff:0:0/96.
pub fn ipv4_mapped_range() -> Ipv6Net {
    Ipv6Net::new(Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0), 96).expect("a /96")
}

/// Whether `addr` is an IPv6 address inside ::ffff:0:0/96. weir places such a peer in no
/// address set, so only rules without peers admit it: no pod has one, on the wire it can
/// only be forged (Linux accepts such a source and shows it to a dual-stack socket as the
/// IPv4 address), and eBPF's identity trie keeps IPv4 there.
pub fn is_ipv4_mapped(addr: IpAddr) -> bool {
    matches!(addr, IpAddr::V6(v6) if ipv4_mapped_range().contains(&v6))
}

/// `members` as the dataplanes program them (see [`is_ipv4_mapped`]): IPv6 members inside
/// ::ffff:0:0/96 are left out, and the range is an except of any set with an IPv6 member
/// that covers it (::/0 to ::/80, or the /96 itself).
pub fn programmed_members<'a>(members: impl IntoIterator<Item = &'a Member>) -> Vec<Member> {
    let mapped = IpNet::V6(ipv4_mapped_range());
    let mut out = Vec::new();
    let mut covers = false;
    for m in members {
        match m.net.trunc() {
            IpNet::V6(net) if ipv4_mapped_range().contains(&net) => {
                covers |= !m.except && net == ipv4_mapped_range();
            }
            IpNet::V6(net) if net.contains(&ipv4_mapped_range()) => {
                covers |= !m.except;
                out.push(*m);
            }
            _ => out.push(*m),
        }
    }
    if covers {
        out.push(Member {
            net: mapped,
            except: true,
        });
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Peer {
    /// No `from`/`to` in the rule: every source or destination.
    Any,
    Set(SetId),
}

/// Where a rule came from, for `weir explain`, counters and drop events.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RuleOrigin {
    /// `namespace/name` of the NetworkPolicy; for an audit rule, of every audit policy
    /// that would isolate the pod, comma-separated.
    pub policy: String,
    /// Index of the rule in the policy's `ingress` or `egress` list; [`RuleOrigin::AUDIT`]
    /// for an audit rule.
    pub rule_index: u32,
}

/// Between the policies an audit rule names (no Kubernetes name holds one).
const AUDIT_SEPARATOR: &str = ",";

impl RuleOrigin {
    /// The `rule_index` of an audit rule: the allow-everything rule last in a direction
    /// that only audit-mode policies isolate. What it matches, those policies would drop.
    pub const AUDIT: u32 = u32::MAX;

    pub fn audit(policies: &[String]) -> RuleOrigin {
        RuleOrigin {
            policy: policies.join(AUDIT_SEPARATOR),
            rule_index: RuleOrigin::AUDIT,
        }
    }

    /// The policies in an audit rule's `policy` field (as the dataplanes record it).
    pub fn split_audited(policy: &str) -> impl Iterator<Item = &str> {
        policy.split(AUDIT_SEPARATOR)
    }

    pub fn is_audit(&self) -> bool {
        self.rule_index == RuleOrigin::AUDIT
    }

    /// The policies an audit rule stands for (`namespace/name` each); empty for any
    /// other rule.
    pub fn audited_policies(&self) -> Vec<&str> {
        if self.is_audit() {
            RuleOrigin::split_audited(&self.policy).collect()
        } else {
            Vec::new()
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Rule {
    pub peer: Peer,
    pub ports: Ports,
    pub origin: RuleOrigin,
}

/// Where a ClusterNetworkPolicy sits: the Admin tier is evaluated before NetworkPolicies,
/// the Baseline tier after them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Tier {
    Admin,
    Baseline,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Admin => "Admin",
            Tier::Baseline => "Baseline",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a matching tier rule does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Action {
    /// Allowed in this direction; no later tier (nor NetworkPolicy) is consulted.
    Accept,
    /// Dropped; no later tier is consulted.
    Deny,
    /// The rest of this tier is skipped; the next tier decides.
    Pass,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Accept => "Accept",
            Action::Deny => "Deny",
            Action::Pass => "Pass",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a ClusterNetworkPolicy rule came from, for `weir explain`, counters and drops.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TierOrigin {
    /// The ClusterNetworkPolicy's name.
    pub policy: String,
    pub priority: u16,
    /// Index of the rule in the policy's `ingress` or `egress` list.
    pub rule_index: u32,
    /// The rule's `name`, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule_name: Option<String>,
}

/// One (peer, ports) of a ClusterNetworkPolicy rule, compiled for an endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TierRule {
    pub peer: Peer,
    pub ports: Ports,
    pub action: Action,
    pub origin: TierOrigin,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectionPolicy {
    /// Selected by at least one policy of this direction: everything not allowed is dropped.
    /// A direction that only audit-mode policies select is isolated too, with their rules
    /// and, last, an audit rule ([`RuleOrigin::AUDIT`]) that allows the rest: the
    /// dataplanes enforce it as any other rule, and count what it allows.
    pub isolated: bool,
    pub rules: BTreeSet<Rule>,
    /// The Admin tier's ClusterNetworkPolicy rules that apply, in evaluation order: the
    /// first that matches decides (Accept, Deny) or hands the decision to the
    /// NetworkPolicies (Pass). Evaluated before `isolated` and `rules`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub admin: Vec<TierRule>,
    /// The Baseline tier's, likewise, evaluated only where neither the Admin tier nor a
    /// NetworkPolicy (`isolated`) decided; what no rule decides is allowed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub baseline: Vec<TierRule>,
}

impl DirectionPolicy {
    /// Whether ClusterNetworkPolicy tiers judge the direction (then the dataplanes judge
    /// it whether or not a NetworkPolicy isolates it).
    pub fn is_tiered(&self) -> bool {
        !self.admin.is_empty() || !self.baseline.is_empty()
    }

    pub fn tier(&self, tier: Tier) -> &[TierRule] {
        match tier {
            Tier::Admin => &self.admin,
            Tier::Baseline => &self.baseline,
        }
    }
}

/// A pod on this node that the dataplane enforces for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub pod: PodKey,
    pub ipv4: Option<Ipv4Addr>,
    pub ipv6: Option<Ipv6Addr>,
    pub ingress: DirectionPolicy,
    pub egress: DirectionPolicy,
}

impl Endpoint {
    pub fn direction(&self, d: Direction) -> &DirectionPolicy {
        match d {
            Direction::Ingress => &self.ingress,
            Direction::Egress => &self.egress,
        }
    }
}

/// A Service address and port that kube-proxy rewrites to a backend: a pod's traffic
/// to it is judged after that DNAT, against the backend it reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Frontend {
    /// `None`: a nodePort, on every address of the node.
    pub addr: Option<IpAddr>,
    pub protocol: Protocol,
    pub port: u16,
}

/// Everything a dataplane must enforce on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Desired {
    pub sets: BTreeMap<SetId, AddressSet>,
    pub endpoints: BTreeMap<PodKey, Endpoint>,
    /// Every Service frontend in the cluster.
    #[serde(default)]
    pub frontends: BTreeSet<Frontend>,
    /// The namespace of each frontend's Service (the first by name, where two share
    /// one): a table short of room for them all shares it out by namespace. Derived
    /// from the Services, not serialized (JSON maps need string keys).
    #[serde(skip)]
    pub frontend_namespaces: BTreeMap<Frontend, String>,
}

/// Changes to one endpoint that already existed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointChange {
    /// The endpoint as it is now (addresses and isolation flags included).
    pub after: Option<Endpoint>,
    pub pod: PodKey,
    pub addresses_changed: bool,
    pub isolation_changed: bool,
    pub rules_added: Vec<(Direction, Rule)>,
    pub rules_removed: Vec<(Direction, Rule)>,
}

/// The difference between two desired states, in the order it can be applied:
/// add sets and members, add/change endpoints, then remove endpoints, members and sets,
/// so that nothing referenced is ever removed first.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delta {
    pub sets_added: Vec<AddressSet>,
    pub members_added: Vec<(SetId, Member)>,
    pub endpoints_added: Vec<Endpoint>,
    pub endpoints_changed: Vec<EndpointChange>,
    pub endpoints_removed: Vec<PodKey>,
    pub members_removed: Vec<(SetId, Member)>,
    pub sets_removed: Vec<SetId>,
    #[serde(default)]
    pub frontends_added: Vec<Frontend>,
    #[serde(default)]
    pub frontends_removed: Vec<Frontend>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.sets_added.is_empty()
            && self.members_added.is_empty()
            && self.endpoints_added.is_empty()
            && self.endpoints_changed.is_empty()
            && self.endpoints_removed.is_empty()
            && self.members_removed.is_empty()
            && self.sets_removed.is_empty()
            && self.frontends_added.is_empty()
            && self.frontends_removed.is_empty()
    }
}

impl Desired {
    /// The delta that turns `self` into `next`.
    pub fn diff(&self, next: &Desired) -> Delta {
        let mut delta = Delta::default();
        for (id, set) in &next.sets {
            match self.sets.get(id) {
                None => delta.sets_added.push(set.clone()),
                Some(old) => {
                    delta
                        .members_added
                        .extend(set.members.difference(&old.members).map(|m| (*id, *m)));
                    delta
                        .members_removed
                        .extend(old.members.difference(&set.members).map(|m| (*id, *m)));
                }
            }
        }
        delta
            .sets_removed
            .extend(self.sets.keys().filter(|id| !next.sets.contains_key(id)));

        for (pod, ep) in &next.endpoints {
            let Some(old) = self.endpoints.get(pod) else {
                delta.endpoints_added.push(ep.clone());
                continue;
            };
            if old == ep {
                continue;
            }
            let mut change = EndpointChange {
                after: Some(ep.clone()),
                pod: pod.clone(),
                addresses_changed: old.ipv4 != ep.ipv4 || old.ipv6 != ep.ipv6,
                isolation_changed: old.ingress.isolated != ep.ingress.isolated
                    || old.egress.isolated != ep.egress.isolated,
                ..Default::default()
            };
            for d in [Direction::Ingress, Direction::Egress] {
                let (o, n) = (&old.direction(d).rules, &ep.direction(d).rules);
                change
                    .rules_added
                    .extend(n.difference(o).map(|r| (d, r.clone())));
                change
                    .rules_removed
                    .extend(o.difference(n).map(|r| (d, r.clone())));
            }
            delta.endpoints_changed.push(change);
        }
        delta.endpoints_removed.extend(
            self.endpoints
                .keys()
                .filter(|p| !next.endpoints.contains_key(*p))
                .cloned(),
        );
        delta.frontends_added = next
            .frontends
            .difference(&self.frontends)
            .copied()
            .collect();
        delta.frontends_removed = self
            .frontends
            .difference(&next.frontends)
            .copied()
            .collect();
        delta
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(id: u64, nets: &[&str]) -> AddressSet {
        AddressSet::from_cidrs(id, nets).unwrap()
    }

    #[test]
    fn except_is_the_longest_prefix() {
        let s = set(1, &["10.0.0.0/8", "!10.1.0.0/16", "10.1.2.3/32"]);
        assert!(s.contains("10.2.0.1".parse().unwrap()));
        assert!(!s.contains("10.1.0.1".parse().unwrap()));
        assert!(s.contains("10.1.2.3".parse().unwrap()));
        assert!(!s.contains("11.0.0.1".parse().unwrap()));
    }

    #[test]
    fn an_ipv4_mapped_address_is_in_no_set_and_no_ipv6_block_holds_the_range() {
        let everything = set(1, &["::/0", "0.0.0.0/0"]);
        assert!(everything.contains("10.0.0.1".parse().unwrap()));
        assert!(everything.contains("fd00::1".parse().unwrap()));
        assert!(!everything.contains("::ffff:10.0.0.1".parse().unwrap()));
        let mapped = set(2, &["::ffff:10.0.0.1/128"]);
        assert!(!mapped.contains("::ffff:10.0.0.1".parse().unwrap()));

        let shown = |s: &AddressSet| -> Vec<String> {
            programmed_members(&s.members)
                .iter()
                .map(|m| format!("{}{}", if m.except { "!" } else { "" }, m.net))
                .collect()
        };
        assert_eq!(
            shown(&everything),
            ["0.0.0.0/0", "::/0", "!::ffff:0.0.0.0/96"]
        );
        assert!(shown(&mapped).is_empty());
        // A block that does not reach the range is left alone.
        assert_eq!(
            shown(&set(3, &["fd00::/8", "!fd00::1/128"])),
            ["fd00::/8", "!fd00::1/128"]
        );
        assert_eq!(shown(&set(4, &["::/80"])), ["::/80", "!::ffff:0.0.0.0/96"]);
    }

    #[test]
    fn diff_reports_member_and_set_changes() {
        let mut a = Desired::default();
        a.sets.insert(SetId(1), set(1, &["10.0.0.1/32"]));
        a.sets.insert(SetId(2), set(2, &["10.0.0.2/32"]));
        let mut b = Desired::default();
        b.sets.insert(SetId(1), set(1, &["10.0.0.3/32"]));
        b.sets.insert(SetId(3), set(3, &["10.0.0.4/32"]));
        let d = a.diff(&b);
        assert_eq!(d.sets_added.len(), 1);
        assert_eq!(d.sets_removed, vec![SetId(2)]);
        assert_eq!(d.members_added.len(), 1);
        assert_eq!(d.members_removed.len(), 1);
        assert!(b.diff(&b).is_empty());
    }
}
