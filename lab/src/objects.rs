//! The lab's Kubernetes objects, kept in `objects.yaml` (the file the agent reads), and
//! `kubectl apply` / `kubectl delete` semantics over them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Namespace, Pod};

use super::state::{write_atomic, ServedPort};
use super::LabError;
use weir::source::manifest as manifest_files;
use weir_policy::desired::Protocol;
use weir_policy::manifest;
use weir_policy::model::{Kind, Object, ObjectRef};
use weir_policy::Engine;

/// The label a real cluster puts on every Namespace.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Reads manifests; an error names the file, the document and the problem.
pub fn load_files(paths: &[PathBuf]) -> Result<Vec<Object>, LabError> {
    manifest_files::load_files(paths).map_err(|e| LabError::invalid("manifest", e.to_string()))
}

fn to_yaml(object: &Object) -> String {
    let yaml = match object {
        Object::Namespace(o) => serde_yaml::to_string(o),
        Object::Node(o) => serde_yaml::to_string(o),
        Object::Pod(o) => serde_yaml::to_string(o),
        Object::NetworkPolicy(o) => serde_yaml::to_string(o),
        Object::Service(o) => serde_yaml::to_string(o),
        Object::ClusterNetworkPolicy(o) => serde_yaml::to_string(o),
    };
    yaml.expect("Kubernetes objects serialize to YAML")
}

/// Every object of the lab, by key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ObjectSet {
    pub objects: BTreeMap<ObjectRef, Object>,
}

impl ObjectSet {
    /// The objects that differ between `from` and `to`, as a (from, to) pair that
    /// [`super::api::sync`] turns into the same writes as the whole sets would.
    pub fn difference(from: &ObjectSet, to: &ObjectSet) -> (ObjectSet, ObjectSet) {
        let differs = |key: &ObjectRef| from.objects.get(key) != to.objects.get(key);
        let only = |set: &ObjectSet| ObjectSet {
            objects: set
                .objects
                .iter()
                .filter(|(key, _)| differs(key))
                .map(|(key, o)| (key.clone(), o.clone()))
                .collect(),
        };
        (only(from), only(to))
    }

    pub fn load(path: &Path) -> Result<Self, LabError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(LabError::io(format!("reading {}", path.display()), e)),
        };
        let objects = manifest::parse_named(&path.display().to_string(), &text)
            .map_err(|e| LabError::invalid("lab objects", e.to_string()))?;
        Ok(Self {
            objects: objects.into_iter().map(|o| (o.key(), o)).collect(),
        })
    }

    /// Writes the objects with their generation on the first line, atomically.
    pub fn save(&self, path: &Path, generation: u64) -> Result<(), LabError> {
        let mut text = format!("# generation: {generation}\n");
        for object in self.objects.values() {
            text.push_str("---\n");
            text.push_str(&to_yaml(object));
        }
        write_atomic(path, text.as_bytes())
    }

    /// Server mode: the agent's Node must exist for its watch to list it.
    pub fn ensure_node(&mut self, name: &str) {
        let key = ObjectRef::new(Kind::Node, None, name);
        self.objects.entry(key).or_insert_with(|| {
            let mut node = k8s_openapi::api::core::v1::Node::default();
            node.metadata.name = Some(name.to_string());
            Object::Node(node)
        });
    }

    /// Creates or replaces an object, as `kubectl apply` would; a Namespace gets its
    /// name label and a Pod's namespace is created if it has no Namespace object yet.
    pub fn apply(&mut self, mut object: Object) {
        if let Object::Namespace(ns) = &mut object {
            let name = ns.metadata.name.clone().unwrap_or_default();
            ns.metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert(NAMESPACE_NAME_LABEL.to_string(), name);
        }
        if let Some(ns) = object.key().namespace {
            self.ensure_namespace(&ns);
        }
        // The key after defaulting, so that a Pod without a namespace lands in `default`.
        let key = object.key();
        set_namespace(&mut object, key.namespace.as_deref());
        self.objects.insert(key, object);
    }

    fn ensure_namespace(&mut self, name: &str) {
        if !self
            .objects
            .contains_key(&ObjectRef::new(Kind::Namespace, None, name))
        {
            let mut ns = Namespace::default();
            ns.metadata.name = Some(name.to_string());
            self.apply(Object::Namespace(ns));
        }
    }

    /// Deletes an object; deleting a Namespace deletes everything in it, as in a cluster.
    pub fn delete(&mut self, key: &ObjectRef) {
        self.objects.remove(key);
        if key.kind == Kind::Namespace {
            self.objects
                .retain(|k, _| k.namespace.as_deref() != Some(key.name.as_str()));
        }
    }

    /// Refuses the set if weir's engine rejects any object in it, naming the first.
    pub fn validate(&self) -> Result<(), LabError> {
        let (_, errors) = Engine::new(None).load(self.objects.values().cloned());
        match errors.first() {
            Some(e) => Err(LabError::invalid(e.object().to_string(), e.to_string())),
            None => Ok(()),
        }
    }

    pub fn pods(&self) -> impl Iterator<Item = &Pod> {
        self.objects.values().filter_map(|o| match o {
            Object::Pod(p) => Some(p),
            _ => None,
        })
    }
}

/// A protocol name as Kubernetes spells it (`TCP`, `UDP`, `SCTP`).
pub fn parse_protocol(name: &str) -> Result<Protocol, String> {
    weir_policy::model::parse_protocol(Some(name)).map_err(|e| e.to_string())
}

fn set_namespace(object: &mut Object, namespace: Option<&str>) {
    let meta = match object {
        Object::Pod(o) => &mut o.metadata,
        Object::NetworkPolicy(o) => &mut o.metadata,
        Object::Service(o) => &mut o.metadata,
        Object::Namespace(_) | Object::Node(_) | Object::ClusterNetworkPolicy(_) => return,
    };
    meta.namespace = namespace.map(str::to_owned);
}

/// `NAMESPACE/NAME` of a Pod, its namespace defaulted as the API server would.
pub fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata
            .namespace
            .as_deref()
            .unwrap_or(weir_policy::model::DEFAULT_NAMESPACE),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The (port, protocol) pairs a Pod's containers declare, deduplicated and sorted.
pub fn served_ports(pod: &Pod) -> Result<Vec<ServedPort>, LabError> {
    let name = format!("Pod {}", pod_key(pod));
    let mut ports = Vec::new();
    let containers = pod.spec.iter().flat_map(|s| &s.containers);
    for (c, container) in containers.enumerate() {
        for (i, p) in container.ports.iter().flatten().enumerate() {
            let field = format!("spec.containers[{c}].ports[{i}]");
            let port = u16::try_from(p.container_port)
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| {
                    LabError::invalid(
                        &name,
                        format!("{field}.containerPort {} is not 1-65535", p.container_port),
                    )
                })?;
            let protocol = weir_policy::model::parse_protocol(p.protocol.as_deref())
                .map_err(|e| LabError::invalid(&name, format!("{field}.protocol: {e}")))?;
            ports.push(ServedPort { port, protocol });
        }
    }
    ports.sort();
    ports.dedup();
    Ok(ports)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORLD: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {pod: a}}
spec:
  containers:
  - name: c
    image: none
    ports:
    - {containerPort: 80, name: serve-80-tcp}
    - {containerPort: 80, protocol: UDP, name: serve-80-udp}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny}
spec: {podSelector: {}}
"#;

    #[test]
    fn the_difference_of_two_sets_is_what_changed_on_each_side() {
        let mut from = ObjectSet::default();
        for o in manifest::parse_str(WORLD).unwrap() {
            from.apply(o);
        }
        let mut to = from.clone();
        let policy = to
            .objects
            .keys()
            .find(|k| k.kind == Kind::NetworkPolicy)
            .unwrap()
            .clone();
        to.delete(&policy);
        let relabelled = manifest::parse_str(
            "{apiVersion: v1, kind: Pod, metadata: {name: a, namespace: x, labels: {pod: b}}, spec: {containers: [{name: c, image: none}]}}",
        )
        .unwrap();
        to.apply(relabelled.into_iter().next().unwrap());
        let (before, after) = ObjectSet::difference(&from, &to);
        let keys = |s: &ObjectSet| s.objects.keys().map(|k| k.to_string()).collect::<Vec<_>>();
        assert_eq!(keys(&before), ["pod x/a", "networkpolicy default/deny"]);
        assert_eq!(keys(&after), ["pod x/a"]);
        assert_eq!(after.objects.values().next(), to.objects.values().nth(2));
        // No difference, no write.
        let (before, after) = ObjectSet::difference(&to, &to);
        assert!(before.objects.is_empty() && after.objects.is_empty());
    }

    #[test]
    fn apply_adds_implicit_namespaces_with_their_name_label() {
        let mut set = ObjectSet::default();
        for o in manifest::parse_str(WORLD).unwrap() {
            set.apply(o);
        }
        let keys: Vec<String> = set.objects.keys().map(|k| k.to_string()).collect();
        assert_eq!(
            keys,
            [
                "namespace default",
                "namespace x",
                "pod x/a",
                "networkpolicy default/deny"
            ]
        );
        let Object::Namespace(x) = &set.objects.values().nth(1).unwrap() else {
            panic!("expected a namespace")
        };
        assert_eq!(
            x.metadata.labels.as_ref().unwrap()[NAMESPACE_NAME_LABEL],
            "x"
        );
        let pod = set.pods().next().unwrap();
        let ports = served_ports(pod).unwrap();
        assert_eq!(
            ports,
            [
                ServedPort {
                    port: 80,
                    protocol: Protocol::Tcp
                },
                ServedPort {
                    port: 80,
                    protocol: Protocol::Udp
                }
            ]
        );
    }

    #[test]
    fn saved_objects_load_back_and_namespace_delete_cascades() {
        let dir = std::env::temp_dir().join(format!("weir-lab-objects-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("objects.yaml");
        let mut set = ObjectSet::default();
        for o in manifest::parse_str(WORLD).unwrap() {
            set.apply(o);
        }
        set.save(&path, 7).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("# generation: 7\n"));
        assert_eq!(ObjectSet::load(&path).unwrap(), set);
        set.delete(&ObjectRef::new(Kind::Namespace, None, "x"));
        assert_eq!(set.objects.len(), 2);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn invalid_policy_and_bad_port_are_named() {
        let mut set = ObjectSet::default();
        for o in manifest::parse_str(WORLD).unwrap() {
            set.apply(o);
        }
        set.validate().unwrap();
        let bad = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: bad, namespace: x}\nspec:\n  podSelector: {}\n  ingress: [{ports: [{port: 81, endPort: 80}]}]\n";
        set.apply(manifest::parse_str(bad).unwrap().remove(0));
        let err = set.validate().unwrap_err().to_string();
        assert!(
            err.contains("networkpolicy x/bad") && err.contains("endPort"),
            "{err}"
        );

        let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, ports: [{containerPort: 70000}]}]}\n";
        let Object::Pod(pod) = manifest::parse_str(pod).unwrap().remove(0) else {
            panic!("expected a pod")
        };
        let err = served_ports(&pod).unwrap_err().to_string();
        assert!(
            err.contains("Pod default/p") && err.contains("spec.containers[0].ports[0]"),
            "{err}"
        );
    }
}
