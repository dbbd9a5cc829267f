//! Validation of a NetworkPolicy as the API server does it, producing the [`PolicySpec`]
//! the compiler uses. Every error names the policy and the field.

use std::collections::BTreeSet;

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::error::PolicyError;
use super::names::{parse_cidr, port_name_problem};
use super::selector::Selector;
use super::spec::{
    NamespaceScope, PeerSpec, PolicySpec, PortMatch, PortSpec, RuleSpec, MODE_ANNOTATION,
};
use crate::desired::PortRange;
use crate::model::{parse_protocol, FieldError, Object, ObjectRef};

/// Checks `policy` as the API server would; `Ok` means the engine accepts it.
pub fn validate(policy: &NetworkPolicy) -> Result<(), PolicyError> {
    parse_policy(policy).map(|_| ())
}

/// Validates `policy` and returns its compiled form.
pub fn parse_policy(policy: &NetworkPolicy) -> Result<PolicySpec, PolicyError> {
    let object = Object::NetworkPolicy(policy.clone()).key();
    parse(&object, policy).map_err(|e| PolicyError::invalid(&object, e))
}

fn parse(object: &ObjectRef, policy: &NetworkPolicy) -> Result<PolicySpec, FieldError> {
    if object.name.is_empty() {
        return Err(FieldError::new("metadata.name", "required"));
    }
    let default_spec = NetworkPolicySpec::default();
    let spec = policy.spec.as_ref().unwrap_or(&default_spec);
    let pod_selector = spec
        .pod_selector
        .as_ref()
        .map(|s| Selector::parse(s, "spec.podSelector"))
        .transpose()?
        .unwrap_or_default();
    let namespace = object.namespace.clone().unwrap_or_default();
    let ingress_rules = spec.ingress.iter().flatten().enumerate().map(|(i, r)| {
        let field = format!("spec.ingress[{i}]");
        parse_rule(
            &namespace,
            &field,
            "from",
            r.from.as_deref(),
            r.ports.as_deref(),
        )
    });
    let ingress_rules = ingress_rules.collect::<Result<Vec<_>, _>>()?;
    let egress_rules = spec.egress.iter().flatten().enumerate().map(|(i, r)| {
        let field = format!("spec.egress[{i}]");
        parse_rule(
            &namespace,
            &field,
            "to",
            r.to.as_deref(),
            r.ports.as_deref(),
        )
    });
    let egress_rules = egress_rules.collect::<Result<Vec<_>, _>>()?;

    // policyTypes defaulting: Ingress always, Egress when there are egress rules.
    let (mut applies_ingress, mut applies_egress) = (true, !egress_rules.is_empty());
    if let Some(types) = &spec.policy_types {
        if types.len() > 2 {
            return Err(FieldError::new(
                "spec.policyTypes",
                "may not specify more than two policyTypes",
            ));
        }
        (applies_ingress, applies_egress) = (false, false);
        for (i, t) in types.iter().enumerate() {
            match t.as_str() {
                "Ingress" => applies_ingress = true,
                "Egress" => applies_egress = true,
                other => {
                    return Err(FieldError::new(
                        &format!("spec.policyTypes[{i}]"),
                        format!(
                            "unsupported value {other:?}: supported values \"Ingress\", \"Egress\""
                        ),
                    ))
                }
            }
        }
    }
    Ok(PolicySpec {
        namespace,
        name: object.name.clone(),
        pod_selector,
        ingress: applies_ingress.then_some(ingress_rules),
        egress: applies_egress.then_some(egress_rules),
        audit: audit_mode(object, policy),
    })
}

/// Whether the policy is annotated `policy.weir.io/mode: audit`. Any value other than
/// `audit` or `enforce` enforces it, with a warning: a typo must not open what the
/// policy closes.
fn audit_mode(object: &ObjectRef, policy: &NetworkPolicy) -> bool {
    let value = policy
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(MODE_ANNOTATION));
    match value.map(String::as_str) {
        None | Some("enforce") => false,
        Some("audit") => true,
        Some(other) => {
            tracing::warn!(
                object = %object,
                "metadata.annotations[\"{MODE_ANNOTATION}\"]: unknown mode {other:?} (audit or enforce): the policy is enforced"
            );
            false
        }
    }
}

fn parse_rule(
    namespace: &str,
    field: &str,
    peers_name: &str,
    peers: Option<&[NetworkPolicyPeer]>,
    ports: Option<&[NetworkPolicyPort]>,
) -> Result<RuleSpec, FieldError> {
    let peers = peers
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(j, p)| parse_peer(namespace, &format!("{field}.{peers_name}[{j}]"), p));
    let peers = peers.collect::<Result<Vec<_>, _>>()?;
    let ports = ports.unwrap_or_default().iter().enumerate();
    let ports = ports.map(|(j, p)| parse_port(&format!("{field}.ports[{j}]"), p));
    Ok(RuleSpec {
        peers,
        ports: ports.collect::<Result<Vec<_>, _>>()?,
    })
}

fn parse_peer(
    namespace: &str,
    field: &str,
    peer: &NetworkPolicyPeer,
) -> Result<PeerSpec, FieldError> {
    let selectors =
        usize::from(peer.pod_selector.is_some()) + usize::from(peer.namespace_selector.is_some());
    if let Some(block) = &peer.ip_block {
        if selectors > 0 {
            return Err(FieldError::new(
                field,
                "may not specify both ipBlock and another peer",
            ));
        }
        let cidr = parse_cidr(&block.cidr)
            .map_err(|e| FieldError::new(&format!("{field}.ipBlock.cidr"), e.to_string()))?;
        let mut except = BTreeSet::new();
        for (k, text) in block.except.iter().flatten().enumerate() {
            let f = format!("{field}.ipBlock.except[{k}]");
            let net = parse_cidr(text).map_err(|e| FieldError::new(&f, e.to_string()))?;
            if !(cidr.contains(&net) && net.prefix_len() > cidr.prefix_len()) {
                return Err(FieldError::new(
                    &f,
                    format!("must be a strict subset of `cidr` ({cidr})"),
                ));
            }
            except.insert(net);
        }
        return Ok(PeerSpec::Block { cidr, except });
    }
    if selectors == 0 {
        return Err(FieldError::new(field, "must specify a peer"));
    }
    let pods = peer
        .pod_selector
        .as_ref()
        .map(|s| Selector::parse(s, &format!("{field}.podSelector")))
        .transpose()?
        .unwrap_or_default();
    let namespaces = match &peer.namespace_selector {
        Some(s) => {
            NamespaceScope::Selected(Selector::parse(s, &format!("{field}.namespaceSelector"))?)
        }
        None => NamespaceScope::Named(namespace.to_owned()),
    };
    Ok(PeerSpec::Pods { namespaces, pods })
}

fn parse_port(field: &str, port: &NetworkPolicyPort) -> Result<PortSpec, FieldError> {
    let protocol = parse_protocol(port.protocol.as_deref())
        .map_err(|e| FieldError::new(&format!("{field}.protocol"), e.to_string()))?;
    let in_range = |n: i32, f: &str| {
        u16::try_from(n).ok().filter(|n| *n != 0).ok_or_else(|| {
            FieldError::new(
                f,
                format!("must be between 1 and 65535, inclusive (got {n})"),
            )
        })
    };
    let end_field = format!("{field}.endPort");
    let end = port.end_port.map(|e| in_range(e, &end_field)).transpose()?;
    let port = match (&port.port, end) {
        (None, Some(_)) => {
            return Err(FieldError::new(
                &end_field,
                "may not be specified when `port` is not specified",
            ))
        }
        (None, None) => PortMatch::Any,
        (Some(IntOrString::String(_)), Some(_)) => {
            return Err(FieldError::new(
                &end_field,
                "may not be specified when `port` is non-numeric",
            ))
        }
        (Some(IntOrString::String(name)), None) => {
            if let Some(p) = port_name_problem(name) {
                return Err(FieldError::new(&format!("{field}.port"), p));
            }
            PortMatch::Named(name.clone())
        }
        (Some(IntOrString::Int(n)), end) => {
            let first = in_range(*n, &format!("{field}.port"))?;
            let last = end.unwrap_or(first);
            if last < first {
                return Err(FieldError::new(
                    &end_field,
                    format!("must be >= port ({first})"),
                ));
            }
            PortMatch::Range(PortRange { first, last })
        }
    };
    Ok(PortSpec { protocol, port })
}
