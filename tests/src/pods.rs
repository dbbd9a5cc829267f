//! A small "node" network namespace with pods attached by veth pairs: pod side `eth0`
//! with a /32 and a default route via 169.254.1.1, node side `lxc-<pod>` with a /32 route
//! to the pod, as CNIs do. Namespace names carry a test tag and the process id.

use std::{
    fs::File,
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::AsRawFd,
    process::Command,
};

pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn sysctl(ns: &str, key: &str, value: &str) {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    let value = value.to_string();
    run_in(ns, move || std::fs::write(&path, value)).expect("sysctl");
}

/// Runs `f` on a thread that has entered network namespace `ns`.
pub fn run_in<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        enter(&ns);
        f()
    })
    .join()
    .expect("namespace thread panicked")
}

/// Moves the calling thread into network namespace `ns`.
pub fn enter(ns: &str) {
    let f = File::open(format!("/var/run/netns/{ns}")).expect("open netns");
    // SAFETY: a valid namespace fd; affects only the calling thread.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {ns}: {}", std::io::Error::last_os_error());
}

pub struct Pod {
    pub name: String,
    pub ns: String,
    pub ip: Ipv4Addr,
    /// fd00:200::<last IPv4 octet>, routed like the IPv4 address (via fd00:ffff::1).
    pub ip6: Ipv6Addr,
    pub host_if: String,
}

/// The node namespace and its pods; deletes all of them on drop.
pub struct World {
    pub node: String,
    pub pods: Vec<Pod>,
}

impl World {
    pub fn new(tag: &str, pods: &[(&str, Ipv4Addr)]) -> World {
        let node = format!("w{tag}-{}-node", std::process::id());
        ip(&["netns", "add", &node]);
        let mut world = World {
            node: node.clone(),
            pods: Vec::new(),
        };
        ip(&["-n", &node, "link", "set", "lo", "up"]);
        sysctl(&node, "net.ipv4.ip_forward", "1");
        sysctl(&node, "net.ipv6.conf.all.forwarding", "1");
        // Link-local addresses usable at once: no duplicate address detection delay.
        sysctl(&node, "net.ipv6.conf.default.accept_dad", "0");
        for (name, addr) in pods {
            let ns = format!("w{tag}-{}-{name}", std::process::id());
            ip(&["netns", "add", &ns]);
            sysctl(&ns, "net.ipv6.conf.default.accept_dad", "0");
            let ip6 = Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, u16::from(addr.octets()[3]));
            world.pods.push(Pod {
                name: name.to_string(),
                ns: ns.clone(),
                ip: *addr,
                ip6,
                host_if: format!("lxc-{name}"),
            });
            let host_if = format!("lxc-{name}");
            ip(&[
                "-n", &node, "link", "add", &host_if, "type", "veth", "peer", "name", "eth0",
                "netns", &ns,
            ]);
            ip(&[
                "-n",
                &node,
                "addr",
                "add",
                "169.254.1.1/32",
                "dev",
                &host_if,
            ]);
            ip(&["-n", &node, "link", "set", &host_if, "up"]);
            ip(&[
                "-n",
                &node,
                "route",
                "add",
                &format!("{addr}/32"),
                "dev",
                &host_if,
            ]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/32"),
                "dev",
                "eth0",
            ]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&[
                "-n",
                &ns,
                "route",
                "add",
                "169.254.1.1",
                "dev",
                "eth0",
                "scope",
                "link",
            ]);
            ip(&[
                "-n",
                &ns,
                "route",
                "add",
                "default",
                "via",
                "169.254.1.1",
                "dev",
                "eth0",
            ]);
            let ip6_net = format!("{ip6}/128");
            ip(&[
                "-n",
                &node,
                "addr",
                "add",
                "fd00:ffff::1/128",
                "dev",
                &host_if,
                "nodad",
            ]);
            ip(&["-n", &node, "-6", "route", "add", &ip6_net, "dev", &host_if]);
            ip(&["-n", &ns, "addr", "add", &ip6_net, "dev", "eth0", "nodad"]);
            ip(&[
                "-n",
                &ns,
                "-6",
                "route",
                "add",
                "fd00:ffff::1",
                "dev",
                "eth0",
            ]);
            ip(&[
                "-n",
                &ns,
                "-6",
                "route",
                "add",
                "default",
                "via",
                "fd00:ffff::1",
            ]);
        }
        world
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods.iter().find(|p| p.name == name).expect("pod")
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for ns in self.pods.iter().map(|p| &p.ns).chain([&self.node]) {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A host off the node: its own namespace (`tag`, deleted on drop, and the veth with it)
/// whose `eth0` is the peer of `uplink` in `node`, addressed `host_cidr` and `node_cidr`
/// (one family; IPv6 without duplicate address detection), with a default route via the
/// node. Its traffic reaches the pods routed through the node, as another node's does.
pub fn off_node_host(
    node: &str,
    tag: &str,
    uplink: &str,
    node_cidr: &str,
    host_cidr: &str,
) -> crate::netns::NetNs {
    let host = crate::netns::NetNs::new(tag).expect("the off-node host's namespace");
    ip(&[
        "-n", node, "link", "add", uplink, "type", "veth", "peer", "name", "eth0", "netns",
        &host.name,
    ]);
    let nodad: &[&str] = if node_cidr.contains(':') {
        &["nodad"]
    } else {
        &[]
    };
    ip(&[
        &["-n", node, "addr", "add", node_cidr, "dev", uplink],
        nodad,
    ]
    .concat());
    ip(&["-n", node, "link", "set", uplink, "up"]);
    ip(&[
        &["-n", &host.name, "addr", "add", host_cidr, "dev", "eth0"],
        nodad,
    ]
    .concat());
    ip(&["-n", &host.name, "link", "set", "eth0", "up"]);
    let gateway = node_cidr.split('/').next().expect("an address");
    ip(&["-n", &host.name, "route", "add", "default", "via", gateway]);
    host
}
