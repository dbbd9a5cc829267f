//! Services in the lab: what the API server's allocators and the controller-manager's
//! endpointslice controller would do, done by the lab, which has neither.
//!
//! - `--services auto` gives every pod a ClusterIP Service named after it, covering all
//!   its declared ports, as the upstream e2e netpol suite does. It selects the pod by a
//!   label the lab adds ([`LAB_POD_LABEL`]); only selectors that name that key can see it.
//! - ClusterIPs (IPv4 only, from [`SERVICE_CIDR`]) and nodePorts are allocated by the lab
//!   for Services that name none, in both modes, so that a Service's address is the same
//!   in objects.yaml, on the lab's API server and for the prober. An address once given
//!   is kept, as the API server keeps it (the field is immutable there).
//! - EndpointSlices (discovery.k8s.io/v1) are derived from the Services and the pods they
//!   select; they are never written to objects.yaml (the agent does not read them), only to
//!   the API server, where kube-proxy reads them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use k8s_openapi::api::core::v1::{ObjectReference, Pod, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::control_plane::SERVICE_CIDR;
use super::objects::{self, ObjectSet};
pub use super::state::ServicesMode;
use super::LabError;
use weir_policy::desired::Protocol;
use weir_policy::model::{Kind, Object, ObjectRef};

/// The label `--services auto` puts on every pod, valued with the pod's name.
pub const LAB_POD_LABEL: &str = "weir.io/lab-pod";
/// Marks a Service the lab made for `--services auto` (value `auto`).
pub const AUTO_SERVICE_LABEL: &str = "weir.io/lab-service";
/// The label kube-proxy finds a Service's EndpointSlices by.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
const MANAGED_BY: &str = "weir-lab";
/// The API server's default `--service-node-port-range`.
const NODE_PORTS: std::ops::RangeInclusive<i32> = 30000..=32767;

/// Completes the lab's Services after an edit: the auto Services (made, updated, or removed
/// with their pod) and the addresses and node ports of Services that name none.
pub fn plan(mode: ServicesMode, before: &ObjectSet, set: &mut ObjectSet) -> Result<(), LabError> {
    if mode == ServicesMode::Auto {
        plan_auto(set)?;
    }
    allocate(before, set)
}

fn plan_auto(set: &mut ObjectSet) -> Result<(), LabError> {
    let mut wanted = BTreeMap::new();
    for object in set.objects.values_mut() {
        let Object::Pod(pod) = object else { continue };
        let name = pod.metadata.name.clone().unwrap_or_default();
        pod.metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert(LAB_POD_LABEL.to_string(), name);
        // A Service needs a port: a pod that declares none gets none.
        if let Some(service) = auto_service(pod)? {
            wanted.insert(Object::Service(service.clone()).key(), service);
        }
    }
    let stale: Vec<ObjectRef> = set
        .objects
        .iter()
        .filter(|(key, o)| is_auto(o) && !wanted.contains_key(*key))
        .map(|(key, _)| key.clone())
        .collect();
    for key in stale {
        set.objects.remove(&key);
    }
    for (key, mut service) in wanted {
        match set.objects.get(&key) {
            Some(o) if !is_auto(o) => {
                return Err(LabError::invalid(
                    format!("Service {}", key_text(&key)),
                    "--services auto names a Service after each pod, and the manifests declare one of that name",
                ))
            }
            Some(Object::Service(old)) => {
                // Keep what was allocated for it.
                let spec = service.spec.get_or_insert_with(Default::default);
                let old_spec = old.spec.clone().unwrap_or_default();
                spec.cluster_ip = old_spec.cluster_ip;
                spec.cluster_ips = old_spec.cluster_ips;
            }
            _ => {}
        }
        set.objects.insert(key, Object::Service(service));
    }
    Ok(())
}

fn is_auto(object: &Object) -> bool {
    matches!(object, Object::Service(s) if label(&s.metadata.labels, AUTO_SERVICE_LABEL) == Some("auto"))
}

fn label<'a>(labels: &'a Option<BTreeMap<String, String>>, key: &str) -> Option<&'a str> {
    labels.as_ref()?.get(key).map(String::as_str)
}

fn key_text(key: &ObjectRef) -> String {
    format!(
        "{}/{}",
        key.namespace.as_deref().unwrap_or_default(),
        key.name
    )
}

/// The Service `--services auto` makes for a pod; none for a pod without ports.
fn auto_service(pod: &Pod) -> Result<Option<Service>, LabError> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    if !is_dns_label(&name) {
        return Err(LabError::invalid(
            format!("Pod {}", objects::pod_key(pod)),
            "--services auto names a Service after each pod, and this name is not a valid Service name (a DNS-1035 label)",
        ));
    }
    let ports = objects::served_ports(pod)?
        .into_iter()
        .map(|p| ServicePort {
            name: Some(format!("{}-{}", p.protocol.name().to_lowercase(), p.port)),
            port: i32::from(p.port),
            protocol: Some(p.protocol.name().to_string()),
            target_port: Some(IntOrString::Int(i32::from(p.port))),
            ..Default::default()
        })
        .collect::<Vec<_>>();
    if ports.is_empty() {
        return Ok(None);
    }
    let mut service = Service::default();
    service.metadata.name = Some(name.clone());
    service.metadata.namespace = pod.metadata.namespace.clone();
    service.metadata.labels = Some(BTreeMap::from([(
        AUTO_SERVICE_LABEL.to_string(),
        "auto".to_string(),
    )]));
    service.spec = Some(ServiceSpec {
        type_: Some("ClusterIP".into()),
        selector: Some(BTreeMap::from([(LAB_POD_LABEL.to_string(), name)])),
        ports: Some(ports),
        ..Default::default()
    });
    Ok(Some(service))
}

fn is_dns_label(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_lowercase()
        && b[b.len() - 1] != b'-'
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// Gives every Service without one a ClusterIP (unless headless or ExternalName) and every
/// NodePort/LoadBalancer port without one a nodePort: the one it had before, or the lowest
/// free. The range's first address is the `kubernetes` Service's, as the API server has it.
fn allocate(before: &ObjectSet, set: &mut ObjectSet) -> Result<(), LabError> {
    let cidr: Ipv4Net = SERVICE_CIDR.parse().expect("SERVICE_CIDR is a CIDR");
    let mut used_ips: BTreeSet<Ipv4Addr> = BTreeSet::from([cidr.network(), first_host(cidr)]);
    let mut used_ports = BTreeSet::new();
    for object in set.objects.values() {
        let Object::Service(s) = object else { continue };
        let spec = s.spec.clone().unwrap_or_default();
        used_ips.extend(spec.cluster_ip.and_then(|ip| ip.parse::<Ipv4Addr>().ok()));
        used_ports.extend(spec.ports.iter().flatten().filter_map(|p| p.node_port));
    }
    for (key, object) in set.objects.iter_mut() {
        let Object::Service(service) = object else {
            continue;
        };
        let old_spec = match before.objects.get(key) {
            Some(Object::Service(old)) => old.spec.clone().unwrap_or_default(),
            _ => ServiceSpec::default(),
        };
        let what = format!("Service {}", key_text(key));
        let spec = service.spec.get_or_insert_with(Default::default);
        let ty = spec.type_.clone().unwrap_or_else(|| "ClusterIP".into());
        if ty == "ExternalName" {
            continue;
        }
        if spec.cluster_ip.is_none() {
            let ip = match old_spec.cluster_ip.as_deref() {
                Some(old) if old != "None" => old.to_string(),
                _ => {
                    let ip = cidr
                        .hosts()
                        .find(|ip| !used_ips.contains(ip))
                        .ok_or_else(|| LabError::AddressesExhausted(SERVICE_CIDR.into()))?;
                    used_ips.insert(ip);
                    ip.to_string()
                }
            };
            spec.cluster_ip = Some(ip.clone());
            spec.cluster_ips = Some(vec![ip]);
        } else if spec.cluster_ips.is_none() {
            spec.cluster_ips = spec.cluster_ip.clone().map(|ip| vec![ip]);
        }
        if let Some(ip) = spec.cluster_ip.as_deref().filter(|ip| *ip != "None") {
            let parsed: Ipv4Addr = ip.parse().map_err(|_| {
                LabError::invalid(
                    &what,
                    format!("spec.clusterIP {ip:?} is not an IPv4 address (the lab's Services are IPv4 only)"),
                )
            })?;
            if !cidr.contains(&parsed) {
                return Err(LabError::invalid(
                    &what,
                    format!("spec.clusterIP {ip} is outside the service range {SERVICE_CIDR}"),
                ));
            }
        }
        if ty != "NodePort" && ty != "LoadBalancer" {
            continue;
        }
        for port in spec.ports.iter_mut().flatten() {
            if port.node_port.is_some() {
                continue;
            }
            let kept = old_spec.ports.iter().flatten().find(|o| {
                o.port == port.port && o.protocol == port.protocol && o.name == port.name
            });
            let node_port = match kept.and_then(|o| o.node_port) {
                Some(p) => p,
                None => {
                    let p = NODE_PORTS
                        .clone()
                        .find(|p| !used_ports.contains(p))
                        .ok_or_else(|| LabError::AddressesExhausted("node ports".into()))?;
                    used_ports.insert(p);
                    p
                }
            };
            port.node_port = Some(node_port);
        }
    }
    Ok(())
}

fn first_host(net: Ipv4Net) -> Ipv4Addr {
    net.hosts().next().unwrap_or(net.network())
}

/// One pod behind one Service: its address and, per Service port that resolves on it,
/// (the Service port, the pod's port).
pub struct Backend<'a> {
    pub service: &'a Service,
    pub service_key: ObjectRef,
    pub pod: &'a Pod,
    pub ip: Ipv4Addr,
    pub ports: Vec<(&'a ServicePort, u16)>,
}

/// Every (Service, selected pod) pair, Services in key order: the pods with an IPv4
/// address in the Service's namespace whose labels include its selector. A Service
/// without a selector has no backends the lab manages. A named targetPort resolves to
/// each pod's containerPort of that name and protocol; a port that does not resolve on a
/// pod is left out for that pod, as the endpointslice controller does.
pub fn backends(set: &ObjectSet) -> Vec<Backend<'_>> {
    let mut out = Vec::new();
    for (key, object) in &set.objects {
        let Object::Service(service) = object else {
            continue;
        };
        let Some(spec) = &service.spec else { continue };
        let Some(selector) = spec.selector.as_ref().filter(|s| !s.is_empty()) else {
            continue;
        };
        for pod in set.pods() {
            if pod.metadata.namespace != key.namespace {
                continue;
            }
            let labels = pod.metadata.labels.clone().unwrap_or_default();
            if !selector.iter().all(|(k, v)| labels.get(k) == Some(v)) {
                continue;
            }
            let Some(ip) = pod_ipv4(pod) else { continue };
            let ports = spec
                .ports
                .iter()
                .flatten()
                .filter_map(|p| Some((p, target_port(pod, p)?)))
                .collect();
            out.push(Backend {
                service,
                service_key: key.clone(),
                pod,
                ip,
                ports,
            });
        }
    }
    out
}

fn pod_ipv4(pod: &Pod) -> Option<Ipv4Addr> {
    let status = pod.status.as_ref()?;
    status
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|ip| ip.ip.parse().ok())
        .next()
}

/// The pod's port a Service port forwards to on this pod.
fn target_port(pod: &Pod, port: &ServicePort) -> Option<u16> {
    match &port.target_port {
        None => u16::try_from(port.port).ok(),
        Some(IntOrString::Int(n)) => u16::try_from(*n).ok().filter(|n| *n != 0),
        Some(IntOrString::String(name)) => {
            let protocol = port.protocol.as_deref().unwrap_or("TCP");
            pod.spec
                .iter()
                .flat_map(|s| &s.containers)
                .flat_map(|c| c.ports.iter().flatten())
                .find(|c| {
                    c.name.as_deref() == Some(name.as_str())
                        && c.protocol.as_deref().unwrap_or("TCP") == protocol
                })
                .and_then(|c| u16::try_from(c.container_port).ok())
        }
    }
}

/// A Service's frontend that reaches one pod's port: what a service probe connects to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frontend {
    /// `NAMESPACE/NAME` of the Service.
    pub service: String,
    pub ip: Ipv4Addr,
    pub port: u16,
}

/// For each (pod `NAMESPACE/NAME`, pod port, protocol), the ClusterIP frontend of the
/// first Service (in namespace/name order, then in its port order) whose backend is that
/// pod on that port. Headless Services have no frontend.
pub fn frontends(set: &ObjectSet) -> BTreeMap<(String, u16, Protocol), Frontend> {
    let mut out = BTreeMap::new();
    for b in backends(set) {
        let spec = b.service.spec.as_ref().expect("backends have a spec");
        let Some(ip) = spec
            .cluster_ip
            .as_deref()
            .and_then(|ip| ip.parse::<Ipv4Addr>().ok())
        else {
            continue;
        };
        for (port, pod_port) in &b.ports {
            let Ok(protocol) = weir_policy::model::parse_protocol(port.protocol.as_deref()) else {
                continue;
            };
            let Ok(service_port) = u16::try_from(port.port) else {
                continue;
            };
            out.entry((objects::pod_key(b.pod), *pod_port, protocol))
                .or_insert_with(|| Frontend {
                    service: key_text(&b.service_key),
                    ip,
                    port: service_port,
                });
        }
    }
    out
}

/// One port of an EndpointSlice: (Service port name, protocol, the pods' port).
type SlicePort = (Option<String>, String, u16);

/// The EndpointSlices the endpointslice controller would keep for the set's Services, by
/// (namespace, name): one IPv4 slice per Service and distinct resolved port list, so pods
/// on which a named port resolves differently are in different slices.
pub fn endpoint_slices(set: &ObjectSet, node: &str) -> BTreeMap<(String, String), EndpointSlice> {
    let mut groups: BTreeMap<(ObjectRef, Vec<SlicePort>), Vec<&Backend>> = BTreeMap::new();
    let all = backends(set);
    for b in &all {
        let ports = b
            .ports
            .iter()
            .map(|(p, n)| {
                (
                    p.name.clone(),
                    p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                    *n,
                )
            })
            .collect();
        groups
            .entry((b.service_key.clone(), ports))
            .or_default()
            .push(b);
    }
    let mut out = BTreeMap::new();
    for ((key, ports), members) in groups {
        let namespace = key.namespace.clone().unwrap_or_default();
        let name = format!("{}-{:08x}", key.name, fnv(&format!("{ports:?}")) as u32);
        let mut slice = EndpointSlice {
            address_type: "IPv4".into(),
            endpoints: Some(
                members
                    .iter()
                    .map(|b| Endpoint {
                        addresses: vec![b.ip.to_string()],
                        conditions: Some(EndpointConditions {
                            ready: Some(true),
                            serving: Some(true),
                            terminating: Some(false),
                        }),
                        node_name: Some(node.to_string()),
                        target_ref: Some(ObjectReference {
                            kind: Some("Pod".into()),
                            namespace: b.pod.metadata.namespace.clone(),
                            name: b.pod.metadata.name.clone(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ports: Some(
                ports
                    .into_iter()
                    .map(|(name, protocol, port)| EndpointPort {
                        name: Some(name.unwrap_or_default()),
                        port: Some(i32::from(port)),
                        protocol: Some(protocol),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        };
        slice.metadata.name = Some(name.clone());
        slice.metadata.namespace = Some(namespace.clone());
        slice.metadata.labels = Some(BTreeMap::from([
            (SERVICE_NAME_LABEL.to_string(), key.name.clone()),
            (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        ]));
        out.insert((namespace, name), slice);
    }
    out
}

fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What kube-proxy must have programmed for the set: every ClusterIP that has backends,
/// and every backend `ip:port`.
pub fn programmed(set: &ObjectSet) -> (BTreeSet<Ipv4Addr>, BTreeSet<(Ipv4Addr, u16)>) {
    let mut ips = BTreeSet::new();
    let mut endpoints = BTreeSet::new();
    for b in backends(set) {
        if b.ports.is_empty() {
            continue;
        }
        let spec = b.service.spec.as_ref().expect("backends have a spec");
        ips.extend(
            spec.cluster_ip
                .as_deref()
                .and_then(|ip| ip.parse::<Ipv4Addr>().ok()),
        );
        endpoints.extend(b.ports.iter().map(|(_, n)| (b.ip, *n)));
    }
    (ips, endpoints)
}

/// The ClusterIPs of the set's Services (to tell which ones went away).
pub fn cluster_ips(set: &ObjectSet) -> BTreeSet<Ipv4Addr> {
    set.objects
        .values()
        .filter_map(|o| match o {
            Object::Service(s) => s.spec.as_ref()?.cluster_ip.as_deref()?.parse().ok(),
            _ => None,
        })
        .collect()
}

/// Whether the set has a Service at all (kind Service), for messages.
pub fn has_services(set: &ObjectSet) -> bool {
    set.objects.keys().any(|k| k.kind == Kind::Service)
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::manifest;

    const WORLD: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: dns-a, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  containers:
  - name: c
    ports:
    - {containerPort: 53, protocol: UDP, name: dns}
    - {containerPort: 53, protocol: TCP, name: dns-tcp}
status: {podIPs: [{ip: 10.244.0.2}]}
---
apiVersion: v1
kind: Pod
metadata: {name: dns-b, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  containers:
  - name: c
    ports:
    - {containerPort: 5353, protocol: UDP, name: dns}
status: {podIPs: [{ip: 10.244.0.3}]}
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system}
spec:
  selector: {k8s-app: kube-dns}
  ports:
  - {name: dns, port: 53, protocol: UDP, targetPort: dns}
  - {name: dns-tcp, port: 53, protocol: TCP, targetPort: dns-tcp}
---
apiVersion: v1
kind: Service
metadata: {name: np, namespace: kube-system}
spec:
  type: NodePort
  selector: {k8s-app: kube-dns}
  ports: [{port: 8053, protocol: UDP, targetPort: 53}]
"#;

    fn world() -> ObjectSet {
        let mut set = ObjectSet::default();
        for o in manifest::parse_str(WORLD).unwrap() {
            set.apply(o);
        }
        set
    }

    #[test]
    fn addresses_are_allocated_once_and_kept() {
        let mut set = world();
        plan(ServicesMode::None, &ObjectSet::default(), &mut set).unwrap();
        let ips = cluster_ips(&set);
        assert_eq!(
            ips,
            BTreeSet::from(["10.96.0.2".parse().unwrap(), "10.96.0.3".parse().unwrap()])
        );
        let before = set.clone();
        let mut again = world();
        plan(ServicesMode::None, &before, &mut again).unwrap();
        assert_eq!(again, before);
        let Some(Object::Service(np)) =
            set.objects
                .get(&ObjectRef::new(Kind::Service, Some("kube-system"), "np"))
        else {
            panic!("np")
        };
        assert_eq!(
            np.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].node_port,
            Some(30000)
        );
    }

    #[test]
    fn named_ports_resolve_per_pod_into_separate_slices() {
        let mut set = world();
        plan(ServicesMode::None, &ObjectSet::default(), &mut set).unwrap();
        let slices = endpoint_slices(&set, "lab-node");
        let dns: Vec<_> = slices
            .values()
            .filter(|s| s.metadata.labels.as_ref().unwrap()[SERVICE_NAME_LABEL] == "kube-dns")
            .collect();
        assert_eq!(dns.len(), 2, "{dns:#?}");
        let ports: BTreeSet<Vec<(i32, String)>> = dns
            .iter()
            .map(|s| {
                s.ports
                    .iter()
                    .flatten()
                    .map(|p| (p.port.unwrap(), p.protocol.clone().unwrap()))
                    .collect()
            })
            .collect();
        assert_eq!(
            ports,
            BTreeSet::from([
                vec![(53, "UDP".into()), (53, "TCP".into())],
                vec![(5353, "UDP".into())]
            ])
        );
        let f = frontends(&set);
        let dns_b = &f[&("kube-system/dns-b".to_string(), 5353, Protocol::Udp)];
        assert_eq!(
            (dns_b.service.as_str(), dns_b.port),
            ("kube-system/kube-dns", 53)
        );
        assert!(!f.contains_key(&("kube-system/dns-b".to_string(), 53, Protocol::Tcp)));
    }

    #[test]
    fn auto_services_follow_pods_and_label_only_their_key() {
        let mut set = world();
        plan(ServicesMode::Auto, &ObjectSet::default(), &mut set).unwrap();
        let auto = ObjectRef::new(Kind::Service, Some("kube-system"), "dns-a");
        assert!(set.objects.contains_key(&auto));
        let pod = set.pods().next().unwrap();
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels.len(), 2);
        assert_eq!(labels[LAB_POD_LABEL], "dns-a");
        let portless = "apiVersion: v1\nkind: Pod\nmetadata: {name: client, namespace: x}\nspec: {containers: [{name: c}]}\n";
        set.apply(manifest::parse_str(portless).unwrap().remove(0));
        plan(ServicesMode::Auto, &ObjectSet::default(), &mut set).unwrap();
        assert!(!set
            .objects
            .contains_key(&ObjectRef::new(Kind::Service, Some("x"), "client")));
        let before = set.clone();
        set.delete(&ObjectRef::new(Kind::Pod, Some("kube-system"), "dns-a"));
        plan(ServicesMode::Auto, &before, &mut set).unwrap();
        assert!(!set.objects.contains_key(&auto));
        let f = frontends(&before);
        assert_eq!(
            f[&("kube-system/dns-a".to_string(), 53, Protocol::Tcp)].service,
            "kube-system/dns-a"
        );
    }
}
