//! What the engine needs to know about a pod, extracted once from the k8s `Pod`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::core::v1::Pod;

use super::{FieldError, Labels, PodKey, Protocol};

/// A declared container port; named ones are what `port: <name>` in a policy resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerPort {
    pub name: Option<String>,
    pub number: u16,
    pub protocol: Protocol,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    pub labels: Labels,
    pub ipv4: Option<Ipv4Addr>,
    pub ipv6: Option<Ipv6Addr>,
    pub node: Option<String>,
    pub host_network: bool,
    pub ports: Vec<ContainerPort>,
}

impl PodInfo {
    /// Extracts a pod. Pods that finished (phase Succeeded or Failed) have no addresses:
    /// their IPs may already belong to another pod.
    pub fn from_pod(namespace: &str, name: &str, pod: &Pod) -> Result<Self, FieldError> {
        let spec = pod.spec.as_ref();
        let status = pod.status.as_ref();
        let finished = status
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| p == "Succeeded" || p == "Failed");
        let mut info = PodInfo {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            labels: pod
                .metadata
                .labels
                .iter()
                .flatten()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect(),
            ipv4: None,
            ipv6: None,
            node: spec.and_then(|s| s.node_name.clone()),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            ports: Vec::new(),
        };
        let listed: Vec<(String, &str)> = match status.and_then(|s| s.pod_ips.as_ref()) {
            Some(ips) if !ips.is_empty() => ips
                .iter()
                .enumerate()
                .map(|(i, ip)| (format!("status.podIPs[{i}].ip"), ip.ip.as_str()))
                .collect(),
            _ => status
                .and_then(|s| s.pod_ip.as_deref())
                .map(|ip| vec![("status.podIP".to_owned(), ip)])
                .unwrap_or_default(),
        };
        for (field, text) in listed {
            let addr: IpAddr = text
                .parse()
                .map_err(|_| FieldError::new(&field, format!("invalid IP address {text:?}")))?;
            if finished {
                continue;
            }
            match addr {
                IpAddr::V4(a) => info.ipv4 = info.ipv4.or(Some(a)),
                IpAddr::V6(a) => info.ipv6 = info.ipv6.or(Some(a)),
            }
        }
        for (c, container) in spec
            .map(|s| s.containers.as_slice())
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            for (p, port) in container.ports.iter().flatten().enumerate() {
                let field = format!("spec.containers[{c}].ports[{p}]");
                let number = u16::try_from(port.container_port)
                    .ok()
                    .filter(|n| *n != 0)
                    .ok_or_else(|| {
                        FieldError::new(
                            &format!("{field}.containerPort"),
                            format!("must be between 1 and 65535, got {}", port.container_port),
                        )
                    })?;
                let protocol = parse_protocol(port.protocol.as_deref())
                    .map_err(|e| FieldError::new(&format!("{field}.protocol"), e.to_string()))?;
                info.ports.push(ContainerPort {
                    name: port.name.clone(),
                    number,
                    protocol,
                });
            }
        }
        Ok(info)
    }

    pub fn key(&self) -> PodKey {
        format!("{}/{}", self.namespace, self.name)
    }

    pub fn addresses(&self) -> impl Iterator<Item = IpAddr> {
        let v4 = self.ipv4.map(IpAddr::V4);
        let v6 = self.ipv6.map(IpAddr::V6);
        v4.into_iter().chain(v6)
    }

    /// Whether policies can select this pod (as target or as peer): host-network pods
    /// share the node's addresses and are never selected; pods without addresses have
    /// nothing to enforce.
    pub fn selectable(&self) -> bool {
        !self.host_network && (self.ipv4.is_some() || self.ipv6.is_some())
    }

    /// The number a named port resolves to on this pod, for the given protocol.
    pub fn named_port(&self, name: &str, protocol: Protocol) -> Option<u16> {
        self.ports
            .iter()
            .find(|p| p.protocol == protocol && p.name.as_deref() == Some(name))
            .map(|p| p.number)
    }
}

/// A Kubernetes protocol name; absent means TCP, as the API server defaults it.
pub fn parse_protocol(text: Option<&str>) -> Result<Protocol, ProtocolError> {
    match text {
        None | Some("TCP") => Ok(Protocol::Tcp),
        Some("UDP") => Ok(Protocol::Udp),
        Some("SCTP") => Ok(Protocol::Sctp),
        Some(other) => Err(ProtocolError(other.to_owned())),
    }
}

/// A protocol name Kubernetes does not have.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unsupported value {0:?}: supported values \"TCP\", \"UDP\", \"SCTP\"")]
pub struct ProtocolError(pub String);
