//! The bench node: a node namespace and two pod namespaces (client and server), wired the
//! way `weir-lab` and CNI plugins wire pods: a /32 on the pod's eth0, a default route via
//! a link-local gateway that the node owns, and a host route per pod through its veth.
use std::net::Ipv4Addr;

use anyhow::Result;

use super::netns::{ip, Netns};
use super::world::{CLIENT_IP, SERVER_IP};

const GATEWAY: &str = "169.254.1.1";

/// The pods' host-side interfaces, in the node: where weir's eBPF programs attach.
pub const HOST_INTERFACES: [&str; 2] = ["lxcclient", "lxcserver"];

pub struct Topology {
    // Pods first: they are dropped (deleted) before the node.
    pub client: Netns,
    pub server: Netns,
    pub node: Netns,
}

impl Topology {
    /// Builds the three namespaces; `tag` keeps concurrent topologies apart.
    pub fn create(tag: &str) -> Result<Self> {
        let node = Netns::create(&format!("{tag}-node"))?;
        ip(&[
            "-n",
            node.name(),
            "addr",
            "add",
            &format!("{GATEWAY}/32"),
            "dev",
            "lo",
        ])?;
        node.sysctl("net.ipv4.ip_forward", "1")?;
        let client = Netns::create(&format!("{tag}-cli"))?;
        let server = Netns::create(&format!("{tag}-srv"))?;
        wire(&node, &client, HOST_INTERFACES[0], CLIENT_IP)?;
        wire(&node, &server, HOST_INTERFACES[1], SERVER_IP)?;
        Ok(Topology {
            client,
            server,
            node,
        })
    }
}

fn wire(node: &Netns, pod: &Netns, host_if: &str, addr: Ipv4Addr) -> Result<()> {
    let (n, p) = (node.name(), pod.name());
    ip(&[
        "-n", n, "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", p,
    ])?;
    ip(&["-n", n, "link", "set", host_if, "up"])?;
    ip(&["-n", p, "link", "set", "eth0", "up"])?;
    ip(&["-n", p, "addr", "add", &format!("{addr}/32"), "dev", "eth0"])?;
    ip(&[
        "-n", p, "route", "add", GATEWAY, "dev", "eth0", "scope", "link",
    ])?;
    ip(&[
        "-n", p, "route", "add", "default", "via", GATEWAY, "dev", "eth0",
    ])?;
    ip(&[
        "-n",
        n,
        "route",
        "add",
        &format!("{addr}/32"),
        "dev",
        host_if,
    ])?;
    Ok(())
}
