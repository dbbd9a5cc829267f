//! A small world for the engine's tests (namespaces x, y, z, each with pods a, b, c serving
//! ports 80 and 81 over TCP, UDP and SCTP, named `serve-<port>-<proto>`, at fixed addresses
//! `10.0.<ns>.<pod>`), and a harness that checks every event's delta. The upstream netpol
//! scenarios live in the netpol-scenarios crate (policy/tests/netpol_e2e.rs runs them).
#![allow(dead_code)] // each test file uses a different part

use std::collections::BTreeMap;
use std::fmt::Write as _;

use weir_policy::manifest::parse_str;
use weir_policy::model::Object;
use weir_policy::Engine;

pub const NAMESPACES: [&str; 3] = ["x", "y", "z"];
pub const PODS: [&str; 3] = ["a", "b", "c"];

fn index(names: &[&str], name: &str) -> usize {
    names.iter().position(|n| *n == name).expect("known name") + 1
}

/// `10.0.<ns>.<pod>` and `fd00::<ns>:<pod>`.
pub fn pod_ips(ns: &str, pod: &str) -> (String, String) {
    let (n, p) = (index(&NAMESPACES, ns), index(&PODS, pod));
    (format!("10.0.{n}.{p}"), format!("fd00::{n}:{p}"))
}

/// `{key: value, ...}` of `defaults` overridden and extended by `labels`.
fn label_map(defaults: &[(&str, &str)], labels: &[(&str, &str)]) -> String {
    let mut map: BTreeMap<&str, &str> = defaults.iter().copied().collect();
    map.extend(labels.iter().copied());
    let pairs: Vec<String> = map.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    format!("{{{}}}", pairs.join(", "))
}

/// Namespace `ns` labelled `ns: <ns>` and `labels`.
pub fn namespace_yaml(ns: &str, labels: &[(&str, &str)]) -> String {
    let labels = label_map(&[("ns", ns)], labels);
    format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {ns}\n  labels: {labels}\n")
}

/// Pod `ns/pod` labelled `pod: <pod>` and `labels`, on node-1, serving the world's ports.
pub fn pod_yaml(ns: &str, pod: &str, labels: &[(&str, &str)]) -> String {
    let labels = label_map(&[("pod", pod)], labels);
    let (v4, v6) = pod_ips(ns, pod);
    let mut ports = String::new();
    for port in [80, 81] {
        for proto in ["TCP", "UDP", "SCTP"] {
            let name = format!("serve-{port}-{}", proto.to_lowercase());
            write!(
                ports,
                "\n    - {{name: {name}, containerPort: {port}, protocol: {proto}}}"
            )
            .unwrap();
        }
    }
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {pod}\n  namespace: {ns}\n  labels: {labels}\nspec:\n  nodeName: node-1\n  containers:\n  - name: c\n    ports:{ports}\nstatus:\n  podIPs: [{{ip: \"{v4}\"}}, {{ip: \"{v6}\"}}]\n"
    )
}

/// The world's objects as YAML.
pub fn world_yaml() -> String {
    let mut docs = Vec::new();
    for ns in NAMESPACES {
        docs.push(namespace_yaml(ns, &[]));
        for pod in PODS {
            docs.push(pod_yaml(ns, pod, &[]));
        }
    }
    docs.join("---\n")
}

pub fn objects(yaml: &str) -> Vec<Object> {
    parse_str(yaml).unwrap_or_else(|e| panic!("test manifest: {e}"))
}

/// An engine holding the world and `policies` (YAML), every pod local.
pub fn engine_with(policies: &str) -> Engine {
    let mut engine = Engine::new(None);
    for object in objects(&world_yaml()).into_iter().chain(objects(policies)) {
        engine
            .upsert(object)
            .unwrap_or_else(|e| panic!("rejected: {e}"));
    }
    engine
}

/// A NetworkPolicy manifest; `spec` is YAML, indented under `spec:`.
pub fn policy(ns: &str, name: &str, spec: &str) -> String {
    let spec: String = spec.lines().map(|l| format!("  {l}\n")).collect();
    format!("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n{spec}")
}

/// Applies `delta` to `desired` the way a dataplane would, in the delta's order.
pub fn apply_delta(
    desired: &mut weir_policy::desired::Desired,
    delta: &weir_policy::desired::Delta,
) {
    for set in &delta.sets_added {
        assert!(
            desired.sets.insert(set.id, set.clone()).is_none(),
            "set {} added twice",
            set.id
        );
    }
    for (id, member) in &delta.members_added {
        assert!(
            desired
                .sets
                .get_mut(id)
                .expect("member of a known set")
                .members
                .insert(*member),
            "member {member:?} of {id} added twice"
        );
    }
    for endpoint in &delta.endpoints_added {
        assert!(desired
            .endpoints
            .insert(endpoint.pod.clone(), endpoint.clone())
            .is_none());
    }
    for change in &delta.endpoints_changed {
        let endpoint = change
            .after
            .clone()
            .expect("changed endpoint carries its new state");
        let old = desired
            .endpoints
            .insert(change.pod.clone(), endpoint)
            .expect("changed endpoint existed");
        for (d, rule) in &change.rules_removed {
            assert!(
                old.direction(*d).rules.contains(rule),
                "removed rule {rule:?} was not there"
            );
        }
    }
    for pod in &delta.endpoints_removed {
        assert!(
            desired.endpoints.remove(pod).is_some(),
            "removed endpoint {pod} was not there"
        );
    }
    for (id, member) in &delta.members_removed {
        assert!(
            desired
                .sets
                .get_mut(id)
                .expect("member of a known set")
                .members
                .remove(member),
            "member {member:?} of {id} was not there"
        );
    }
    for id in &delta.sets_removed {
        assert!(
            desired.sets.remove(id).is_some(),
            "removed set {id} was not there"
        );
    }
}

/// Drives an engine event by event and checks after each one that (1) the returned
/// delta, applied to the previous state, gives the new state, (2) the incremental
/// state equals a cold compile of the same objects, and (3) a second engine fed the same
/// events through the agent's cheap calls (`*_changed`) says "changed" exactly when the
/// delta is not empty, and holds the same state.
pub struct Harness {
    pub engine: Engine,
    cheap: Engine,
    cheap_changed: bool,
    local_node: Option<String>,
    objects: BTreeMap<weir_policy::model::ObjectRef, Object>,
    shadow: weir_policy::desired::Desired,
}

impl Harness {
    pub fn new(local_node: Option<&str>) -> Self {
        Harness {
            engine: Engine::new(local_node.map(str::to_owned)),
            cheap: Engine::new(local_node.map(str::to_owned)),
            cheap_changed: false,
            local_node: local_node.map(str::to_owned),
            objects: BTreeMap::new(),
            shadow: Default::default(),
        }
    }

    /// Upserts every object of `yaml`; returns the last delta.
    pub fn upsert(&mut self, yaml: &str) -> weir_policy::desired::Delta {
        let mut last = Default::default();
        for object in objects(yaml) {
            last = self
                .upsert_object(object)
                .unwrap_or_else(|e| panic!("rejected: {e}"));
        }
        last
    }

    pub fn upsert_object(
        &mut self,
        object: Object,
    ) -> Result<weir_policy::desired::Delta, weir_policy::PolicyError> {
        let key = object.key();
        let delta = self.engine.upsert(object.clone())?;
        let valid =
            weir_policy::Validated::from_object(object.clone()).expect("the engine took it");
        self.cheap_changed = self.cheap.upsert_validated_changed(valid);
        self.objects.insert(key, object);
        self.verify(&delta);
        Ok(delta)
    }

    pub fn delete(&mut self, key: &weir_policy::model::ObjectRef) -> weir_policy::desired::Delta {
        let delta = self.engine.delete(key);
        self.cheap_changed = self.cheap.delete_changed(key);
        self.objects.remove(key);
        self.verify(&delta);
        delta
    }

    pub fn object_keys(&self) -> Vec<weir_policy::model::ObjectRef> {
        self.objects.keys().cloned().collect()
    }

    fn verify(&mut self, delta: &weir_policy::desired::Delta) {
        assert_eq!(
            self.cheap_changed,
            !delta.is_empty(),
            "the cheap call's answer differs from the delta: {delta:?}"
        );
        assert_eq!(
            self.cheap.desired(),
            self.engine.desired(),
            "the cheap calls' state differs"
        );
        apply_delta(&mut self.shadow, delta);
        assert_eq!(
            &self.shadow,
            self.engine.desired(),
            "delta applied to the previous state differs from the new state"
        );
        let mut cold = Engine::new(self.local_node.clone());
        let (_, errors) = cold.load(self.objects.values().cloned());
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            cold.desired(),
            self.engine.desired(),
            "incremental state differs from a cold compile"
        );
    }
}

/// A ClusterNetworkPolicy object; `spec` is YAML, indented under `spec:`.
pub fn cluster_policy(name: &str, spec: &str) -> Object {
    let spec: String = spec.lines().map(|l| format!("  {l}\n")).collect();
    let yaml = format!("apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {{name: {name}}}\nspec:\n{spec}");
    Object::ClusterNetworkPolicy(
        serde_yaml::from_str(&yaml).unwrap_or_else(|e| panic!("test manifest: {e}\n{yaml}")),
    )
}
