//! The lab's Kubernetes objects, kept in `objects.yaml` (the file the agent reads), and
//! `kubectl apply` / `kubectl delete` semantics over them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde::Deserialize;

use super::state::{write_atomic, ServedPort};
use super::LabError;
use crate::policy::desired::Protocol;

/// The label a real cluster puts on every Namespace.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

// A lab holds tens of objects: their size difference does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum LabObject {
    Namespace(Namespace),
    Node(Node),
    Pod(Pod),
    NetworkPolicy(NetworkPolicy),
}

/// Kind, namespace, name; the order is the order objects.yaml lists them in.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub kind: Kind,
    pub namespace: String,
    pub name: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Namespace,
    Node,
    Pod,
    NetworkPolicy,
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{:?} {}", self.kind, self.name)
        } else {
            write!(f, "{:?} {}/{}", self.kind, self.namespace, self.name)
        }
    }
}

impl LabObject {
    pub fn key(&self) -> ObjectKey {
        let (kind, meta) = match self {
            LabObject::Namespace(o) => (Kind::Namespace, &o.metadata),
            LabObject::Node(o) => (Kind::Node, &o.metadata),
            LabObject::Pod(o) => (Kind::Pod, &o.metadata),
            LabObject::NetworkPolicy(o) => (Kind::NetworkPolicy, &o.metadata),
        };
        let namespace = match kind {
            Kind::Namespace | Kind::Node => String::new(),
            Kind::Pod | Kind::NetworkPolicy => meta.namespace.clone().unwrap_or_default(),
        };
        ObjectKey {
            kind,
            namespace,
            name: meta.name.clone().unwrap_or_default(),
        }
    }

    fn to_yaml(&self) -> String {
        let yaml = match self {
            LabObject::Namespace(o) => serde_yaml::to_string(o),
            LabObject::Node(o) => serde_yaml::to_string(o),
            LabObject::Pod(o) => serde_yaml::to_string(o),
            LabObject::NetworkPolicy(o) => serde_yaml::to_string(o),
        };
        yaml.expect("Kubernetes objects serialize to YAML")
    }
}

/// Parses Kubernetes YAML (several documents allowed); an error names the file, the
/// document and the problem. Namespaced objects without a namespace get `default`.
pub fn parse(text: &str, origin: &str) -> Result<Vec<LabObject>, LabError> {
    let mut objects = Vec::new();
    for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let at = format!("{origin}, document {}", index + 1);
        let value = serde_yaml::Value::deserialize(document)
            .map_err(|e| LabError::invalid(&at, e.to_string()))?;
        if value.is_null() {
            continue;
        }
        let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or("");
        let typed =
            |e: serde_yaml::Error| LabError::invalid(format!("{at} ({kind})"), e.to_string());
        let mut object = match kind {
            "Namespace" => {
                LabObject::Namespace(serde_yaml::from_value(value.clone()).map_err(typed)?)
            }
            "Node" => LabObject::Node(serde_yaml::from_value(value.clone()).map_err(typed)?),
            "Pod" => LabObject::Pod(serde_yaml::from_value(value.clone()).map_err(typed)?),
            "NetworkPolicy" => {
                LabObject::NetworkPolicy(serde_yaml::from_value(value.clone()).map_err(typed)?)
            }
            other => {
                return Err(LabError::invalid(
                    at,
                    format!("unsupported kind {other:?} (Namespace, Pod, NetworkPolicy, Node)"),
                ))
            }
        };
        default_namespace(&mut object);
        if object.key().name.is_empty() {
            return Err(LabError::invalid(at, "metadata.name is missing"));
        }
        objects.push(object);
    }
    Ok(objects)
}

fn default_namespace(object: &mut LabObject) {
    let meta = match object {
        LabObject::Pod(o) => &mut o.metadata,
        LabObject::NetworkPolicy(o) => &mut o.metadata,
        LabObject::Namespace(_) | LabObject::Node(_) => return,
    };
    meta.namespace.get_or_insert_with(|| "default".to_string());
}

pub fn load_files(paths: &[PathBuf]) -> Result<Vec<LabObject>, LabError> {
    let mut objects = Vec::new();
    for path in paths {
        let text = std::fs::read_to_string(path)
            .map_err(|e| LabError::io(format!("reading {}", path.display()), e))?;
        objects.extend(parse(&text, &path.display().to_string())?);
    }
    Ok(objects)
}

/// Every object of the lab, by key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ObjectSet {
    pub objects: BTreeMap<ObjectKey, LabObject>,
}

impl ObjectSet {
    pub fn load(path: &Path) -> Result<Self, LabError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(LabError::io(format!("reading {}", path.display()), e)),
        };
        let mut set = Self::default();
        for object in parse(&text, &path.display().to_string())? {
            set.objects.insert(object.key(), object);
        }
        Ok(set)
    }

    /// Writes the objects with their generation on the first line, atomically.
    pub fn save(&self, path: &Path, generation: u64) -> Result<(), LabError> {
        let mut text = format!("# generation: {generation}\n");
        for object in self.objects.values() {
            text.push_str("---\n");
            text.push_str(&object.to_yaml());
        }
        write_atomic(path, text.as_bytes())
    }

    /// Creates or replaces an object, as `kubectl apply` would; a Namespace gets its
    /// name label and a Pod's namespace is created if it has no Namespace object yet.
    pub fn apply(&mut self, mut object: LabObject) {
        if let LabObject::Namespace(ns) = &mut object {
            let name = ns.metadata.name.clone().unwrap_or_default();
            ns.metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert(NAMESPACE_NAME_LABEL.to_string(), name);
        }
        let key = object.key();
        if key.kind == Kind::Pod || key.kind == Kind::NetworkPolicy {
            self.ensure_namespace(&key.namespace);
        }
        self.objects.insert(key, object);
    }

    fn ensure_namespace(&mut self, name: &str) {
        let key = ObjectKey {
            kind: Kind::Namespace,
            namespace: String::new(),
            name: name.to_string(),
        };
        if !self.objects.contains_key(&key) {
            let mut ns = Namespace::default();
            ns.metadata.name = Some(name.to_string());
            self.apply(LabObject::Namespace(ns));
        }
    }

    /// Deletes an object; deleting a Namespace deletes everything in it, as in a cluster.
    pub fn delete(&mut self, key: &ObjectKey) {
        self.objects.remove(key);
        if key.kind == Kind::Namespace {
            self.objects.retain(|k, _| k.namespace != key.name);
        }
    }

    pub fn pods(&self) -> impl Iterator<Item = &Pod> {
        self.objects.values().filter_map(|o| match o {
            LabObject::Pod(p) => Some(p),
            _ => None,
        })
    }
}

pub fn parse_protocol(name: &str) -> Result<Protocol, String> {
    match name {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        other => Err(format!("unknown protocol {other:?} (TCP, UDP or SCTP)")),
    }
}

/// The (port, protocol) pairs a Pod's containers declare, deduplicated and sorted.
pub fn served_ports(pod: &Pod) -> Result<Vec<ServedPort>, LabError> {
    let name = format!(
        "Pod {}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    );
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
            let protocol = parse_protocol(p.protocol.as_deref().unwrap_or("TCP"))
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
    fn apply_adds_implicit_namespaces_with_their_name_label() {
        let mut set = ObjectSet::default();
        for o in parse(WORLD, "world.yaml").unwrap() {
            set.apply(o);
        }
        let keys: Vec<String> = set.objects.keys().map(|k| k.to_string()).collect();
        assert_eq!(
            keys,
            [
                "Namespace default",
                "Namespace x",
                "Pod x/a",
                "NetworkPolicy default/deny"
            ]
        );
        let LabObject::Namespace(x) = &set.objects.values().nth(1).unwrap() else {
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
        for o in parse(WORLD, "world.yaml").unwrap() {
            set.apply(o);
        }
        set.save(&path, 7).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("# generation: 7\n"));
        assert_eq!(ObjectSet::load(&path).unwrap(), set);
        set.delete(&ObjectKey {
            kind: Kind::Namespace,
            namespace: String::new(),
            name: "x".into(),
        });
        assert_eq!(set.objects.len(), 2);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn unknown_kind_and_bad_port_are_named() {
        let err = parse("kind: Service\nmetadata: {name: s}\n", "f.yaml").unwrap_err();
        assert_eq!(
            err.to_string(),
            "f.yaml, document 1: unsupported kind \"Service\" (Namespace, Pod, NetworkPolicy, Node)"
        );
        let pod = parse(
            "kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, ports: [{containerPort: 70000}]}]}\n",
            "f.yaml",
        )
        .unwrap();
        let LabObject::Pod(pod) = &pod[0] else {
            panic!("expected a pod")
        };
        let err = served_ports(pod).unwrap_err().to_string();
        assert!(
            err.contains("Pod default/p") && err.contains("spec.containers[0].ports[0]"),
            "{err}"
        );
    }
}
