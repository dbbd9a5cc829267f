//! Naming a record from the engine: both ends' pods by address, the deciding endpoint,
//! and, for policy verdicts, the policies behind them (for a drop that a
//! ClusterNetworkPolicy Deny made, that rule). Done in the run loop, which owns the
//! engine, so the dataplanes' taps stay cheap and both dataplanes' records read alike.

use std::collections::HashMap;

use weir_policy::desired::{Action, Direction, Protocol};
use weir_policy::verdict::direction_verdict;
use weir_policy::Engine;

use super::record::VerdictRecord;

fn pod_at(engine: &Engine, addr: std::net::IpAddr) -> Option<String> {
    engine
        .model()
        .pods_with_address(addr)
        .next()
        .map(|p| p.key().to_string())
}

/// The policy lists [`name`] made, kept while the engine's revision stays: a drop names
/// every policy selecting its pod, which judges every selector of the pod's namespace
/// (a thousand, in the bench's world) for each record, in the agent's loop.
#[derive(Debug, Default)]
pub struct PolicyNames {
    revision: u64,
    lists: HashMap<(String, Direction, bool), Option<String>>,
}

/// Kept at most; past it the lists are made again (a node has far fewer pods).
const POLICY_NAMES_KEPT: usize = 4096;

impl PolicyNames {
    /// The policies selecting `pod` for `direction` that are (`audit`) or are not in audit
    /// mode, as `ns/a,ns/b`; `None` when there are none.
    fn policies(
        &mut self,
        engine: &Engine,
        pod: &str,
        direction: Direction,
        audit: bool,
    ) -> Option<String> {
        if self.revision != engine.revision() || self.lists.len() >= POLICY_NAMES_KEPT {
            self.lists.clear();
            self.revision = engine.revision();
        }
        self.lists
            .entry((pod.to_string(), direction, audit))
            .or_insert_with(|| policies(engine, pod, direction, audit))
            .clone()
    }
}

fn policies(engine: &Engine, pod: &str, direction: Direction, audit: bool) -> Option<String> {
    let info = engine.model().pod(pod)?;
    let names: Vec<String> = engine
        .policies_selecting(info)
        .into_iter()
        .filter(|p| p.audit == audit && p.rules(direction).is_some())
        .map(|p| p.key())
        .collect();
    (!names.is_empty()).then(|| names.join(","))
}

/// Completes a dataplane's record: the time, both pods, the endpoint when the dataplane
/// did not know it, and the policies that decided.
pub fn name(record: &mut VerdictRecord, engine: &Engine, names: &mut PolicyNames) {
    if record.time.is_empty() {
        record.time = k8s_openapi::jiff::Timestamp::now().to_string();
    }
    if record.verdict == "suppressed" {
        return;
    }
    record.src_pod = pod_at(engine, record.src);
    record.dst_pod = pod_at(engine, record.dst);
    let direction = match record.direction.as_str() {
        "ingress" => Direction::Ingress,
        "egress" => Direction::Egress,
        _ => return,
    };
    if record.pod.is_none() {
        record.pod = match direction {
            Direction::Ingress => record.dst_pod.clone(),
            Direction::Egress => record.src_pod.clone(),
        };
    }
    let Some(pod) = record.pod.clone() else {
        return;
    };
    let dir = direction.name();
    match (record.verdict.as_str(), record.reason.as_str()) {
        ("drop", "policy-deny") => {
            if let Some(rule) = tier_deny(engine, &pod, direction, record) {
                record.rule = Some(rule);
            } else if let Some(by) = names.policies(engine, &pod, direction, false) {
                record.rule = Some(format!("default deny by {by} ({dir})"));
            }
        }
        ("audit", _) if record.rule.is_none() => {
            if let Some(by) = names.policies(engine, &pod, direction, true) {
                record.rule = Some(format!("{by} {dir} audit: would be dropped"));
            }
        }
        _ => {}
    }
}

/// The ClusterNetworkPolicy Deny rule that drops the record's packet at `pod`, as
/// `<Tier> tier clusternetworkpolicy <name> <direction> rule <i> (Deny)`.
fn tier_deny(
    engine: &Engine,
    pod: &str,
    direction: Direction,
    record: &VerdictRecord,
) -> Option<String> {
    let protocol = match record.protocol {
        6 => Protocol::Tcp,
        17 => Protocol::Udp,
        132 => Protocol::Sctp,
        _ => return None,
    };
    let peer = match direction {
        Direction::Ingress => record.src,
        Direction::Egress => record.dst,
    };
    let endpoint = engine.desired().endpoints.get(pod)?;
    // Only the tiers deny; judging the packet against every rule (each peer set walked)
    // is not worth it for a direction they do not judge: this runs in the agent's loop,
    // before its next change.
    if !endpoint.direction(direction).is_tiered() {
        return None;
    }
    let v = direction_verdict(
        engine.desired(),
        Some(endpoint),
        direction,
        peer,
        record.dport,
        protocol,
    );
    let decided = v.decided_by.filter(|d| d.rule.action == Action::Deny)?;
    let origin = &decided.rule.origin;
    Some(format!(
        "{} tier clusternetworkpolicy {} {} rule {} (Deny)",
        decided.tier,
        origin.policy,
        direction.name(),
        origin.rule_index
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::manifest;

    #[test]
    fn records_name_both_pods_and_the_policies_that_decided() {
        let mut engine = Engine::new(None);
        let objects = manifest::parse_str(
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n---\n\
             apiVersion: v1\nkind: Pod\nmetadata: {name: a, namespace: x, labels: {app: a}}\n\
             spec: {containers: [{name: c, image: i}]}\nstatus: {podIP: 10.0.0.1, phase: Running}\n---\n\
             apiVersion: v1\nkind: Pod\nmetadata: {name: b, namespace: x, labels: {app: b}}\n\
             spec: {containers: [{name: c, image: i}]}\nstatus: {podIP: 10.0.0.2, phase: Running}\n---\n\
             apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: closed, namespace: x}\n\
             spec: {podSelector: {matchLabels: {app: a}}, policyTypes: [Ingress]}\n---\n\
             apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {name: trial, namespace: x, annotations: {policy.weir.io/mode: audit}}\n\
             spec: {podSelector: {matchLabels: {app: b}}, policyTypes: [Egress]}\n",
        )
        .unwrap();
        let (_, errors) = engine.load(objects);
        assert!(errors.is_empty(), "{errors:?}");
        let mut names = PolicyNames::default();
        let (a, b) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut drop =
            VerdictRecord::packet("drop", "policy-deny", "ingress", 6, (b, 4000), (a, 80));
        name(&mut drop, &engine, &mut names);
        assert_eq!(drop.pod.as_deref(), Some("x/a"));
        assert_eq!(
            (drop.src_pod.as_deref(), drop.dst_pod.as_deref()),
            (Some("x/b"), Some("x/a"))
        );
        assert_eq!(
            drop.rule.as_deref(),
            Some("default deny by x/closed (ingress)")
        );
        assert!(!drop.time.is_empty());
        let mut audit =
            VerdictRecord::packet("audit", "policy-allow", "egress", 6, (b, 4000), (a, 80));
        name(&mut audit, &engine, &mut names);
        assert_eq!(audit.pod.as_deref(), Some("x/b"));
        assert_eq!(
            audit.rule.as_deref(),
            Some("x/trial egress audit: would be dropped")
        );
        // A spoofing drop keeps the dataplane's words.
        let mut spoof =
            VerdictRecord::packet("drop", "spoofed-source", "egress", 6, (a, 1), (b, 2));
        spoof.pod = Some("x/b".into());
        spoof.rule = Some("anti-spoofing".into());
        name(&mut spoof, &engine, &mut names);
        assert_eq!(spoof.rule.as_deref(), Some("anti-spoofing"));

        // A ClusterNetworkPolicy Deny names its rule, also beside a NetworkPolicy.
        let cnp = manifest::parse_str(
            "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\n\
             metadata: {name: guard}\nspec: {tier: Admin, priority: 1, subject: {namespaces: {}}, \
             ingress: [{action: Pass, from: [{namespaces: {}}], protocols: [{udp: {destinationPort: {number: 80}}}]}, \
             {action: Deny, from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: b}}}}]}]}\n",
        )
        .unwrap();
        engine.upsert(cnp.into_iter().next().unwrap()).unwrap();
        let mut drop =
            VerdictRecord::packet("drop", "policy-deny", "ingress", 6, (b, 4000), (a, 80));
        name(&mut drop, &engine, &mut names);
        assert_eq!(
            drop.rule.as_deref(),
            Some("Admin tier clusternetworkpolicy guard ingress rule 1 (Deny)")
        );
        // Passed on to the NetworkPolicy, whose default deny drops it.
        let mut drop =
            VerdictRecord::packet("drop", "policy-deny", "ingress", 17, (b, 4000), (a, 80));
        name(&mut drop, &engine, &mut names);
        assert_eq!(
            drop.rule.as_deref(),
            Some("default deny by x/closed (ingress)")
        );
        // A policy added since is named: the lists kept are the engine's revision's.
        let also = manifest::parse_str(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: also, namespace: x}\n\
             spec: {podSelector: {}, policyTypes: [Ingress]}\n",
        )
        .unwrap();
        engine.upsert(also.into_iter().next().unwrap()).unwrap();
        let mut drop =
            VerdictRecord::packet("drop", "policy-deny", "ingress", 17, (b, 4000), (a, 80));
        name(&mut drop, &engine, &mut names);
        assert_eq!(
            drop.rule.as_deref(),
            Some("default deny by x/also,x/closed (ingress)")
        );
    }
}
