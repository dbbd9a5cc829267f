//! Budgets: how much of the node's kernel tables one namespaced object may take.
//!
//! Every table a dataplane writes is shared by the node: eBPF's POLICY trie (65,536
//! entries by default), its IDENTITY trie and SERVICE map, iptables' rules and each
//! ipset (weir's `maxelem` is 1,048,576). Without a bound, one tenant's NetworkPolicy (thousands of ipBlocks times port
//! ranges) fills a table, and then another namespace's policy cannot be written: one
//! tenant breaks another's allowed traffic.
//!
//! The engine refuses such a policy before compiling it, from its spec alone: the
//! [`estimate`] counts the entries each pod the policy selects costs (per rule, peers ×
//! port prefixes, an ipBlock's excepts counted as peers), with the arithmetic only, so a
//! policy of millions of would-be entries is refused without making one. A refused
//! policy is reported like an invalid one (named, with the figure), the engine keeps its
//! last admitted version, and everything else stays enforced. A namespace's policies
//! together are bounded too (`--max-entries-per-namespace`, the sum of their estimates),
//! so that many policies, each within its budget, cannot make one tenant's share of the
//! node's tables (eBPF's IDENTITY trie above all: every ipBlock is a prefix) unbounded. The check belongs to the
//! engine, so both dataplanes refuse exactly the same objects.

use crate::error::PolicyError;
use crate::model::ObjectRef;
use crate::spec::{PeerSpec, PolicySpec, PortMatch, RuleSpec};

/// The default of `--max-entries-per-policy`: a sixteenth of eBPF's default POLICY trie
/// (65,536), so no single policy can take more than that share of it for a pod it
/// selects (and an ipBlock's excepts, set members on iptables, stay far below weir's
/// ipset `maxelem` of 1,048,576, and below ipset's own default of 65,536). Real policies stay far below it (200
/// ipBlocks with TCP and UDP ranges of 1024–65535 estimate 2,400).
pub const DEFAULT_MAX_ENTRIES_PER_POLICY: u64 = 4096;

/// The default of `--max-entries-per-namespace`: sixteen policies at the per-policy
/// default, a sixteenth of eBPF's default IDENTITY trie (1,048,576 prefixes), so that
/// no one namespace's ipBlocks can take more than that share of it, nor its policies
/// together more than that per pod they select.
pub const DEFAULT_MAX_ENTRIES_PER_NAMESPACE: u64 = 65_536;

/// What one object may take of the node's tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Estimated table entries per selected pod above which a NetworkPolicy is refused.
    pub max_entries_per_policy: u64,
    /// The sum of those estimates over one namespace's policies above which its next
    /// policy (or a larger version of one) is refused.
    pub max_entries_per_namespace: u64,
}

impl Budget {
    /// No bound: what the API server admits ([`crate::Engine::new`]'s budget, so that a
    /// tool mirroring the API server, such as the lab, accepts what a cluster would; the
    /// agent sets its node's budget).
    pub const UNLIMITED: Budget = Budget {
        max_entries_per_policy: u64::MAX,
        max_entries_per_namespace: u64::MAX,
    };
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            max_entries_per_policy: DEFAULT_MAX_ENTRIES_PER_POLICY,
            max_entries_per_namespace: DEFAULT_MAX_ENTRIES_PER_NAMESPACE,
        }
    }
}

/// A policy's estimated expansion: the table entries one pod it selects costs, and the
/// two factors of its largest rule (for the error message).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Estimate {
    /// Sum over both directions' rules of peers × port prefixes (saturating).
    pub entries: u64,
    /// The peers (ipBlock excepts included) of the rule that costs most.
    pub largest_rule_peers: u64,
    /// The port prefixes of that rule.
    pub largest_rule_ports: u64,
}

/// The entries `spec` costs per selected pod, computed from the spec without expanding
/// anything: a rule costs its peers (1 when it has none: every peer; an ipBlock 1 plus
/// its excepts, which are identities and set members too) times its port prefixes (1
/// when it has no ports; a port range its aligned prefixes, at most 30, as eBPF's POLICY
/// trie stores it and as many as iptables' multiport would need).
pub fn estimate(spec: &PolicySpec) -> Estimate {
    let mut out = Estimate::default();
    let mut largest = 0;
    let rules = spec.ingress.iter().chain(spec.egress.iter()).flatten();
    for rule in rules {
        let (peers, ports) = (rule_peers(rule), rule_ports(rule));
        let cost = peers.saturating_mul(ports);
        out.entries = out.entries.saturating_add(cost);
        if cost > largest {
            largest = cost;
            out.largest_rule_peers = peers;
            out.largest_rule_ports = ports;
        }
    }
    out
}

fn rule_peers(rule: &RuleSpec) -> u64 {
    if rule.peers.is_empty() {
        return 1;
    }
    rule.peers.iter().fold(0u64, |sum, peer| {
        let cost = match peer {
            PeerSpec::Block { except, .. } => 1u64.saturating_add(except.len() as u64),
            PeerSpec::Pods { .. } | PeerSpec::Nodes(_) => 1,
        };
        sum.saturating_add(cost)
    })
}

fn rule_ports(rule: &RuleSpec) -> u64 {
    if rule.ports.is_empty() {
        return 1;
    }
    rule.ports.iter().fold(0u64, |sum, port| {
        let cost = match &port.port {
            PortMatch::Range(r) => port_prefix_count(r.first, r.last),
            PortMatch::Any | PortMatch::Named(_) => 1,
        };
        sum.saturating_add(cost)
    })
}

/// How many aligned prefixes cover `first..=last` (what a dataplane keyed by port
/// prefix writes for the range): 1 for a single port, 16 for 1–65535, at most 30.
pub fn port_prefix_count(first: u16, last: u16) -> u64 {
    let (mut lo, hi) = (u32::from(first), u32::from(last));
    let mut count = 0;
    while lo <= hi {
        let mut size = if lo == 0 {
            1 << 16
        } else {
            1u32 << lo.trailing_zeros()
        };
        while lo + size - 1 > hi {
            size >>= 1;
        }
        count += 1;
        lo += size;
    }
    count
}

impl Budget {
    /// `Ok` when `spec` fits; else the refusal, naming the policy and the figures.
    pub fn check(&self, spec: &PolicySpec) -> Result<(), PolicyError> {
        let e = estimate(spec);
        if e.entries <= self.max_entries_per_policy {
            return Ok(());
        }
        Err(PolicyError::OverBudget {
            object: ObjectRef::new(
                crate::model::Kind::NetworkPolicy,
                Some(&spec.namespace),
                &spec.name,
            ),
            entries: e.entries,
            budget: self.max_entries_per_policy,
            largest_rule_peers: e.largest_rule_peers,
            largest_rule_ports: e.largest_rule_ports,
        })
    }
}

impl Budget {
    /// `Ok` when `spec` fits beside the other policies of its namespace, whose estimates
    /// sum to `others` (its own earlier version left out); else the refusal, naming the
    /// policy, its namespace and the figures. Policies are admitted in the order they
    /// arrive: the one that would take the namespace over is refused, the others stay.
    pub fn check_namespace(&self, spec: &PolicySpec, others: u64) -> Result<(), PolicyError> {
        let entries = estimate(spec).entries;
        let total = others.saturating_add(entries);
        if total <= self.max_entries_per_namespace {
            return Ok(());
        }
        Err(PolicyError::NamespaceOverBudget {
            object: ObjectRef::new(
                crate::model::Kind::NetworkPolicy,
                Some(&spec.namespace),
                &spec.name,
            ),
            namespace: spec.namespace.clone(),
            entries,
            others,
            budget: self.max_entries_per_namespace,
        })
    }
}

impl Budget {
    /// `Ok` when a Service's `frontends` (each a WEIR_SERVICE entry on eBPF) fit the same
    /// bound; else the refusal naming it. Its frontends are expanded when it is converted,
    /// bounded by the object itself (addresses × ports).
    pub fn check_service(
        &self,
        namespace: &str,
        name: &str,
        frontends: usize,
    ) -> Result<(), PolicyError> {
        let frontends = frontends as u64;
        if frontends <= self.max_entries_per_policy {
            return Ok(());
        }
        Err(PolicyError::ServiceOverBudget {
            object: ObjectRef::new(crate::model::Kind::Service, Some(namespace), name),
            frontends,
            budget: self.max_entries_per_policy,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Object;

    fn policy(yaml: &str) -> PolicySpec {
        let object = crate::manifest::parse_str(yaml).expect(yaml).remove(0);
        match object {
            Object::NetworkPolicy(np) => crate::parse_policy(&np).expect(yaml),
            _ => panic!("not a policy: {yaml}"),
        }
    }

    /// A policy of `blocks` single-address ipBlocks admitted on TCP and UDP 1024–65535.
    pub(crate) fn hostile(blocks: usize) -> String {
        let mut yaml = String::from(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {name: huge, namespace: blue}\nspec:\n  podSelector: {}\n  ingress:\n  - from:\n",
        );
        for i in 0..blocks {
            let (a, b) = (i / 250, i % 250 + 1);
            yaml.push_str(&format!("    - ipBlock: {{cidr: 10.100.{a}.{b}/32}}\n"));
        }
        yaml.push_str(
            "    ports:\n    - {protocol: TCP, port: 1024, endPort: 65535}\n    \
             - {protocol: UDP, port: 1024, endPort: 65535}\n",
        );
        yaml
    }

    #[test]
    fn port_prefix_counts_match_the_prefixes_a_range_becomes() {
        assert_eq!(port_prefix_count(80, 80), 1);
        assert_eq!(port_prefix_count(0, 65535), 1);
        assert_eq!(port_prefix_count(1, 65535), 16);
        assert_eq!(port_prefix_count(1024, 65535), 6);
        assert_eq!(port_prefix_count(1, 65534), 30);
    }

    #[test]
    fn a_rule_costs_its_peers_times_its_port_prefixes() {
        let spec = policy(&hostile(2500));
        let e = estimate(&spec);
        assert_eq!(e.entries, 2500 * 12);
        assert_eq!((e.largest_rule_peers, e.largest_rule_ports), (2500, 12));
    }

    #[test]
    fn empty_peers_and_ports_cost_one_and_excepts_count_as_peers() {
        let spec = policy(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {name: p, namespace: a}\nspec:\n  podSelector: {}\n\
             \x20 policyTypes: [Ingress, Egress]\n  ingress:\n  - {}\n  - from:\n\
             \x20   - podSelector: {}\n\
             \x20   - ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16, 10.2.0.0/16]}\n\
             \x20   ports: [{port: 80}, {protocol: UDP}, {port: dns}]\n  egress: []\n",
        );
        // Ingress: {} costs 1; the second rule (1 + 3 peers) × 3 ports = 12.
        assert_eq!(estimate(&spec).entries, 13);
    }

    #[test]
    fn the_budget_refuses_above_it_and_names_the_policy_and_the_figure() {
        let spec = policy(&hostile(2500));
        let budget = Budget::default();
        let e = budget.check(&spec).unwrap_err();
        let shown = e.to_string();
        assert!(shown.starts_with("networkpolicy blue/huge: "), "{shown}");
        assert!(shown.contains("30000"), "{shown}");
        assert!(shown.contains("4096"), "{shown}");
        assert!(shown.contains("--max-entries-per-policy"), "{shown}");
        assert_eq!(e.object().name, "huge");
        // At the figure exactly it fits.
        let exact = Budget {
            max_entries_per_policy: 30000,
            ..Budget::default()
        };
        assert_eq!(exact.check(&spec), Ok(()));
        let small = policy(&hostile(300));
        assert_eq!(budget.check(&small), Ok(()), "300 × 12 = 3,600 fits");
    }
}
