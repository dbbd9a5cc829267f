//! Builds the lab's namespaces and links, wired the way a CNI plugin wires pods: a /32
//! (and /128) on the pod's eth0, a default route via a link-local gateway that the node
//! answers for, and a host route per pod address through the pod's veth on the node.

use super::netns::{self, ip};
use super::state::PodState;
use super::LabError;

/// The IPv4 gateway every pod routes through; the node owns it on its loopback, so it
/// answers ARP for it on every veth (as Calico's 169.254.1.1).
const GATEWAY_V4: &str = "169.254.1.1";
/// The IPv6 gateway: a link-local address on each host veth.
const GATEWAY_V6: &str = "fe80::1";

/// Creates the node namespace, with forwarding on and the pods' gateway address.
pub fn create_node(node: &str) -> Result<(), LabError> {
    netns::add(node)?;
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

/// Creates the pod's namespace and veth pair, addresses and routes on both sides.
pub fn create_pod(node: &str, pod: &PodState) -> Result<(), LabError> {
    let ns = pod.netns.as_str();
    let host = pod.host_if.as_str();
    netns::add(ns)?;
    ip(&[
        "-n", node, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ])?;
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

/// Deletes the pod's namespace; its veth pair and routes go with it.
pub fn delete_pod(pod: &PodState) -> Result<(), LabError> {
    netns::delete(&pod.netns)
}
