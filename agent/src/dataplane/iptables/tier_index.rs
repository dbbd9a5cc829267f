//! A ClusterNetworkPolicy tier's rules indexed by protocol and destination port, so that a
//! new connection walks the rules that can match its port, not every rule of the tier.
//!
//! iptables walks a chain rule by rule: an endpoint under a thousand cluster policies
//! walked some two thousand rules per new connection. Two rules whose (protocol, port)
//! sets are disjoint never match the same packet, so their relative order does not
//! matter; only the order among rules that share ports does. So the tier becomes:
//! - in the chain that held it, a `goto` per protocol that has rules with port ranges, to
//!   the root of that protocol's tree, then the rules without a port range (every
//!   protocol, or every port of one), in order, for the packets of other protocols;
//! - per protocol, a binary tree of chains over the destination-port intervals the rules'
//!   ranges cut the port space into (`-p P --dport A:B -g LEFT`, then `-g RIGHT`), whose
//!   leaves hold, in the tier's order, exactly the rules that match that interval;
//! - at the end of each leaf, what follows the tier (`-g` its continuation chain).
//!
//! A packet's first matching rule is the same as in the linear chain: its leaf holds
//! every rule that can match it, in order. All jumps inside are gotos, so a rule's
//! RETURN (an Accept) leaves the endpoint chain as it did. The work per new connection is
//! the tree's depth plus its leaf: about log2(intervals) + the rules sharing its port.

use std::collections::BTreeSet;

use weir_policy::desired::Ports;
use weir_policy::model::Protocol;

/// Tiers with fewer rules stay linear: walking them costs less than the tree.
pub const INDEX_FROM_RULES: usize = 16;
/// Above this many chains for one tier, it stays linear (chain names hold 4 hex digits).
const MAX_CHAINS: usize = 0x1000;

const PROTOCOLS: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

/// Where a jump of the index goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The index chain at this position.
    Chain(usize),
    /// What follows the tier (a leaf that no rule matches needs no chain of its own).
    Continue,
}

/// One rule of an index chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The tier's rule at this position.
    Rule(usize),
    /// `-p P` to the target.
    Protocol(Protocol, Target),
    /// `-p P --dport FIRST:LAST` to the target.
    Ports(Protocol, u16, u16, Target),
    /// To the target, whatever the packet.
    Goto(Target),
}

/// A tier as a head (in the chain that held the tier, before what follows it) and its
/// index chains (referred to by position).
#[derive(Debug, PartialEq, Eq)]
pub struct TierIndex {
    pub head: Vec<Step>,
    pub chains: Vec<Vec<Step>>,
}

impl TierIndex {
    /// The chains in an order where each comes after every chain it names (restores
    /// need a chain to exist before a rule names it).
    pub fn children_first(&self) -> Vec<usize> {
        // Chains are made parent first (a node before its subtrees), so reversed.
        (0..self.chains.len()).rev().collect()
    }
}

/// The index of a tier whose rules have `ports` (in order), or `None` when it stays
/// linear: fewer than [`INDEX_FROM_RULES`] rules, or no port ranges to index by.
pub fn index(ports: &[Ports]) -> Option<TierIndex> {
    if ports.len() < INDEX_FROM_RULES {
        return None;
    }
    let mut index = TierIndex {
        head: Vec::new(),
        chains: Vec::new(),
    };
    for protocol in PROTOCOLS {
        // A protocol no rule gives a port range to is judged by the head's rules.
        if !ports.iter().any(|p| has_range(p, protocol)) {
            continue;
        }
        let root = tree(protocol, &intervals(ports, protocol), &mut index.chains);
        index.head.push(Step::Protocol(protocol, root));
    }
    if index.head.is_empty() || index.chains.len() > MAX_CHAINS {
        return None;
    }
    index.head.extend(
        ports
            .iter()
            .enumerate()
            .filter(|(_, p)| !matches!(p, Ports::Protocol { range: Some(_), .. }))
            .map(|(i, _)| Step::Rule(i)),
    );
    Some(index)
}

fn has_range(p: &Ports, protocol: Protocol) -> bool {
    matches!(p, Ports::Protocol { protocol: q, range: Some(_) } if *q == protocol)
}

/// A run of destination ports with the rules (positions, in order) that match all of it.
#[derive(Debug, PartialEq, Eq)]
struct Interval {
    first: u16,
    last: u16,
    rules: Vec<usize>,
}

/// The port space of `protocol` cut where a rule's range starts or ends, adjacent pieces
/// with the same rules merged.
fn intervals(ports: &[Ports], protocol: Protocol) -> Vec<Interval> {
    let mut cuts: BTreeSet<u32> = BTreeSet::from([0, 65536]);
    for p in ports {
        if let Ports::Protocol {
            protocol: q,
            range: Some(r),
        } = p
        {
            if *q == protocol {
                cuts.insert(u32::from(r.first));
                cuts.insert(u32::from(r.last) + 1);
            }
        }
    }
    let cuts: Vec<u32> = cuts.into_iter().collect();
    let mut out: Vec<Interval> = Vec::new();
    for w in cuts.windows(2) {
        let (first, last) = (w[0] as u16, (w[1] - 1) as u16);
        let rules: Vec<usize> = ports
            .iter()
            .enumerate()
            .filter(|(_, p)| match p {
                Ports::All => true,
                Ports::Protocol { protocol: q, range } => {
                    *q == protocol && range.is_none_or(|r| r.first <= first && last <= r.last)
                }
            })
            .map(|(i, _)| i)
            .collect();
        match out.last_mut() {
            Some(prev) if prev.rules == rules => prev.last = last,
            _ => out.push(Interval { first, last, rules }),
        }
    }
    out
}

/// Where a packet of `protocol` in `leaves` goes to meet its leaf's rules: a chain
/// (its position in `chains`) that splits the intervals in two halves, or the leaf's;
/// a leaf without rules is what follows the tier.
fn tree(protocol: Protocol, leaves: &[Interval], chains: &mut Vec<Vec<Step>>) -> Target {
    if let [leaf] = leaves {
        if leaf.rules.is_empty() {
            return Target::Continue;
        }
    }
    let me = chains.len();
    chains.push(Vec::new());
    chains[me] = match leaves {
        [leaf] => {
            let mut steps: Vec<Step> = leaf.rules.iter().map(|i| Step::Rule(*i)).collect();
            steps.push(Step::Goto(Target::Continue));
            steps
        }
        _ => {
            let (left, right) = leaves.split_at(leaves.len() / 2);
            let (first, last) = (left[0].first, left[left.len() - 1].last);
            let l = tree(protocol, left, chains);
            let r = tree(protocol, right, chains);
            vec![Step::Ports(protocol, first, last, l), Step::Goto(r)]
        }
    };
    Target::Chain(me)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use weir_policy::desired::PortRange;

    /// A packet's protocol (`None`: another, ICMP say) and destination port.
    type Packet = (Option<Protocol>, u16);

    fn matches(p: &Ports, (protocol, port): Packet) -> bool {
        match p {
            Ports::All => true,
            Ports::Protocol { protocol: q, range } => {
                protocol == Some(*q) && range.is_none_or(|r| r.first <= port && port <= r.last)
            }
        }
    }

    /// The first rule that decides `packet` in the linear chain (`None`: none does).
    fn linear(ports: &[Ports], packet: Packet, peer: &[bool]) -> Option<usize> {
        (0..ports.len()).find(|i| peer[*i] && matches(&ports[*i], packet))
    }

    /// The same, walking the index as iptables would (every index chain ends in a goto).
    fn walk(index: &TierIndex, ports: &[Ports], packet: Packet, peer: &[bool]) -> Option<usize> {
        let mut chain = &index.head;
        let mut hops = 0;
        'chain: loop {
            hops += 1;
            assert!(hops < 64, "a loop in the index");
            for step in chain {
                let target = match *step {
                    Step::Rule(i) => {
                        if peer[i] && matches(&ports[i], packet) {
                            return Some(i);
                        }
                        continue;
                    }
                    Step::Protocol(p, t) if packet.0 == Some(p) => t,
                    Step::Ports(p, first, last, t)
                        if packet.0 == Some(p) && first <= packet.1 && packet.1 <= last =>
                    {
                        t
                    }
                    Step::Goto(t) => t,
                    _ => continue,
                };
                match target {
                    Target::Chain(c) => {
                        chain = &index.chains[c];
                        continue 'chain;
                    }
                    Target::Continue => return None,
                }
            }
            return None;
        }
    }

    fn ports_strategy() -> impl Strategy<Value = Ports> {
        let protocol = prop_oneof![
            Just(Protocol::Tcp),
            Just(Protocol::Udp),
            Just(Protocol::Sctp)
        ];
        prop_oneof![
            1 => Just(Ports::All),
            1 => protocol.clone().prop_map(|protocol| Ports::Protocol { protocol, range: None }),
            6 => (protocol, 0u16..40, 0u16..6).prop_map(|(protocol, first, len)| Ports::Protocol {
                protocol,
                range: Some(PortRange { first, last: first + len }),
            }),
        ]
    }

    proptest! {
        #[test]
        fn every_packet_meets_the_rule_the_linear_chain_gives_it(
            ports in proptest::collection::vec(ports_strategy(), 16..48),
            peer in proptest::collection::vec(any::<bool>(), 48),
            packets in proptest::collection::vec(
                (prop_oneof![
                    Just(None),
                    Just(Some(Protocol::Tcp)),
                    Just(Some(Protocol::Udp)),
                    Just(Some(Protocol::Sctp))
                ], 0u16..50),
                32,
            ),
        ) {
            let Some(index) = index(&ports) else {
                // Only a tier without port ranges stays linear.
                let ranged = ports
                    .iter()
                    .any(|p| matches!(p, Ports::Protocol { range: Some(_), .. }));
                prop_assert!(!ranged);
                return Ok(());
            };
            for packet in packets {
                prop_assert_eq!(walk(&index, &ports, packet, &peer), linear(&ports, packet, &peer));
            }
            for c in index.children_first().windows(2) {
                prop_assert!(c[0] > c[1]);
            }
        }
    }

    #[test]
    fn a_thousand_single_ports_cost_a_tree_walk_not_a_thousand_rules() {
        let ports: Vec<Ports> = (0..1000)
            .map(|i| Ports::Protocol {
                protocol: Protocol::Tcp,
                range: Some(PortRange {
                    first: 20000 + i,
                    last: 20000 + i,
                }),
            })
            .collect();
        let index = index(&ports).expect("indexed");
        // The rules a packet to port 20500 is tested against, and the chains it passes.
        let (mut tested, mut chain, mut depth) = (0, &index.head, 0);
        loop {
            depth += 1;
            let mut next = None;
            for step in chain {
                tested += 1;
                match *step {
                    Step::Protocol(_, Target::Chain(c)) => next = Some(c),
                    Step::Ports(_, first, last, Target::Chain(c))
                        if (first..=last).contains(&20500) =>
                    {
                        next = Some(c)
                    }
                    Step::Goto(Target::Chain(c)) => next = Some(c),
                    Step::Rule(i) => {
                        assert_eq!(i, 500);
                        next = None;
                    }
                    _ => continue,
                }
                break;
            }
            match next {
                Some(c) => chain = &index.chains[c],
                None => break,
            }
        }
        assert!(depth <= 13, "{depth} chains");
        assert!(tested <= 26, "{tested} rules tested");
    }

    #[test]
    fn small_tiers_and_tiers_without_ranges_stay_linear() {
        let one = Ports::Protocol {
            protocol: Protocol::Tcp,
            range: Some(PortRange {
                first: 80,
                last: 80,
            }),
        };
        assert_eq!(index(&[one; INDEX_FROM_RULES - 1]), None);
        assert_eq!(index(&[Ports::All; 100]), None);
    }
}
