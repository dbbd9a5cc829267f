//! Kubernetes YAML manifests → [`Object`]s: multi-document files of Namespace, Pod, Node,
//! Service, NetworkPolicy and ClusterNetworkPolicy objects (and `kind: List` of them). Anything else is an error
//! naming the file, the document (1-based) and the kind. Reading the files is the agent's
//! (`weir::source::manifest`).

use serde::Deserialize;
use serde_yaml::Value;

use crate::model::Object;

/// The name [`parse_str`] reports as the file.
pub const INLINE: &str = "<inline>";

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{file}: document {document}: {source}")]
    Yaml {
        file: String,
        document: usize,
        source: serde_yaml::Error,
    },
    #[error("{file}: document {document}: missing `kind` or `apiVersion`")]
    MissingKind { file: String, document: usize },
    #[error("{file}: document {document}: unsupported kind {kind:?} (apiVersion {api_version:?}); expected v1 Namespace, Pod, Node or Service, networking.k8s.io/v1 NetworkPolicy, or policy.networking.k8s.io/v1beta1 or v1alpha2 ClusterNetworkPolicy")]
    UnknownKind {
        file: String,
        document: usize,
        kind: String,
        api_version: String,
    },
}

/// Parses YAML text; errors name the file as [`INLINE`].
pub fn parse_str(text: &str) -> Result<Vec<Object>, ManifestError> {
    parse_named(INLINE, text)
}

/// Parses YAML text; errors name the file as `file`.
pub fn parse_named(file: &str, text: &str) -> Result<Vec<Object>, ManifestError> {
    let mut objects = Vec::new();
    for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let document_number = index + 1;
        let yaml_error = |source| ManifestError::Yaml {
            file: file.to_owned(),
            document: document_number,
            source,
        };
        let value = Value::deserialize(document).map_err(yaml_error)?;
        collect(file, document_number, value, &mut objects)?;
    }
    Ok(objects)
}

/// One document already read as YAML (`document` is 1-based): what a caller that reads the
/// documents itself (the agent's file source) parses them with.
pub fn parse_value(
    file: &str,
    document: usize,
    value: Value,
) -> Result<Vec<Object>, ManifestError> {
    let mut objects = Vec::new();
    collect(file, document, value, &mut objects)?;
    Ok(objects)
}

fn collect(
    file: &str,
    document: usize,
    value: Value,
    objects: &mut Vec<Object>,
) -> Result<(), ManifestError> {
    // Empty documents (a leading `---`, a comment-only header) hold nothing.
    if value.is_null() {
        return Ok(());
    }
    let text = |key: &str| value.get(key).and_then(Value::as_str).map(str::to_owned);
    let (Some(kind), Some(api_version)) = (text("kind"), text("apiVersion")) else {
        return Err(ManifestError::MissingKind {
            file: file.to_owned(),
            document,
        });
    };
    let yaml_error = |source| ManifestError::Yaml {
        file: file.to_owned(),
        document,
        source,
    };
    let object = match (api_version.as_str(), kind.as_str()) {
        ("v1", "List") => {
            let items = value.get("items").cloned().unwrap_or(Value::Null);
            for item in items.as_sequence().into_iter().flatten() {
                collect(file, document, item.clone(), objects)?;
            }
            return Ok(());
        }
        ("v1", "Namespace") => {
            Object::Namespace(serde_yaml::from_value(value).map_err(yaml_error)?)
        }
        ("v1", "Pod") => Object::Pod(serde_yaml::from_value(value).map_err(yaml_error)?),
        ("v1", "Node") => Object::Node(serde_yaml::from_value(value).map_err(yaml_error)?),
        ("v1", "Service") => Object::Service(serde_yaml::from_value(value).map_err(yaml_error)?),
        ("networking.k8s.io/v1", "NetworkPolicy") => {
            Object::NetworkPolicy(serde_yaml::from_value(value).map_err(yaml_error)?)
        }
        // v1beta1 (network-policy-api v0.3.0) has v1alpha2's schema.
        (
            "policy.networking.k8s.io/v1alpha2" | "policy.networking.k8s.io/v1beta1",
            "ClusterNetworkPolicy",
        ) => Object::ClusterNetworkPolicy(serde_yaml::from_value(value).map_err(yaml_error)?),
        _ => {
            return Err(ManifestError::UnknownKind {
                file: file.to_owned(),
                document,
                kind,
                api_version,
            })
        }
    };
    objects.push(object);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Kind;

    #[test]
    fn multi_document_with_header_and_list() {
        let text = "# generation: 3\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n---\n---\napiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Pod\n  metadata: {name: a, namespace: x}\n- apiVersion: networking.k8s.io/v1\n  kind: NetworkPolicy\n  metadata: {name: deny}\n  spec: {podSelector: {}}\n";
        let objects = parse_str(text).unwrap();
        let keys: Vec<String> = objects.iter().map(|o| o.key().to_string()).collect();
        assert_eq!(
            keys,
            ["namespace x", "pod x/a", "networkpolicy default/deny"]
        );
        assert_eq!(objects[1].kind(), Kind::Pod);
    }

    #[test]
    fn cluster_network_policies_are_read_at_v1beta1_and_v1alpha2() {
        for version in ["v1beta1", "v1alpha2"] {
            let text = format!("apiVersion: policy.networking.k8s.io/{version}\nkind: ClusterNetworkPolicy\nmetadata: {{name: deny}}\nspec: {{tier: Admin, priority: 3, subject: {{namespaces: {{}}}}}}\n");
            let objects = parse_str(&text).unwrap();
            let [Object::ClusterNetworkPolicy(p)] = &objects[..] else {
                panic!("{version}: {objects:?}");
            };
            assert_eq!(p.metadata.name.as_deref(), Some("deny"));
            assert_eq!(p.spec.as_ref().and_then(|s| s.priority), Some(3));
        }
        assert!(parse_str("apiVersion: policy.networking.k8s.io/v1\nkind: ClusterNetworkPolicy\nmetadata: {name: x}\n").is_err());
    }

    #[test]
    fn unknown_kind_names_file_document_and_kind() {
        let text = "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n";
        let err = parse_named("world.yaml", text).unwrap_err();
        assert!(
            matches!(&err, ManifestError::UnknownKind { document: 2, kind, .. } if kind == "Deployment")
        );
        let message = err.to_string();
        assert!(
            message.starts_with("world.yaml: document 2: unsupported kind \"Deployment\""),
            "{message}"
        );
    }

    #[test]
    fn bad_documents_are_errors_not_panics() {
        for text in ["kind: Pod\n", "apiVersion: v1\nkind: Pod\nmetadata: 7\n", "a: [", "apiVersion: v1\nkind: Pod\nspec: {containers: [{name: c, ports: [{containerPort: x}]}]}\n"] {
            assert!(parse_str(text).is_err(), "{text}");
        }
    }
}
