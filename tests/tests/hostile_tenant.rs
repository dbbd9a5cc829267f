//! The hostile tenant, with real frames in a `weir-lab`, on both dataplanes: a tenant that
//! writes its own policies, opens flows its policy allows, and then uses the state those
//! flows leave in the dataplane to reach what its policy denies.
//!
//! - **ICMP errors as a covert channel.** `cli`'s egress allows only web:80. It opens
//!   cli:P → web:80, then sends ICMP errors whose inner header reads web:80 → cli:P (an
//!   error about a packet of its own flow) to `other`, which its policy does not allow: they
//!   must not arrive. The same error to web, the flow's own path, arrives; one with more
//!   bytes than an error may carry is judged as a packet of its own (denied).
//! - **Connections end when TCP says so.** web connects to db:5432 (allowed) from a fixed
//!   port and ends the connection (an RST, or FINs); the allowing policy is deleted; a new
//!   SYN from the same port must be refused as a new connection, as one from a fresh port
//!   is, and a bare ACK on the reset tuple must not pass either.
//!
//! - **Tunnels to the node.** cli wraps a packet from web in VXLAN to its node,
//!   which would forward the inner packet from its tunnel device: it must not arrive.
//!
//! Both dataplanes run the same manifest and must give the same outcome for every case,
//! which is also the expected one.

use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::Duration;

use weir_tests::frame_lab::{assert_outcomes, family, FrameLab, Outcomes};
use weir_tests::lab::manifest;
use weir_tests::raw;

const DB_ALLOW_WEB: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-allow-web, namespace: blue}
spec:
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: web}}}]
    ports: [{port: 5432, protocol: TCP}]
"#;

const MANIFEST: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: blue, labels: {ns: blue}}
---
apiVersion: v1
kind: Pod
metadata: {name: cli, namespace: blue, labels: {app: cli}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: blue, labels: {app: web}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 80, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: other, namespace: blue, labels: {app: other}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 7300, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: blue, labels: {app: db}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 5432, protocol: TCP}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: cli-egress-web-80, namespace: blue}
spec:
  podSelector: {matchLabels: {app: cli}}
  policyTypes: [Egress]
  egress:
  - to: [{podSelector: {matchLabels: {app: web}}}]
    ports: [{port: 80, protocol: TCP}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-deny-ingress, namespace: blue}
spec:
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-allow-web, namespace: blue}
spec:
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: web}}}]
    ports: [{port: 5432, protocol: TCP}]
"#;

const CONNECT_TIMEOUT: Duration = Duration::from_millis(2500);
/// Forged errors sent per case.
const ERRORS_SENT: usize = 5;

/// One lab at a time: the probes are timing-sensitive on a small machine.
static SERIAL: Mutex<()> = Mutex::new(());

/// An ICMP destination-unreachable (port unreachable) from `from` to `to`, reporting on
/// the TCP segment `inner_src` → `inner_dst` that carries `marker` and `padding` bytes.
fn icmp_error(
    from: IpAddr,
    to: IpAddr,
    inner_src: SocketAddr,
    inner_dst: SocketAddr,
    marker: &[u8],
    padding: usize,
) -> Vec<u8> {
    let mut payload = marker.to_vec();
    payload.resize(marker.len() + padding, b'.');
    let seg = raw::tcp(inner_src, inner_dst, raw::TCP_ACK, &payload);
    let inner = raw::ip(inner_src.ip(), inner_dst.ip(), raw::IPPROTO_TCP, &seg);
    if from.is_ipv6() {
        let m = raw::icmp(from, to, 1, 4, &inner);
        raw::ip(from, to, raw::IPPROTO_ICMPV6, &m)
    } else {
        let m = raw::icmp(from, to, 3, 3, &inner);
        raw::ip(from, to, raw::IPPROTO_ICMP, &m)
    }
}

/// cli holds a flow to web:80 and forges errors about it (see the module documentation).
fn icmp_error_channel(w: &FrameLab, out: &mut Outcomes) {
    for v6 in [false, true] {
        let f = family(v6);
        let cli = w.pod("cli").addr(v6);
        let web = w.pod("web").addr(v6);
        let other = w.pod("other").addr(v6);
        let port = if v6 { 40301 } else { 40300 };
        let flow = raw::tcp_connect_from(
            &w.pod("cli").netns,
            port,
            SocketAddr::new(web, 80),
            CONNECT_TIMEOUT,
        );
        assert!(flow.is_some(), "{f}: cli → web:80 must connect (the flow)");
        let (web_80, cli_p) = (SocketAddr::new(web, 80), SocketAddr::new(cli, port));
        // An error larger than any error may be: past 576 bytes (IPv4), 1280 (IPv6).
        let oversized = if v6 { 1300 } else { 700 };
        let cases = [
            ("to a pod cli's egress denies", "other", other, 0),
            ("to web, the flow's own path", "web", web, 0),
            (
                "to web, with more bytes than an error may carry",
                "web",
                web,
                oversized,
            ),
        ];
        for (i, (case, to, to_addr, padding)) in cases.into_iter().enumerate() {
            let marker = format!("weir-tenant-icmp-{v6}-{i}");
            let packet = icmp_error(cli, to_addr, web_80, cli_p, marker.as_bytes(), padding);
            let arrived = w.arrivals("cli", to, &[], &packet, marker.as_bytes(), ERRORS_SENT);
            eprintln!("{f} ICMP error {case}: {arrived} of {ERRORS_SENT} arrived");
            out.insert(
                format!("{f} forged ICMP error of cli's flow {case}"),
                arrived > 0,
            );
        }
        drop(flow);
    }
}

/// The lab node's address on every pod link (the routed topology's gateway).
const NODE_GATEWAY: std::net::Ipv4Addr = std::net::Ipv4Addr::new(169, 254, 1, 1);

/// cli (whose egress allows only web:80) wraps a SYN from web to db:5432 (which db admits
/// from web only) in VXLAN to its node, which has a VXLAN device: the node would forward
/// the inner packet from that device, where cli's anti-spoofing does not apply. It must
/// not reach db. (IPIP and GRE, dropped the same way, need kernel modules the host's
/// kernel lacks; VXLAN it has.)
fn tunnels_to_the_node(w: &FrameLab, out: &mut Outcomes) {
    let node = weir_tests::netns::NetNs::attach(&w.node);
    let node_ip = NODE_GATEWAY.to_string();
    for args in [
        &[
            "link",
            "add",
            "wvx0",
            "type",
            "vxlan",
            "id",
            "42",
            "dstport",
            "4789",
            "local",
            &node_ip,
            "nolearning",
        ][..],
        &["link", "set", "wvx0", "up"],
    ] {
        node.ok("ip", args, None)
            .unwrap_or_else(|e| panic!("prerequisite missing: a VXLAN device on the node ({e})"));
    }
    for conf in ["all", "wvx0"] {
        let path = format!("/proc/sys/net/ipv4/conf/{conf}/rp_filter");
        weir_tests::pods::run_in(&w.node, move || std::fs::write(path, "0")).expect("rp_filter");
    }
    let vxlan_mac = raw::mac(&w.node, "wvx0");
    let (cli, web, db) = (w.pod("cli").v4, w.pod("web").v4, w.pod("db").v4);
    let marker = "weir-tunnel-vxlan";
    let seg = raw::tcp(
        SocketAddr::new(web, 40800),
        SocketAddr::new(db, 5432),
        raw::TCP_SYN,
        marker.as_bytes(),
    );
    let inner = raw::ethernet(
        vxlan_mac,
        [0x02, 0, 0, 0, 0, 0x42],
        &[],
        &raw::ip(web, db, raw::IPPROTO_TCP, &seg),
    );
    // VXLAN: the I flag, VNI 42.
    let vxlan = [[0x08u8, 0, 0, 0, 0, 0, 42, 0].as_slice(), &inner].concat();
    let node_addr: IpAddr = NODE_GATEWAY.into();
    let udp = raw::udp(
        SocketAddr::new(cli, 40900),
        SocketAddr::new(node_addr, 4789),
        &vxlan,
    );
    let packet = raw::ip(cli, node_addr, raw::IPPROTO_UDP, &udp);
    out.insert(
        "v4 cli's VXLAN to its node carrying web → db:5432".into(),
        w.reaches("cli", "db", &[], &packet, marker.as_bytes()),
    );
}

/// Ends `conn` with an RST (SO_LINGER 0, then close), as an abortive close does.
fn reset(conn: std::net::TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid linger on a socket we own.
    let rc = unsafe {
        libc::setsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as u32,
        )
    };
    assert_eq!(rc, 0, "SO_LINGER: {}", std::io::Error::last_os_error());
    drop(conn);
}

/// Ends `conn` gracefully: our FIN, then the peer's (read to EOF), within a deadline.
fn finish(mut conn: std::net::TcpStream) {
    conn.shutdown(std::net::Shutdown::Write).expect("shutdown");
    conn.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut buf = [0u8; 256];
    while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
}

/// Whether a raw segment with `flags` from web:`port` to db:5432 reaches db.
fn segment_reaches_db(w: &FrameLab, port: u16, flags: u8, marker: &str) -> bool {
    let web = w.pod("web").v4;
    let db = w.pod("db").v4;
    let seg = raw::tcp(
        SocketAddr::new(web, port),
        SocketAddr::new(db, 5432),
        flags,
        marker.as_bytes(),
    );
    let packet = raw::ip(web, db, raw::IPPROTO_TCP, &seg);
    w.reaches("web", "db", &[], &packet, marker.as_bytes())
}

/// web's connections to db:5432 end (RST, FIN), the allowing policy is deleted, and web
/// tries again from the same ports (see the module documentation).
fn stale_connections(w: &FrameLab, out: &mut Outcomes) {
    let db = w.pod("db").v4;
    let connect = |port: u16| {
        raw::tcp_connect_from(
            &w.pod("web").netns,
            port,
            SocketAddr::new(db, 5432),
            CONNECT_TIMEOUT,
        )
    };
    let (reset_port, fin_port) = (40500, 40501);
    reset(connect(reset_port).expect("web → db:5432 must connect while db-allow-web allows it"));
    finish(connect(fin_port).expect("web → db:5432 must connect while db-allow-web allows it"));
    out.insert(
        "v4 control: a SYN from a fresh port while db-allow-web allows it".into(),
        segment_reaches_db(w, 40502, raw::TCP_SYN, "weir-tenant-syn-control"),
    );
    let file = manifest(&w.lab, "db-allow-web.yaml", DB_ALLOW_WEB);
    w.lab
        .weir(&["delete", file.to_str().unwrap()])
        .expect("deleting db-allow-web");
    for (case, port, flags) in [
        (
            "a SYN from the port of the reset connection",
            reset_port,
            raw::TCP_SYN,
        ),
        (
            "a SYN from the port of the closed connection",
            fin_port,
            raw::TCP_SYN,
        ),
        (
            "an ACK on the tuple of the reset connection",
            reset_port,
            raw::TCP_ACK,
        ),
        ("a SYN from a fresh port", 40503, raw::TCP_SYN),
    ] {
        let marker = format!("weir-tenant-{port}-{flags}");
        out.insert(
            format!("v4 after db-allow-web is deleted: {case}"),
            segment_reaches_db(w, port, flags, &marker),
        );
    }
    out.insert(
        "v4 after db-allow-web is deleted: a connection from the port of the reset one".into(),
        connect(reset_port).is_some(),
    );
}

fn expected() -> Outcomes {
    let mut e = Outcomes::new();
    for f in ["v4", "v6"] {
        for (case, through) in [
            ("to a pod cli's egress denies", false),
            ("to web, the flow's own path", true),
            ("to web, with more bytes than an error may carry", false),
        ] {
            e.insert(
                format!("{f} forged ICMP error of cli's flow {case}"),
                through,
            );
        }
    }
    e.insert(
        "v4 control: a SYN from a fresh port while db-allow-web allows it".into(),
        true,
    );
    e.insert(
        "v4 cli's VXLAN to its node carrying web → db:5432".into(),
        false,
    );
    for case in [
        "a SYN from the port of the reset connection",
        "a SYN from the port of the closed connection",
        "an ACK on the tuple of the reset connection",
        "a SYN from a fresh port",
        "a connection from the port of the reset one",
    ] {
        e.insert(format!("v4 after db-allow-web is deleted: {case}"), false);
    }
    e
}

fn run(dataplane: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    weir_tests::require_root_and_tools();
    let w = FrameLab::up("tenant", dataplane, "blue", MANIFEST);
    let mut out = Outcomes::new();
    eprintln!("{dataplane}: icmp_error_channel");
    icmp_error_channel(&w, &mut out);
    eprintln!("{dataplane}: tunnels_to_the_node");
    tunnels_to_the_node(&w, &mut out);
    // Last: it deletes db-allow-web.
    eprintln!("{dataplane}: stale_connections");
    stale_connections(&w, &mut out);

    assert_outcomes(dataplane, "hostile tenant", &expected(), &out);
}

#[test]
fn hostile_tenant_ebpf() {
    run("ebpf");
}

#[test]
fn hostile_tenant_iptables() {
    run("iptables");
}

/// Another agent's rule that sets or matches the packet mark bits the eBPF dataplane
/// carries a Service client's identity in keeps the node off eBPF, naming the rule: the
/// probe that picks the dataplane at start and at a switch says why (the node then falls
/// back to iptables, which uses no marks). kube-proxy's bits and Azure NPM's chains (which
/// the start-up cleanup removes) are not in the way.
#[test]
fn another_agents_mark_bits_keep_the_node_off_ebpf() {
    use weir::daemon::enforcer::Backends;
    weir_tests::require_root_and_tools();
    let netns = weir_tests::netns::NetNs::new("mark").expect("a scratch namespace");
    let ns = netns.name.clone();
    let iptables = |args: &'static [&'static str]| {
        netns
            .ok("iptables", args, None)
            .unwrap_or_else(|e| panic!("iptables {args:?}: {e}"));
    };
    let probe = |ns: &str| {
        weir_tests::pods::run_in(ns, || {
            weir::daemon::node::NodeBackends::new("/sys/fs/bpf/weir-unused".into())
                .probe_ebpf()
                .map_err(|e| e.to_string())
        })
    };
    iptables(&["-t", "nat", "-N", "KUBE-MARK-MASQ"]);
    iptables(&[
        "-t",
        "nat",
        "-A",
        "KUBE-MARK-MASQ",
        "-j",
        "MARK",
        "--or-mark",
        "0x4000",
    ]);
    iptables(&["-t", "filter", "-N", "AZURE-NPM"]);
    iptables(&[
        "-t",
        "filter",
        "-A",
        "AZURE-NPM",
        "-j",
        "MARK",
        "--set-mark",
        "0x2000",
    ]);
    assert_eq!(probe(&ns), Ok(()), "kube-proxy's and Azure NPM's marks");
    iptables(&[
        "-t",
        "mangle",
        "-A",
        "PREROUTING",
        "-j",
        "MARK",
        "--set-xmark",
        "0x40000/0x40000",
    ]);
    let refused = probe(&ns).expect_err("a rule setting bit 18 must keep the node off eBPF");
    assert!(
        refused.contains("--set-xmark 0x40000/0x40000") && refused.contains("mangle"),
        "the refusal must name the rule and its table: {refused}"
    );
    iptables(&[
        "-t",
        "mangle",
        "-D",
        "PREROUTING",
        "-j",
        "MARK",
        "--set-xmark",
        "0x40000/0x40000",
    ]);
    assert_eq!(probe(&ns), Ok(()), "once the rule is gone");
}

const FLOW_OWNER: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: blue, labels: {ns: blue}}
---
apiVersion: v1
kind: Pod
metadata: {name: q, namespace: blue, labels: {app: q}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 80, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: blue, labels: {app: p}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 7400, protocol: TCP}]
"#;

/// The pod p, with no policy: deleted with the first manifest, then re-created at the
/// same addresses (a new pod IPAM gave the old one's address), isolated both ways.
fn p_at(v4: IpAddr, v6: IpAddr) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: p, namespace: blue, labels: {{app: p}}}}\n\
         spec:\n  containers:\n  - name: c\n    ports: [{{containerPort: 7400, protocol: TCP}}]\n\
         status:\n  podIPs:\n  - ip: {v4}\n  - ip: {v6}\n---\n\
         apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {{name: p-deny-all, namespace: blue}}\n\
         spec:\n  podSelector: {{matchLabels: {{app: p}}}}\n  policyTypes: [Ingress, Egress]\n"
    )
}

/// A pod's connections go with it: p holds p:40700 → q:80; p is deleted, and a new p at
/// the same address (on eBPF also given the same endpoint id, the lowest free one) is
/// isolated both ways. Packets of the old flow, either way, must not pass as its: the
/// new pod inherits nothing (eBPF forgets the departed endpoint's CT entries, iptables
/// the kernel's conntrack entries of the departed address).
fn departed_flows(dataplane: &str) -> Outcomes {
    let mut w = FrameLab::up("departed", dataplane, "blue", FLOW_OWNER);
    let (p4, p6) = (w.pod("p").v4, w.pod("p").v6);
    let q = w.pod("q").v4;
    let flow = raw::tcp_connect_from(
        &w.pod("p").netns,
        40700,
        SocketAddr::new(q, 80),
        CONNECT_TIMEOUT,
    )
    .expect("p → q:80 must connect (no policy)");
    let first = manifest(&w.lab, "p.yaml", FLOW_OWNER.split("---").last().unwrap());
    w.lab
        .weir(&["delete", first.to_str().unwrap()])
        .expect("deleting p");
    drop(flow);
    let again = manifest(&w.lab, "p-again.yaml", &p_at(p4, p6));
    w.lab
        .weir(&["apply", again.to_str().unwrap()])
        .expect("re-creating p at its old address, isolated");
    // The lab wires the new pod afresh: read its namespace and interface again.
    w.refresh();
    let mut out = Outcomes::new();
    let ack = |from: IpAddr, sport: u16, to: IpAddr, dport: u16, marker: &str| {
        let seg = raw::tcp(
            SocketAddr::new(from, sport),
            SocketAddr::new(to, dport),
            raw::TCP_ACK,
            marker.as_bytes(),
        );
        raw::ip(from, to, raw::IPPROTO_TCP, &seg)
    };
    let marker = "weir-departed-from-q";
    let to_p = ack(q, 80, p4, 40700, marker);
    out.insert(
        "q's packet of the old flow reaches the new p".into(),
        w.reaches("q", "p", &[], &to_p, marker.as_bytes()),
    );
    let marker = "weir-departed-control";
    let control = ack(q, 81, p4, 40701, marker);
    out.insert(
        "q's packet of no flow reaches the new p (control)".into(),
        w.reaches("q", "p", &[], &control, marker.as_bytes()),
    );
    let marker = "weir-departed-from-p";
    let to_q = ack(p4, 40700, q, 80, marker);
    out.insert(
        "the new p's packet of the old flow reaches q".into(),
        w.reaches("p", "q", &[], &to_q, marker.as_bytes()),
    );
    eprintln!(
        "DEBUG status: {:?}",
        w.lab.weir(&["status", "--output", "json"])
    );
    let _ = std::process::Command::new("cp")
        .arg(w.lab.dir.join("agent.log"))
        .arg(format!("/tmp/w/agent-{dataplane}.log"))
        .status();
    out
}

#[test]
fn a_departed_pods_flows_are_not_inherited() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    weir_tests::require_root_and_tools();
    let mut wrong = Vec::new();
    for dataplane in ["ebpf", "iptables"] {
        for (case, through) in departed_flows(dataplane) {
            eprintln!(
                "{dataplane}: {} {case}",
                if through { "THROUGH" } else { "blocked" }
            );
            if through {
                wrong.push(format!("  {dataplane}: {case}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "a new pod at a departed pod's address inherited its flows:\n{}",
        wrong.join("\n")
    );
}
