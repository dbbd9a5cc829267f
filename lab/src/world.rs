//! Builds the lab's namespaces and links, wired the way a CNI plugin wires pods, in one
//! of two topologies ([`Topology`]):
//!
//! - routed: a /32 (and /128) on the pod's eth0, a default route via a link-local gateway
//!   that the node answers for, and a host route per pod address through the pod's veth.
//! - bridge: the node's bridge [`BRIDGE`] holds the pools' first addresses as gateways;
//!   each pod's host-side veth is a port of it, and the pod has its address with the
//!   pool's prefix length and a default route via the gateway. The node passes bridged
//!   packets to iptables (`bridge-nf-call-iptables`), as flannel and kubenet nodes do.

use ipnet::{Ipv4Net, Ipv6Net};

use super::netns::{self, ip};
use super::state::{LabState, PodState, Topology};
use super::LabError;

/// The bridge of a bridge-topology node, named as flannel names its own.
pub const BRIDGE: &str = "cni0";

/// The pod network a node's pods are wired into.
#[derive(Clone, Copy, Debug)]
pub struct PodNetwork {
    pub topology: Topology,
    pub ipv4_pool: Ipv4Net,
    pub ipv6_pool: Ipv6Net,
}

/// Here, beside [`PodNetwork`], rather than in the state module, which stays below the
/// modules that act on the lab.
impl LabState {
    /// How this lab's pods are wired.
    pub fn pod_network(&self) -> PodNetwork {
        PodNetwork {
            topology: self.topology,
            ipv4_pool: self.ipv4_pool,
            ipv6_pool: self.ipv6_pool,
        }
    }
}

impl PodNetwork {
    /// The bridge's gateway addresses: the pools' first host addresses (the allocator
    /// never hands them out).
    fn bridge_gateways(&self) -> (Ipv4Net, Ipv6Net) {
        let v4 = self
            .ipv4_pool
            .hosts()
            .next()
            .unwrap_or(self.ipv4_pool.addr());
        let v6 = self
            .ipv6_pool
            .hosts()
            .nth(1)
            .unwrap_or(self.ipv6_pool.addr());
        (
            Ipv4Net::new(v4, self.ipv4_pool.prefix_len()).unwrap_or(self.ipv4_pool),
            Ipv6Net::new(v6, self.ipv6_pool.prefix_len()).unwrap_or(self.ipv6_pool),
        )
    }
}

/// The IPv4 gateway every pod routes through; the node owns it on its loopback, so it
/// answers ARP for it on every veth (as Calico's 169.254.1.1).
const GATEWAY_V4: &str = "169.254.1.1";
/// The Node's InternalIP for kube-proxy and the peers: the node namespace's own address
/// (the pods' gateway, on its loopback).
pub const NODE_IP: &str = GATEWAY_V4;
/// The IPv6 gateway: a link-local address on each host veth.
const GATEWAY_V6: &str = "fe80::1";

/// Creates the node namespace, with forwarding on and the pods' gateway address.
pub fn create_node(node: &str, net: &PodNetwork) -> Result<(), LabError> {
    netns::add(node)?;
    if net.topology == Topology::Bridge {
        create_bridge(node, net)?;
    }
    ip(&[
        "-n",
        node,
        "addr",
        "add",
        &format!("{GATEWAY_V4}/32"),
        "dev",
        "lo",
    ])?;
    netns::sysctl(node, "net.ipv4.ip_forward", "1")?;
    netns::sysctl(node, "net.ipv6.conf.all.forwarding", "1")?;
    Ok(())
}

/// The bridge with the gateway addresses, and br_netfilter switched on for this node:
/// `net.bridge.bridge-nf-call-ip(6)tables` are per network namespace since Linux 5.3, so
/// a kernel without them here (br_netfilter cannot be loaded, or older) is an error.
fn create_bridge(node: &str, net: &PodNetwork) -> Result<(), LabError> {
    let (gw4, gw6) = net.bridge_gateways();
    ip(&["-n", node, "link", "add", BRIDGE, "type", "bridge"])?;
    ip(&["-n", node, "addr", "add", &gw4.to_string(), "dev", BRIDGE])?;
    ip(&[
        "-n",
        node,
        "addr",
        "add",
        &gw6.to_string(),
        "dev",
        BRIDGE,
        "nodad",
    ])?;
    ip(&["-n", node, "link", "set", BRIDGE, "up"])?;
    // A module in distribution kernels, not loaded by creating a bridge (kubelet loads it).
    if !std::path::Path::new("/proc/sys/net/bridge").exists() {
        weir::exec::modules::load("br_netfilter")
            .map_err(|why| LabError::invalid("--topology bridge", why.to_string()))?;
    }
    for key in [
        "net.bridge.bridge-nf-call-iptables",
        "net.bridge.bridge-nf-call-ip6tables",
    ] {
        netns::sysctl(node, key, "1").map_err(|e| {
            LabError::invalid(
                format!("--topology bridge: sysctl {key} in {node}"),
                format!(
                    "{e} (br_netfilter must be loaded, and these sysctls are per network \
                     namespace only on Linux 5.3 and later)"
                ),
            )
        })?;
    }
    Ok(())
}

/// Creates the pod's namespace and veth pair, addresses and routes on both sides.
pub fn create_pod(node: &str, net: &PodNetwork, pod: &PodState) -> Result<(), LabError> {
    let ns = pod.netns.as_str();
    let host = pod.host_if.as_str();
    netns::add(ns)?;
    ip(&[
        "-n", node, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ])?;
    if net.topology == Topology::Bridge {
        return wire_bridged_pod(node, net, pod);
    }
    ip(&[
        "-n",
        node,
        "addr",
        "add",
        &format!("{GATEWAY_V6}/64"),
        "dev",
        host,
        "nodad",
    ])?;
    ip(&["-n", node, "link", "set", host, "up"])?;
    ip(&["-n", ns, "link", "set", "eth0", "up"])?;
    if let Some(v4) = pod.ipv4 {
        ip(&["-n", ns, "addr", "add", &format!("{v4}/32"), "dev", "eth0"])?;
        ip(&[
            "-n", ns, "route", "add", GATEWAY_V4, "dev", "eth0", "scope", "link",
        ])?;
        ip(&[
            "-n", ns, "route", "add", "default", "via", GATEWAY_V4, "dev", "eth0",
        ])?;
        ip(&["-n", node, "route", "add", &format!("{v4}/32"), "dev", host])?;
    }
    if let Some(v6) = pod.ipv6 {
        ip(&[
            "-n",
            ns,
            "addr",
            "add",
            &format!("{v6}/128"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        ip(&[
            "-n", ns, "-6", "route", "add", "default", "via", GATEWAY_V6, "dev", "eth0",
        ])?;
        ip(&[
            "-n",
            node,
            "-6",
            "route",
            "add",
            &format!("{v6}/128"),
            "dev",
            host,
        ])?;
    }
    Ok(())
}

/// The bridge topology's half of [`create_pod`]: the veth's host end becomes a bridge
/// port; the pod's addresses are on the pool's subnet, its gateway the bridge's.
fn wire_bridged_pod(node: &str, net: &PodNetwork, pod: &PodState) -> Result<(), LabError> {
    let ns = pod.netns.as_str();
    let host = pod.host_if.as_str();
    let (gw4, gw6) = net.bridge_gateways();
    ip(&["-n", node, "link", "set", host, "master", BRIDGE])?;
    ip(&["-n", node, "link", "set", host, "up"])?;
    // Announce the pod's addresses when eth0 comes up (gratuitous ARP, unsolicited
    // neighbour advertisements), as CNI plugins do: a reused address is at a new MAC, and
    // the other pods on the bridge must not keep sending to the old one.
    netns::sysctl(ns, "net.ipv4.conf.eth0.arp_notify", "1")?;
    netns::sysctl(ns, "net.ipv6.conf.eth0.ndisc_notify", "1")?;
    if let Some(v4) = pod.ipv4 {
        let addr = format!("{v4}/{}", net.ipv4_pool.prefix_len());
        ip(&["-n", ns, "addr", "add", &addr, "dev", "eth0"])?;
    }
    if let Some(v6) = pod.ipv6 {
        let addr = format!("{v6}/{}", net.ipv6_pool.prefix_len());
        ip(&["-n", ns, "addr", "add", &addr, "dev", "eth0", "nodad"])?;
    }
    ip(&["-n", ns, "link", "set", "eth0", "up"])?;
    if pod.ipv4.is_some() {
        let gw = gw4.addr().to_string();
        ip(&[
            "-n", ns, "route", "add", "default", "via", &gw, "dev", "eth0",
        ])?;
    }
    if pod.ipv6.is_some() {
        let gw = gw6.addr().to_string();
        ip(&[
            "-n", ns, "-6", "route", "add", "default", "via", &gw, "dev", "eth0",
        ])?;
    }
    Ok(())
}

/// Deletes the pod's veth pair and namespace; its routes go with them. The pair is
/// deleted first, by its node end: the kernel destroys a deleted namespace's devices
/// later, in a work queue, and a pod re-created at once under the same name (its node
/// end's name comes from it) would find the old device still there ("File exists").
pub fn delete_pod(node: &str, pod: &PodState) -> Result<(), LabError> {
    let host = pod.host_if.as_str();
    if ip(&["-n", node, "link", "show", "dev", host]).is_ok() {
        ip(&["-n", node, "link", "del", "dev", host])?;
    }
    netns::delete(&pod.netns)
}
