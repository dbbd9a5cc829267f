//! Service frontends: the addresses and ports kube-proxy rewrites to a backend pod.
//!
//! NetworkPolicy applies to the pod a connection reaches, so a pod's traffic to a
//! frontend is judged after kube-proxy's DNAT, against the backend (the iptables
//! dataplane sees it there anyway, in FORWARD; the eBPF dataplane defers it, see
//! ARCHITECTURE.md). Only the frontends are needed: which backend kube-proxy picks is
//! read off the packet after DNAT, never predicted.

use std::collections::BTreeSet;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;

use crate::desired::{Frontend, Protocol};
use crate::model::FieldError;

/// The frontends of a Service: each clusterIP, externalIP and load-balancer ingress IP
/// with each port, and each nodePort on every node address. ExternalName and headless
/// Services have none (their clients reach the pods themselves).
pub fn frontends(service: &Service) -> Result<BTreeSet<Frontend>, FieldError> {
    let mut out = BTreeSet::new();
    let Some(spec) = &service.spec else {
        return Ok(out);
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Ok(out);
    }
    let mut addresses: Vec<(String, &str)> = Vec::new();
    let cluster_ips = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.clone(),
        _ => spec.cluster_ip.iter().cloned().collect(),
    };
    for (i, ip) in cluster_ips.iter().enumerate() {
        if !ip.is_empty() && ip != "None" {
            addresses.push((format!("spec.clusterIPs[{i}]"), ip));
        }
    }
    for (i, ip) in spec.external_ips.iter().flatten().enumerate() {
        addresses.push((format!("spec.externalIPs[{i}]"), ip));
    }
    let lb = service
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref());
    for (i, ingress) in lb.into_iter().flatten().enumerate() {
        if let Some(ip) = &ingress.ip {
            addresses.push((format!("status.loadBalancer.ingress[{i}].ip"), ip));
        }
    }
    let mut parsed = Vec::new();
    for (field, text) in addresses {
        let addr: IpAddr = text
            .parse()
            .map_err(|_| FieldError::new(&field, format!("{text:?} is not an IP address")))?;
        parsed.push(addr);
    }
    for (i, port) in spec.ports.iter().flatten().enumerate() {
        let protocol = match port.protocol.as_deref().unwrap_or("TCP") {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => Protocol::Sctp,
            other => {
                return Err(FieldError::new(
                    &format!("spec.ports[{i}].protocol"),
                    format!("unsupported value {other:?}: TCP, UDP or SCTP"),
                ))
            }
        };
        let number = |field: &str, n: i32| {
            u16::try_from(n).ok().filter(|p| *p != 0).ok_or_else(|| {
                FieldError::new(
                    &format!("spec.ports[{i}].{field}"),
                    format!("{n} is not a port (1-65535)"),
                )
            })
        };
        let service_port = number("port", port.port)?;
        for addr in &parsed {
            out.insert(Frontend {
                addr: Some(*addr),
                protocol,
                port: service_port,
            });
        }
        if let Some(node_port) = port.node_port {
            out.insert(Frontend {
                addr: None,
                protocol,
                port: number("nodePort", node_port)?,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(yaml: &str) -> Service {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn cluster_ips_external_ips_and_node_ports() {
        let s = service(
            r#"
metadata: {name: dns, namespace: kube-system}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::a"]
  externalIPs: [192.0.2.7]
  ports:
  - {port: 53, protocol: UDP, nodePort: 30053}
  - {port: 53, targetPort: dns-tcp}
"#,
        );
        let f = frontends(&s).unwrap();
        let has = |a: Option<&str>, p: Protocol, port: u16| {
            f.contains(&Frontend {
                addr: a.map(|a| a.parse().unwrap()),
                protocol: p,
                port,
            })
        };
        assert!(has(Some("10.96.0.10"), Protocol::Udp, 53));
        assert!(has(Some("fd00:96::a"), Protocol::Tcp, 53));
        assert!(has(Some("192.0.2.7"), Protocol::Udp, 53));
        assert!(has(None, Protocol::Udp, 30053));
        assert_eq!(f.len(), 7);
    }

    #[test]
    fn headless_and_external_name_have_none() {
        let headless = service("metadata: {name: h}\nspec: {clusterIP: None, ports: [{port: 80}]}");
        assert!(frontends(&headless).unwrap().is_empty());
        let ext =
            service("metadata: {name: e}\nspec: {type: ExternalName, externalName: x.example}");
        assert!(frontends(&ext).unwrap().is_empty());
    }

    #[test]
    fn errors_name_the_field() {
        let bad =
            service("metadata: {name: b}\nspec: {clusterIP: 10.0.0.300, ports: [{port: 80}]}");
        assert_eq!(frontends(&bad).unwrap_err().field, "spec.clusterIPs[0]");
        let bad = service(
            "metadata: {name: b}\nspec: {clusterIP: 10.0.0.3, ports: [{port: 80, protocol: ICMP}]}",
        );
        assert_eq!(frontends(&bad).unwrap_err().field, "spec.ports[0].protocol");
    }
}
