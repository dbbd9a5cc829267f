//! The engine: holds the cluster model and the validated policies, and keeps the
//! compiled [`Desired`] state up to date. Each event recompiles only what it affects (a
//! pod event: that pod's endpoint and the set members it contributes) and returns the
//! [`Delta`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use super::budget::Budget;
use super::change::Change;
use super::compile::{cluster_named_port_groups, compile_endpoint, named_port_groups};
use super::error::PolicyError;
use super::registry::SetRegistry;
use super::selector::Selector;
use super::sets::{pods_in_namespace_matching, NamedPortGroup, SetDef};
use super::spec::{PeerSpec, PolicySpec};
use super::validated::Validated;
use crate::cluster_policy::ClusterPolicySpec;
use crate::desired::{Delta, Desired, Endpoint, Frontend, Peer, PodKey};
use crate::model::{ClusterModel, Kind, Labels, NodeInfo, Object, ObjectRef, PodInfo};

#[derive(Debug)]
pub struct Engine {
    local_node: Option<String>,
    model: ClusterModel,
    policies: BTreeMap<String, PolicySpec>,
    /// Policy keys (`namespace/name`) by namespace.
    policies_by_namespace: HashMap<String, BTreeSet<String>>,
    /// ClusterNetworkPolicies by name. Where a policy key is expected (named-port group
    /// users), a cluster policy's is its name, which has no `/`.
    cluster_policies: BTreeMap<String, ClusterPolicySpec>,
    registry: SetRegistry,
    /// Frontends by Service (`namespace/name`); their union is `desired.frontends`.
    services: BTreeMap<String, BTreeSet<Frontend>>,
    desired: Desired,
    /// What one object may take of the node's tables ([`crate::budget`]).
    budget: Budget,
    /// Moved by every call that may change what the engine holds (see
    /// [`Engine::revision`]).
    revision: u64,
}

impl Engine {
    /// `local_node`: the node whose pods are endpoints; `None` makes every pod local.
    pub fn new(local_node: Option<String>) -> Self {
        Engine {
            local_node,
            model: ClusterModel::default(),
            policies: BTreeMap::new(),
            policies_by_namespace: HashMap::new(),
            cluster_policies: BTreeMap::new(),
            registry: SetRegistry::default(),
            services: BTreeMap::new(),
            desired: Desired::default(),
            budget: Budget::UNLIMITED,
            revision: 0,
        }
    }

    /// A number that every call that may change the engine's objects or desired state
    /// moves: what is derived from them (a verdict record's policy names) can be kept
    /// while it stays.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Sets the budget later objects are admitted against ([`Engine::admit`]); objects
    /// admitted already stay. A new engine's is [`Budget::UNLIMITED`]: it admits what
    /// the API server would, and a node's agent sets the node's.
    pub fn set_budget(&mut self, budget: Budget) {
        self.budget = budget;
    }

    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// Whether `object` fits its budget ([`crate::budget`]), decided from its spec before
    /// anything is compiled. A refused object must not be upserted: the engine keeps its
    /// last admitted version, as it does for an invalid one.
    pub fn admit(&self, object: &Validated) -> Result<(), PolicyError> {
        match object {
            Validated::Policy(spec) => {
                self.budget.check(spec)?;
                let key = spec.key();
                let others = self
                    .policies_by_namespace
                    .get(&spec.namespace)
                    .into_iter()
                    .flatten()
                    .filter(|k| **k != key)
                    .filter_map(|k| self.policies.get(k))
                    .fold(0u64, |sum, p| {
                        sum.saturating_add(crate::budget::estimate(p).entries)
                    });
                self.budget.check_namespace(spec, others)
            }
            Validated::Service {
                namespace,
                name,
                frontends,
            } => self.budget.check_service(namespace, name, frontends.len()),
            _ => Ok(()),
        }
    }

    pub fn desired(&self) -> &Desired {
        &self.desired
    }

    pub fn model(&self) -> &ClusterModel {
        &self.model
    }

    pub fn local_node(&self) -> Option<&str> {
        self.local_node.as_deref()
    }

    /// The validated policy `namespace/name`.
    pub fn policy(&self, key: &str) -> Option<&PolicySpec> {
        self.policies.get(key)
    }

    /// The policies that select `pod` (in name order).
    pub fn policies_selecting(&self, pod: &PodInfo) -> Vec<&PolicySpec> {
        selecting(&self.policies, &self.policies_by_namespace, pod)
    }

    /// The validated ClusterNetworkPolicy `name`.
    pub fn cluster_policy(&self, name: &str) -> Option<&ClusterPolicySpec> {
        self.cluster_policies.get(name)
    }

    /// The ClusterNetworkPolicies whose subject `pod` is, in evaluation order.
    pub fn cluster_policies_selecting(&self, pod: &PodInfo) -> Vec<&ClusterPolicySpec> {
        cluster_selecting(&self.cluster_policies, &self.model, pod)
    }

    /// What a set id stands for, while the set is in use.
    pub fn set_definition(&self, id: crate::desired::SetId) -> Option<&SetDef> {
        self.registry.definition(id)
    }

    /// Adds or replaces an object. A rejected object leaves the engine unchanged.
    /// The object is validated and admitted against the budget first.
    pub fn upsert(&mut self, object: Object) -> Result<Delta, PolicyError> {
        let valid = Validated::from_object(object)?;
        self.admit(&valid)?;
        Ok(self.upsert_validated(valid))
    }

    /// Adds or replaces an object that its source already validated.
    pub fn upsert_validated(&mut self, object: Validated) -> Delta {
        let (change, service) = self.upsert_change(object);
        self.finish(change, service)
    }

    /// [`Engine::upsert_validated`] that says only whether the desired state changed: what
    /// the agent asks (its dataplanes converge on the whole state), without the copies an
    /// exact [`Delta`] takes.
    pub fn upsert_validated_changed(&mut self, object: Validated) -> bool {
        let (change, service) = self.upsert_change(object);
        self.finish_changed(change, service)
    }

    fn upsert_change(&mut self, object: Validated) -> (Change, bool) {
        self.revision += 1;
        let mut change = Change::default();
        let service = object.kind() == Kind::Service;
        match object {
            Validated::Namespace { name, labels } => {
                self.apply_namespace(&name, Some(labels), &mut change)
            }
            Validated::Pod(pod) => self.apply_pod(&pod.key(), Some(pod), &mut change),
            Validated::Policy(spec) => self.apply_policy(&spec.key(), Some(spec), &mut change),
            Validated::ClusterPolicy(spec) => {
                self.apply_cluster_policy(&spec.name.clone(), Some(spec), &mut change)
            }
            Validated::Node(node) => self.apply_node(&node.name.clone(), Some(node), &mut change),
            // Services compile into nothing per pod; `finish` recounts frontends.
            other @ Validated::Service { .. } => self.store(other),
        }
        (change, service)
    }

    /// Removes an object; removing an unknown object changes nothing.
    pub fn delete(&mut self, key: &ObjectRef) -> Delta {
        let change = self.delete_change(key);
        self.finish(change, key.kind == Kind::Service)
    }

    /// [`Engine::delete`] that says only whether the desired state changed.
    pub fn delete_changed(&mut self, key: &ObjectRef) -> bool {
        let change = self.delete_change(key);
        self.finish_changed(change, key.kind == Kind::Service)
    }

    fn delete_change(&mut self, key: &ObjectRef) -> Change {
        self.revision += 1;
        let mut change = Change::default();
        let qualified = key.qualified_name();
        match key.kind {
            Kind::Namespace => self.apply_namespace(&key.name, None, &mut change),
            Kind::Pod => self.apply_pod(&qualified, None, &mut change),
            Kind::NetworkPolicy => self.apply_policy(&qualified, None, &mut change),
            Kind::ClusterNetworkPolicy => self.apply_cluster_policy(&key.name, None, &mut change),
            Kind::Node => self.apply_node(&key.name, None, &mut change),
            Kind::Service => {
                self.services.remove(&qualified);
            }
        }
        change
    }

    /// Stores many objects, then compiles everything once: the fast path for start-up.
    /// Returns the delta from the previous state and the objects that were rejected.
    pub fn load(&mut self, objects: impl IntoIterator<Item = Object>) -> (Delta, Vec<PolicyError>) {
        let mut errors = Vec::new();
        for object in objects {
            // Admitted one by one against what is stored so far, as events would be (a
            // namespace's budget counts the policies before it).
            match Validated::from_object(object)
                .and_then(|valid| self.admit(&valid).map(|()| valid))
            {
                Ok(valid) => self.stage(valid),
                Err(e) => errors.push(e),
            }
        }
        (self.rebuild(), errors)
    }

    /// Stores an admitted object without compiling anything: [`Engine::rebuild`] compiles
    /// what was staged, once. The cold start's path, where each object is admitted
    /// against the ones staged before it.
    pub fn stage(&mut self, object: Validated) {
        self.store(object);
    }

    /// Stores an object without compiling anything.
    fn store(&mut self, object: Validated) {
        self.revision += 1;
        match object {
            Validated::Namespace { name, labels } => {
                self.model.upsert_namespace(&name, labels);
            }
            Validated::Pod(pod) => {
                self.model.upsert_pod(pod);
            }
            Validated::Policy(spec) => {
                store_policy(
                    &mut self.policies,
                    &mut self.policies_by_namespace,
                    &spec.key(),
                    Some(spec),
                );
            }
            Validated::ClusterPolicy(spec) => {
                self.cluster_policies.insert(spec.name.clone(), spec);
            }
            Validated::Node(node) => {
                self.model.upsert_node(node);
            }
            Validated::Service {
                namespace,
                name,
                frontends,
            } => {
                self.services
                    .insert(format!("{namespace}/{name}"), frontends);
            }
        }
    }

    /// Recompiles everything from the model; returns the delta from the previous state.
    pub fn rebuild(&mut self) -> Delta {
        self.revision += 1;
        let before = std::mem::take(&mut self.desired);
        self.registry.clear();
        for policy in self.cluster_policies.values() {
            for group in cluster_named_port_groups(policy) {
                self.registry
                    .add_group_user(&self.model, &group, &policy.name);
            }
        }
        let mut selected: HashMap<PodKey, Vec<&PolicySpec>> = HashMap::new();
        for policy in self.policies.values() {
            for group in named_port_groups(policy) {
                self.registry
                    .add_group_user(&self.model, &group, &policy.key());
            }
            for pod in
                pods_in_namespace_matching(&self.model, &policy.namespace, &policy.pod_selector)
            {
                if is_endpoint(self.local_node.as_deref(), pod) {
                    selected.entry(pod.key()).or_default().push(policy);
                }
            }
        }
        for pod in self.model.pods() {
            if !is_endpoint(self.local_node.as_deref(), pod) {
                continue;
            }
            let policies = selected
                .get(&pod.key())
                .map(Vec::as_slice)
                .unwrap_or_default();
            let cluster = cluster_selecting(&self.cluster_policies, &self.model, pod);
            let endpoint = compile_endpoint(&mut self.registry, pod, policies, &cluster);
            self.registry.add_refs(endpoint_peers(&endpoint));
            self.desired
                .endpoints
                .insert(endpoint.pod.clone(), endpoint);
        }
        self.registry
            .settle(&self.model, &mut self.desired, &mut Change::default());
        self.desired.frontends = self.all_frontends();
        self.desired.frontend_namespaces = self.frontend_namespaces();
        before.diff(&self.desired)
    }

    /// `services_changed`: the event was a Service's, so the frontends may have changed.
    fn finish(&mut self, mut change: Change, services_changed: bool) -> Delta {
        self.registry
            .settle(&self.model, &mut self.desired, &mut change);
        let mut delta = change.into_delta(&self.desired);
        (delta.frontends_added, delta.frontends_removed) = self.recount_frontends(services_changed);
        delta
    }

    /// [`Engine::finish`] without building the delta: whether anything changed.
    fn finish_changed(&mut self, mut change: Change, services_changed: bool) -> bool {
        self.registry
            .settle(&self.model, &mut self.desired, &mut change);
        let (added, removed) = self.recount_frontends(services_changed);
        change.changed(&self.desired) || !added.is_empty() || !removed.is_empty()
    }

    /// After a Service's event: the frontends added and removed. Two Services may share a
    /// frontend (clusterIPs during a re-creation): the union is recounted rather than this
    /// Service's own added and removed.
    fn recount_frontends(&mut self, services_changed: bool) -> (Vec<Frontend>, Vec<Frontend>) {
        if !services_changed {
            return Default::default();
        }
        let frontends = self.all_frontends();
        self.desired.frontend_namespaces = self.frontend_namespaces();
        if frontends == self.desired.frontends {
            return Default::default();
        }
        let added = frontends
            .difference(&self.desired.frontends)
            .copied()
            .collect();
        let removed = self
            .desired
            .frontends
            .difference(&frontends)
            .copied()
            .collect();
        self.desired.frontends = frontends;
        (added, removed)
    }

    fn all_frontends(&self) -> BTreeSet<Frontend> {
        self.services.values().flatten().copied().collect()
    }

    fn frontend_namespaces(&self) -> BTreeMap<Frontend, String> {
        let mut out = BTreeMap::new();
        for (service, frontends) in &self.services {
            let namespace = service.split_once('/').map_or("", |(ns, _)| ns);
            for f in frontends {
                out.entry(*f).or_insert_with(|| namespace.to_string());
            }
        }
        out
    }

    fn apply_pod(&mut self, key: &str, new: Option<PodInfo>, change: &mut Change) {
        let old = match new {
            Some(pod) => self.model.upsert_pod(pod),
            None => self.model.remove_pod(key),
        };
        let model = &self.model;
        let new = model.pod(key);
        let pods: Vec<&PodInfo> = old.iter().chain(new).collect();

        // Members the pod adds to or removes from the sets in use.
        for (id, def) in self.registry.live() {
            let before = old
                .as_ref()
                .map(|p| def.pod_members(model, p))
                .unwrap_or_default();
            let after = new.map(|p| def.pod_members(model, p)).unwrap_or_default();
            for member in before.iter().filter(|m| !after.contains(m)) {
                // Another pod may still claim the same address (a stale pod, say).
                let claimed = model
                    .pods_with_address(member.net.addr())
                    .any(|p| p.key() != key && def.pod_members(model, p).contains(member));
                if !claimed {
                    change.remove_member(&mut self.desired, id, *member);
                }
            }
            for member in after.iter().filter(|m| !before.contains(m)) {
                change.add_member(&mut self.desired, id, *member);
            }
        }

        // Egress named ports: a new or vanished number changes the rules of every
        // endpoint that a policy using the name selects.
        let changed = self
            .registry
            .refresh_groups(model, |g| pods.iter().any(|p| g.resolves_on(model, p)));
        let mut endpoints = self.endpoints_of(&changed);
        endpoints.insert(key.to_owned());
        self.recompile(endpoints, change);
    }

    fn apply_namespace(&mut self, name: &str, labels: Option<Labels>, change: &mut Change) {
        let before = self.model.namespace_labels(name).into_owned();
        match labels {
            Some(labels) => self.model.upsert_namespace(name, labels),
            None => self.model.remove_namespace(name),
        };
        let model = &self.model;
        let after = model.namespace_labels(name);
        // Namespace labels only matter to namespaceSelector peers whose verdict on this
        // namespace changed: recompute those sets.
        let affected =
            |sel: Option<&Selector>| sel.is_some_and(|s| s.matches(&before) != s.matches(&after));
        resync_sets(
            &self.registry,
            model,
            &mut self.desired,
            |d| affected(d.namespace_selector()),
            change,
        );
        let changed = self
            .registry
            .refresh_groups(model, |g| affected(g.namespace_selector()));
        let mut endpoints = self.endpoints_of(&changed);
        // A ClusterNetworkPolicy's subject may now take in, or leave out, the
        // namespace's pods.
        if self
            .cluster_policies
            .values()
            .any(|p| affected(Some(p.subject.namespace_selector())))
        {
            endpoints.extend(
                model
                    .pods_in_namespace(name)
                    .filter(|p| is_endpoint(self.local_node.as_deref(), p))
                    .map(PodInfo::key),
            );
        }
        self.recompile(endpoints, change);
    }

    fn apply_cluster_policy(
        &mut self,
        name: &str,
        new: Option<ClusterPolicySpec>,
        change: &mut Change,
    ) {
        let groups =
            |p: Option<&ClusterPolicySpec>| p.map(cluster_named_port_groups).unwrap_or_default();
        let new_groups = groups(new.as_ref());
        let old = match new {
            Some(spec) => self.cluster_policies.insert(name.to_owned(), spec),
            None => self.cluster_policies.remove(name),
        };
        self.replace_group_users(name, groups(old.as_ref()), new_groups);
        let mut endpoints = self.endpoints_of(&BTreeSet::from([name.to_owned()]));
        if let Some(old) = &old {
            endpoints.extend(self.cluster_selected_endpoints(old));
        }
        self.recompile(endpoints, change);
    }

    /// Gives `node` the addresses its own interfaces hold (the agent reads its node's:
    /// gateways, bridges, link-local ones). A `nodes` peer selecting that node covers
    /// them as well as its Node's `status.addresses`, which list only some.
    /// Whether the desired state changed.
    pub fn set_own_addresses(&mut self, node: &str, addresses: BTreeSet<IpAddr>) -> bool {
        self.revision += 1;
        let mut change = Change::default();
        if self.model.set_own_addresses(node, addresses) {
            self.resync_node_sets(&mut change);
        }
        self.finish_changed(change, false)
    }

    /// Whether any live set is a `nodes` peer's (only then do the node's own addresses
    /// matter).
    pub fn has_node_peers(&self) -> bool {
        self.registry
            .live()
            .any(|(_, d)| matches!(d, SetDef::Peer(PeerSpec::Nodes(_))))
    }

    fn resync_node_sets(&mut self, change: &mut Change) {
        resync_sets(
            &self.registry,
            &self.model,
            &mut self.desired,
            |d| matches!(d, SetDef::Peer(PeerSpec::Nodes(_))),
            change,
        );
    }

    /// A Node's labels and addresses decide the members of `nodes` peers' sets.
    fn apply_node(&mut self, name: &str, new: Option<NodeInfo>, change: &mut Change) {
        match new {
            Some(node) => self.model.upsert_node(node),
            None => self.model.remove_node(name),
        };
        self.resync_node_sets(change);
    }

    fn apply_policy(&mut self, key: &str, new: Option<PolicySpec>, change: &mut Change) {
        let new_groups = new.as_ref().map(named_port_groups).unwrap_or_default();
        let old = store_policy(
            &mut self.policies,
            &mut self.policies_by_namespace,
            key,
            new,
        );
        let old_groups = old.as_ref().map(named_port_groups).unwrap_or_default();
        self.replace_group_users(key, old_groups, new_groups);
        let mut endpoints = self.endpoints_of(&BTreeSet::from([key.to_owned()]));
        if let Some(old) = &old {
            endpoints.extend(self.selected_endpoints(old));
        }
        self.recompile(endpoints, change);
    }

    /// Policy `key` uses the named-port groups `new` where it used `old`.
    fn replace_group_users(
        &mut self,
        key: &str,
        old: Vec<NamedPortGroup>,
        new: Vec<NamedPortGroup>,
    ) {
        for group in &new {
            self.registry.add_group_user(&self.model, group, key);
        }
        for group in old.iter().filter(|g| !new.contains(g)) {
            self.registry.remove_group_user(group, key);
        }
    }

    /// Local endpoints selected by the named policies (NetworkPolicies by
    /// `namespace/name`, ClusterNetworkPolicies by name).
    fn endpoints_of(&self, policies: &BTreeSet<String>) -> BTreeSet<PodKey> {
        let namespaced = policies
            .iter()
            .filter_map(|k| self.policies.get(k))
            .flat_map(|p| self.selected_endpoints(p));
        let cluster = policies
            .iter()
            .filter_map(|k| self.cluster_policies.get(k))
            .flat_map(|p| self.cluster_selected_endpoints(p));
        namespaced.chain(cluster).collect()
    }

    /// Local endpoints that are `policy`'s subjects. Looked for among the compiled
    /// endpoints (every pod that is one has been compiled: a pod's own change recompiles
    /// it), not among every pod of the namespaces the subject selects: a node holds a
    /// hundred pods, the cluster tens of thousands.
    fn cluster_selected_endpoints(&self, policy: &ClusterPolicySpec) -> Vec<PodKey> {
        let model = &self.model;
        self.desired
            .endpoints
            .keys()
            .filter_map(|key| model.pod(key))
            .filter(|p| is_endpoint(self.local_node.as_deref(), p))
            .filter(|p| {
                policy
                    .subject
                    .namespace_selector()
                    .matches(&model.namespace_labels(&p.namespace))
            })
            .filter(|p| {
                policy
                    .subject
                    .selects(p, &model.namespace_labels(&p.namespace))
            })
            .map(PodInfo::key)
            .collect()
    }

    fn selected_endpoints(&self, policy: &PolicySpec) -> Vec<PodKey> {
        pods_in_namespace_matching(&self.model, &policy.namespace, &policy.pod_selector)
            .into_iter()
            .filter(|p| is_endpoint(self.local_node.as_deref(), p))
            .map(PodInfo::key)
            .collect()
    }

    fn recompile(&mut self, endpoints: BTreeSet<PodKey>, change: &mut Change) {
        for key in endpoints {
            change.touch_endpoint(&self.desired, &key);
            let pod = self
                .model
                .pod(&key)
                .filter(|p| is_endpoint(self.local_node.as_deref(), p));
            let old = match pod {
                Some(pod) => {
                    let policies = selecting(&self.policies, &self.policies_by_namespace, pod);
                    let cluster = cluster_selecting(&self.cluster_policies, &self.model, pod);
                    let endpoint = compile_endpoint(&mut self.registry, pod, &policies, &cluster);
                    self.registry.add_refs(endpoint_peers(&endpoint));
                    self.desired.endpoints.insert(key, endpoint)
                }
                None => self.desired.endpoints.remove(&key),
            };
            if let Some(old) = old {
                self.registry.remove_refs(endpoint_peers(&old));
            }
        }
    }
}

/// A pod the dataplane enforces for: selectable and on the local node.
fn is_endpoint(local_node: Option<&str>, pod: &PodInfo) -> bool {
    pod.selectable() && local_node.is_none_or(|n| pod.node.as_deref() == Some(n))
}

fn selecting<'p>(
    policies: &'p BTreeMap<String, PolicySpec>,
    by_namespace: &HashMap<String, BTreeSet<String>>,
    pod: &PodInfo,
) -> Vec<&'p PolicySpec> {
    by_namespace
        .get(&pod.namespace)
        .into_iter()
        .flatten()
        .filter_map(|key| policies.get(key))
        .filter(|p| p.selects(pod))
        .collect()
}

/// Replaces (or removes, with `None`) policy `key`; returns the previous version.
fn store_policy(
    policies: &mut BTreeMap<String, PolicySpec>,
    by_namespace: &mut HashMap<String, BTreeSet<String>>,
    key: &str,
    new: Option<PolicySpec>,
) -> Option<PolicySpec> {
    let old = policies.remove(key);
    if let Some(old) = &old {
        if let Some(keys) = by_namespace.get_mut(&old.namespace) {
            keys.remove(key);
            if keys.is_empty() {
                by_namespace.remove(&old.namespace);
            }
        }
    }
    if let Some(spec) = new {
        by_namespace
            .entry(spec.namespace.clone())
            .or_default()
            .insert(key.to_owned());
        policies.insert(key.to_owned(), spec);
    }
    old
}

/// Recomputes the members of the live sets `which` picks, from the model.
fn resync_sets(
    registry: &SetRegistry,
    model: &ClusterModel,
    desired: &mut Desired,
    which: impl Fn(&SetDef) -> bool,
    change: &mut Change,
) {
    for (id, def) in registry.live().filter(|(_, d)| which(d)) {
        let members = def.members(model);
        let current = desired
            .sets
            .get(&id)
            .map(|s| s.members.clone())
            .unwrap_or_default();
        for m in current.difference(&members) {
            change.remove_member(desired, id, *m);
        }
        for m in members.difference(&current) {
            change.add_member(desired, id, *m);
        }
    }
}

/// The ClusterNetworkPolicies whose subject `pod` is, in evaluation order.
fn cluster_selecting<'p>(
    policies: &'p BTreeMap<String, ClusterPolicySpec>,
    model: &ClusterModel,
    pod: &PodInfo,
) -> Vec<&'p ClusterPolicySpec> {
    if policies.is_empty() {
        return Vec::new();
    }
    let labels = model.namespace_labels(&pod.namespace);
    let mut selecting: Vec<&ClusterPolicySpec> = policies
        .values()
        .filter(|p| p.subject.selects(pod, &labels))
        .collect();
    selecting.sort_by(|a, b| a.precedence().cmp(&b.precedence()));
    selecting
}

/// The peer of every rule of `endpoint`, tier rules included.
fn endpoint_peers(endpoint: &Endpoint) -> impl Iterator<Item = Peer> + '_ {
    [&endpoint.ingress, &endpoint.egress]
        .into_iter()
        .flat_map(|d| {
            let rules = d.rules.iter().map(|r| r.peer);
            rules.chain(d.admin.iter().chain(&d.baseline).map(|r| r.peer))
        })
}
