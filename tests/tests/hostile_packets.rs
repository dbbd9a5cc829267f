//! The hostile pod, with real frames in a `weir-lab`, on both dataplanes:
//! spoofed sources, the conntrack-forgery attack, VLAN/QinQ-tagged frames, forged ICMP
//! errors, fragmented datagrams and IPv6 extension headers, a conntrack flood against
//! another pod's long-lived flow, and from off the node an IPv6 packet whose source is a
//! pod's IPv4 address written IPv4-mapped. Both dataplanes
//! run the same manifest and must give the same outcome for every case, which is also
//! the expected one. The attacking pod sends hand-made Ethernet frames out of its own
//! `eth0` with an AF_PACKET socket (any pod with CAP_NET_RAW can); arrival is judged by a
//! sniffer on the target's `eth0`.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;
use weir_tests::frame_lab::{
    assert_outcomes, family, udp_arrives, FrameLab, LabPod, Outcomes, LINGER,
};
use weir_tests::lab::manifest;
use weir_tests::pods::{enter, ip, off_node_host};
use weir_tests::raw::{self, Sniffer};

/// Deleted in the middle of [`policy_change`] (also in [`MANIFEST`]).
const API_ALLOW_CLI: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: api-allow-cli, namespace: red}
spec:
  podSelector: {matchLabels: {app: api}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: cli}}}]
    ports: [{port: 7200, protocol: TCP}]
"#;

const MANIFEST: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: red, labels: {ns: red}}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: red, labels: {app: db}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 5432, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: cli, namespace: red, labels: {app: cli}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: red, labels: {app: web}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 80, protocol: TCP}, {containerPort: 5353, protocol: UDP}]
---
apiVersion: v1
kind: Pod
metadata: {name: tagger, namespace: red, labels: {app: tagger}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 9999, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: vc, namespace: red, labels: {app: vc}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 7001, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: vs, namespace: red, labels: {app: vs}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 7000, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: flood, namespace: red, labels: {app: flood}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 9998, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: resolver, namespace: red, labels: {app: resolver}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 5353, protocol: UDP}]
---
apiVersion: v1
kind: Pod
metadata: {name: stub, namespace: red, labels: {app: stub}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 7002, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: api, namespace: red, labels: {app: api}}
spec:
  containers:
  - name: c
    ports: [{containerPort: 8443, protocol: TCP}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: api-deny-ingress, namespace: red}
spec:
  podSelector: {matchLabels: {app: api}}
  policyTypes: [Ingress]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: api-allow-cli, namespace: red}
spec:
  podSelector: {matchLabels: {app: api}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: cli}}}]
    ports: [{port: 7200, protocol: TCP}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: resolver-allow-stub, namespace: red}
spec:
  podSelector: {matchLabels: {app: resolver}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: stub}}}]
    ports: [{port: 6000, protocol: UDP}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: stub-deny-ingress, namespace: red}
spec:
  podSelector: {matchLabels: {app: stub}}
  policyTypes: [Ingress]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-deny-ingress, namespace: red}
spec:
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: tagger-deny-egress, namespace: red}
spec:
  podSelector: {matchLabels: {app: tagger}}
  policyTypes: [Egress]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: vc-deny-ingress, namespace: red}
spec:
  podSelector: {matchLabels: {app: vc}}
  policyTypes: [Ingress]
"#;

/// Frames sent in the conntrack flood (distinct flows): about four times the default
/// WEIR_CT size (262,144), so a node-wide LRU would have evicted the idle victim flow (the
/// kernel's LRU is approximate: at 600,000 it survived one baseline run in four).
const FLOOD_FRAMES: u32 = 1_000_000;
const CONNECT_TIMEOUT: Duration = Duration::from_millis(2500);

/// One lab at a time: the flood and the probes are timing-sensitive on a small machine.
static SERIAL: Mutex<()> = Mutex::new(());

type World = FrameLab;

fn up(dataplane: &str) -> World {
    FrameLab::up("hostile", dataplane, "red", MANIFEST)
}

/// Whether a UDP socket bound to `port` in the node's namespace receives a datagram
/// carrying `marker` while (and shortly after) `send` runs.
fn node_receives(w: &World, port: u16, v6: bool, marker: &[u8], send: impl FnOnce()) -> bool {
    udp_arrives(&w.node, port, v6, marker, send)
}

fn v(p: &LabPod, v6: bool) -> IpAddr {
    p.addr(v6)
}

/// A UDP datagram to web:5353 from `src`, carrying `marker`.
fn udp_to_web(w: &World, src: IpAddr, marker: &[u8]) -> Vec<u8> {
    let dst = if src.is_ipv4() {
        w.pod("web").v4
    } else {
        w.pod("web").v6
    };
    let seg = raw::udp(
        SocketAddr::new(src, 33000),
        SocketAddr::new(dst, 5353),
        marker,
    );
    raw::ip(src, dst, raw::IPPROTO_UDP, &seg)
}

/// One group of cases, run against a lab.
type Case = fn(&World, &mut Outcomes);

fn spoofing(w: &World, out: &mut Outcomes) {
    for v6 in [false, true] {
        let cli = v(w.pod("cli"), v6);
        let db = v(w.pod("db"), v6);
        let foreign: IpAddr = if v6 {
            "2001:db8::66".parse().unwrap()
        } else {
            "192.0.2.66".parse().unwrap()
        };
        let cases = [
            ("control: cli → web from cli's own address", cli),
            ("spoofed: cli → web from db's address", db),
            ("spoofed: cli → web from an off-cluster address", foreign),
        ];
        for (i, (name, src)) in cases.into_iter().enumerate() {
            let marker = format!("weir-spoof-{v6}-{i}");
            let got = w.reaches(
                "cli",
                "web",
                &[],
                &udp_to_web(w, src, marker.as_bytes()),
                marker.as_bytes(),
            );
            out.insert(format!("{} {name}", family(v6)), got);
        }
    }
}

/// A pod's packets to its own node are checked for spoofing too: cli sends UDP to the
/// gateway address every pod routes through (the node's), from its own address and from
/// db's, and a socket in the node's namespace reports what arrived. eBPF's classifier
/// drops the forgery on the pod's interface; iptables in `WEIR-TO-NODE`, from INPUT,
/// which used to be empty (so passed everything) unless a ClusterNetworkPolicy judged
/// the node.
fn spoofed_to_node(w: &World, out: &mut Outcomes) {
    for v6 in [false, true] {
        let node: IpAddr = if v6 { "fe80::1" } else { "169.254.1.1" }.parse().unwrap();
        let cases = [
            (
                "control: cli → its node from cli's own address",
                w.pod("cli"),
            ),
            ("spoofed: cli → its node from db's address", w.pod("db")),
        ];
        for (i, (name, from)) in cases.into_iter().enumerate() {
            let src = v(from, v6);
            let marker = format!("weir-node-spoof-{v6}-{i}");
            let port = 47000 + i as u16 + if v6 { 10 } else { 0 };
            let seg = raw::udp(
                SocketAddr::new(src, 33000),
                SocketAddr::new(node, port),
                marker.as_bytes(),
            );
            let packet = raw::ip(src, node, raw::IPPROTO_UDP, &seg);
            let got = node_receives(w, port, v6, marker.as_bytes(), || {
                let (dst_mac, src_mac) = w.macs("cli");
                let frame = raw::ethernet(dst_mac, src_mac, &[], &packet);
                raw::send_frames(&w.pod("cli").netns, "eth0", vec![frame.clone(), frame]);
            });
            out.insert(format!("{} {name}", family(v6)), got);
        }
    }
}

/// The conntrack-forgery attack: red/cli forges a "reply" from db:5432 to its own port
/// 40000, then connects from 40000 to db:5432, which db's default deny must still block.
fn forgery(w: &World, out: &mut Outcomes) {
    for v6 in [false, true] {
        let cli = v(w.pod("cli"), v6);
        let db = v(w.pod("db"), v6);
        let web = v(w.pod("web"), v6);
        let port = if v6 { 40100 } else { 40000 };
        let blocked_before = raw::tcp_connect_from(
            &w.pod("cli").netns,
            port + 1,
            SocketAddr::new(db, 5432),
            CONNECT_TIMEOUT,
        )
        .is_some();
        out.insert(
            format!(
                "{} forgery: cli → db:5432 before the forged reply",
                family(v6)
            ),
            blocked_before,
        );
        let seg = raw::tcp(
            SocketAddr::new(db, 5432),
            SocketAddr::new(cli, port),
            raw::TCP_SYN | raw::TCP_ACK,
            &[],
        );
        let (dst_mac, src_mac) = w.macs("cli");
        let frame = raw::ethernet(
            dst_mac,
            src_mac,
            &[],
            &raw::ip(db, cli, raw::IPPROTO_TCP, &seg),
        );
        raw::send_frames(&w.pod("cli").netns, "eth0", vec![frame]);
        std::thread::sleep(Duration::from_millis(100));
        let got = raw::tcp_connect_from(
            &w.pod("cli").netns,
            port,
            SocketAddr::new(db, 5432),
            CONNECT_TIMEOUT,
        )
        .is_some();
        out.insert(
            format!(
                "{} forgery: cli:{port} → db:5432 after a forged reply from db:5432",
                family(v6)
            ),
            got,
        );
        let control = raw::tcp_connect_from(
            &w.pod("cli").netns,
            port + 2,
            SocketAddr::new(web, 80),
            CONNECT_TIMEOUT,
        )
        .is_some();
        out.insert(
            format!(
                "{} forgery control: cli → web:80 from a fixed port",
                family(v6)
            ),
            control,
        );
    }
}

/// Tagged frames from red/tagger (egress default deny) to web, which has no policy. Where
/// the kernel has 802.1Q, the node gets VLAN devices on tagger's interface, so a tagged
/// frame the programs let pass unjudged would be forwarded to web. Without 802.1Q (this
/// development machine's kernel) the kernel cannot forward tagged frames at all; the case
/// still runs, and on eBPF the drop must show up as a `tagged-frame` event (see `run`).
fn tagged(w: &World, out: &mut Outcomes) {
    let host_if = &w.pod("tagger").host_if;
    let n = &w.node;
    let vlan = |args: &[&str]| {
        let mut all = vec!["-n", n.as_str(), "link", "add"];
        all.extend_from_slice(args);
        std::process::Command::new("ip")
            .args(&all)
            .output()
            .expect("run ip")
    };
    let made = vlan(&["link", host_if, "name", "hpv10", "type", "vlan", "id", "10"]);
    if made.status.success() {
        ip(&[
            "-n", n, "link", "add", "link", host_if, "name", "hpq100", "type", "vlan", "proto",
            "802.1ad", "id", "100",
        ]);
        ip(&[
            "-n",
            n,
            "link",
            "add",
            "link",
            "hpq100",
            "name",
            "hpq100v10",
            "type",
            "vlan",
            "id",
            "10",
        ]);
        for dev in ["hpv10", "hpq100", "hpq100v10"] {
            ip(&["-n", n, "link", "set", dev, "up"]);
        }
    } else {
        eprintln!(
            "NOTE: this kernel has no 802.1Q support ({}): tagged frames cannot be forwarded \
             here, so 'does not reach web' holds by itself; the eBPF drop is checked by its event",
            String::from_utf8_lossy(&made.stderr).trim()
        );
    }
    let tagger = w.pod("tagger").v4;
    let cases: [(&str, raw::Tags); 3] = [
        ("control (untagged, egress default deny)", &[]),
        ("802.1Q-tagged", &[(0x8100, 10)]),
        ("QinQ (802.1ad + 802.1Q)", &[(0x88a8, 100), (0x8100, 10)]),
    ];
    for (i, (name, tags)) in cases.into_iter().enumerate() {
        let marker = format!("weir-tagged-{i}");
        let got = w.reaches(
            "tagger",
            "web",
            tags,
            &udp_to_web(w, tagger, marker.as_bytes()),
            marker.as_bytes(),
        );
        out.insert(format!("v4 tagged: tagger → web {name}"), got);
    }
    if !made.status.success() {
        return;
    }
    let rx = |dev: &str| -> u64 {
        let o = std::process::Command::new("ip")
            .args(["-n", n, "-s", "-j", "link", "show", dev])
            .output()
            .unwrap();
        let j: Value = serde_json::from_slice(&o.stdout).unwrap();
        j[0]["stats64"]["rx"]["packets"].as_u64().unwrap_or(0)
    };
    eprintln!(
        "VLAN devices on the node: hpv10 rx {}, hpq100v10 rx {}",
        rx("hpv10"),
        rx("hpq100v10")
    );
}

/// ICMP errors sent by cli that embed cli's own flow to web:80: to db (ingress default
/// deny; not a flow of db's) they must be dropped; to web (no policy) they pass.
fn icmp_errors(w: &World, out: &mut Outcomes) {
    for v6 in [false, true] {
        let cli = v(w.pod("cli"), v6);
        let web = v(w.pod("web"), v6);
        let port = if v6 { 40201 } else { 40200 };
        let flow = raw::tcp_connect_from(
            &w.pod("cli").netns,
            port,
            SocketAddr::new(web, 80),
            CONNECT_TIMEOUT,
        );
        assert!(
            flow.is_some(),
            "{}: cli → web:80 must connect (the embedded flow)",
            family(v6)
        );
        for (i, to) in ["db", "web"].into_iter().enumerate() {
            let target = v(w.pod(to), v6);
            let marker = format!("weir-icmp-{v6}-{i}");
            let inner_seg = raw::tcp(
                SocketAddr::new(cli, port),
                SocketAddr::new(web, 80),
                raw::TCP_ACK,
                marker.as_bytes(),
            );
            let inner = raw::ip(cli, web, raw::IPPROTO_TCP, &inner_seg);
            let packet = if v6 {
                let m = raw::icmp(cli, target, 1, 3, &inner);
                raw::ip(cli, target, raw::IPPROTO_ICMPV6, &m)
            } else {
                let m = raw::icmp(cli, target, 3, 1, &inner);
                raw::ip(cli, target, raw::IPPROTO_ICMP, &m)
            };
            let got = w.reaches("cli", to, &[], &packet, marker.as_bytes());
            out.insert(
                format!(
                    "{} forged ICMP error about cli's flow to web, sent to {to}",
                    family(v6)
                ),
                got,
            );
        }
        drop(flow);
    }
}

/// red/vc (ingress default deny) holds a connection to vs whose server speaks first;
/// red/flood then creates FLOOD_FRAMES distinct flows. vs must still reach vc.
fn ct_flood(w: &World, out: &mut Outcomes) {
    let vs = w.pod("vs").v4;
    let vs_ns = w.pod("vs").netns.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        enter(&vs_ns);
        let l = TcpListener::bind(("0.0.0.0", 7100)).expect("bind vs:7100");
        tx.send(()).unwrap();
        let (mut c, _) = l.accept().expect("accept");
        c.write_all(b"hello-1").unwrap();
        c
    });
    rx.recv().unwrap();
    let mut client = raw::tcp_connect_from(
        &w.pod("vc").netns,
        41000,
        SocketAddr::new(vs, 7100),
        CONNECT_TIMEOUT,
    )
    .expect("vc → vs:7100 must connect (vc's egress and vs's ingress are open)");
    let mut server_conn = server.join().expect("server thread");
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 7];
    let first = client.read_exact(&mut buf).is_ok() && &buf == b"hello-1";
    out.insert(
        "v4 ct flood: server speaks first before the flood".into(),
        first,
    );

    let flood = w.pod("flood");
    let (flood_v4, flood_mac) = (flood.v4, raw::mac(&flood.netns, "eth0"));
    let node_mac = raw::mac(&w.node, &flood.host_if);
    let IpAddr::V4(src4) = flood_v4 else {
        unreachable!()
    };
    let IpAddr::V4(dst4) = vs else { unreachable!() };
    let took = raw::flood(&flood.netns, "eth0", FLOOD_FRAMES, move |i| {
        let sport = 1024 + (i % 60000) as u16;
        let dport = 20000 + (i / 60000) as u16;
        let seg = raw::udp(
            SocketAddr::new(IpAddr::V4(src4), sport),
            SocketAddr::new(IpAddr::V4(dst4), dport),
            b"f",
        );
        raw::ethernet(
            node_mac,
            flood_mac,
            &[],
            &raw::ipv4(src4, dst4, raw::IPPROTO_UDP, &seg),
        )
    });
    eprintln!("flood: {FLOOD_FRAMES} frames in {took:.1?}");
    std::thread::sleep(Duration::from_millis(200));
    server_conn.write_all(b"hello-2").unwrap();
    let started = Instant::now();
    let second = client.read_exact(&mut buf).is_ok() && &buf == b"hello-2";
    eprintln!(
        "second message after the flood: {second} in {:.1?}",
        started.elapsed()
    );
    out.insert(
        "v4 ct flood: server speaks first after the flood".into(),
        second,
    );
}

/// A packet the receiver's ingress drops leaves no state that admits its "reply": vc
/// (ingress default deny) sends UDP to db:5432 (ingress default deny, so dropped), then
/// db sends from 5432 back to vc's port. iptables never confirms a conntrack entry for a
/// packet dropped in FORWARD; eBPF removes the entry vc's egress hook made when db's
/// ingress drops the packet.
fn dropped_not_tracked(w: &World, out: &mut Outcomes) {
    for v6 in [false, true] {
        let vc = v(w.pod("vc"), v6);
        let db = v(w.pod("db"), v6);
        let vc_ns = w.pod("vc").netns.clone();
        let port = if v6 { 43001 } else { 43000 };
        std::thread::spawn(move || {
            enter(&vc_ns);
            let bind = SocketAddr::new(
                if v6 {
                    IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
                } else {
                    IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
                },
                port,
            );
            let s = std::net::UdpSocket::bind(bind).expect("bind vc");
            s.send_to(b"query", SocketAddr::new(db, 5432)).unwrap();
        })
        .join()
        .unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let marker = format!("weir-untracked-{v6}");
        let seg = raw::udp(
            SocketAddr::new(db, 5432),
            SocketAddr::new(vc, port),
            marker.as_bytes(),
        );
        let packet = raw::ip(db, vc, raw::IPPROTO_UDP, &seg);
        let got = w.reaches("db", "vc", &[], &packet, marker.as_bytes());
        out.insert(
            format!(
                "{} reply-shaped packet db:5432 → vc after db's ingress dropped vc's packet",
                family(v6)
            ),
            got,
        );
    }
}

/// Neighbour discovery that crossed the node is judged like any packet: cli sends a
/// neighbour solicitation (hop limit 255) to db's global address; the node forwards it
/// (hop limit 254) to db, whose ingress is default deny. Only link-scoped ND is exempt.
fn forwarded_nd(w: &World, out: &mut Outcomes) {
    let (IpAddr::V6(cli), IpAddr::V6(db)) = (w.pod("cli").v6, w.pod("db").v6) else {
        unreachable!()
    };
    let marker = b"weir-nd-fwd";
    let mut body = db.octets().to_vec();
    // An unknown option (type 250, 2 × 8 octets) carrying the marker.
    let mut option = vec![250u8, 2];
    option.extend_from_slice(marker);
    option.resize(16, 0);
    body.extend_from_slice(&option);
    let ns = raw::icmp(IpAddr::V6(cli), IpAddr::V6(db), 135, 0, &body);
    let packet = raw::ipv6(cli, db, raw::IPPROTO_ICMPV6, 255, &ns);
    let got = w.reaches("cli", "db", &[], &packet, marker);
    out.insert(
        "v6 neighbour solicitation forwarded from cli to db".into(),
        got,
    );
}

/// Fragments and extension headers: red/resolver allows UDP 6000 from red/stub, whose own ingress is
/// default deny. A 4,000-byte datagram (fragmented on the 1,500-byte path) must arrive
/// whole, and so must its 4,000-byte echo (a large answer, as EDNS DNS sends), over IPv4
/// and IPv6; and an IPv6 datagram behind a destination-options or hop-by-hop header must
/// be judged as the UDP it carries.
fn fragments(w: &World, out: &mut Outcomes) {
    let resolver_ns = w.pod("resolver").netns.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sizes = std::sync::Arc::new(Mutex::new(Vec::<usize>::new()));
    let (stop2, sizes2) = (stop.clone(), sizes.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        enter(&resolver_ns);
        let s = std::net::UdpSocket::bind("[::]:6000").expect("bind resolver:6000");
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        tx.send(()).unwrap();
        let mut buf = vec![0u8; 65536];
        while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                sizes2.lock().unwrap().push(n);
                let _ = s.send_to(&buf[..n], from);
            }
        }
    });
    rx.recv().unwrap();
    let payload: Vec<u8> = (0..4000u32).map(|i| (i % 251) as u8).collect();
    for v6 in [false, true] {
        let target = SocketAddr::new(v(w.pod("resolver"), v6), 6000);
        let stub_ns = w.pod("stub").netns.clone();
        let sent = payload.clone();
        sizes.lock().unwrap().clear();
        let echoed = std::thread::spawn(move || {
            enter(&stub_ns);
            let bind = if v6 { "[::]:0" } else { "0.0.0.0:0" };
            let s = std::net::UdpSocket::bind(bind).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            s.send_to(&sent, target).unwrap();
            let mut buf = vec![0u8; 65536];
            matches!(s.recv_from(&mut buf), Ok((n, _)) if buf[..n] == sent[..])
        })
        .join()
        .unwrap();
        let arrived = sizes.lock().unwrap().contains(&4000);
        out.insert(
            format!(
                "{} fragments: 4000-byte UDP stub → resolver:6000 arrives whole",
                family(v6)
            ),
            arrived,
        );
        out.insert(
            format!(
                "{} fragments: its 4000-byte echo reaches stub (default-deny ingress)",
                family(v6)
            ),
            echoed,
        );
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    server.join().unwrap();

    let (IpAddr::V6(stub6), IpAddr::V6(resolver6)) = (w.pod("stub").v6, w.pod("resolver").v6)
    else {
        unreachable!()
    };
    for (name, next_header) in [("destination options", 60u8), ("hop-by-hop", 0u8)] {
        let marker = format!("weir-exthdr-{next_header}");
        let seg = raw::udp(
            SocketAddr::new(IpAddr::V6(stub6), 33001),
            SocketAddr::new(IpAddr::V6(resolver6), 6000),
            marker.as_bytes(),
        );
        // Next header UDP, length 0 (8 octets), one PadN option of 4 bytes.
        let mut l4 = vec![raw::IPPROTO_UDP, 0, 1, 4, 0, 0, 0, 0];
        l4.extend_from_slice(&seg);
        let packet = raw::ipv6(stub6, resolver6, next_header, 64, &l4);
        let got = w.reaches("stub", "resolver", &[], &packet, marker.as_bytes());
        out.insert(
            format!("v6 extension header: UDP stub → resolver:6000 behind {name}"),
            got,
        );
    }
}

/// A host off the node (its own namespace behind a veth into the node, routed through it
/// as another node's traffic is) sends TCP SYNs over IPv6 to red/api:7200, which admits
/// only red/cli. From cli's IPv6 address it gets through (an off-node forgery of a real
/// address looks like the pod: NetworkPolicy cannot tell them apart), from its own address
/// it does not, and from cli's IPv4 address written IPv4-mapped it must not either: Linux
/// delivers such a packet to a dual-stack socket as if from the IPv4 pod, and eBPF once
/// looked it up as that pod.
fn mapped_source(w: &World, out: &mut Outcomes) {
    let node_if = format!("wo{}", std::process::id() % 100_000);
    let outside = off_node_host(&w.node, "out", &node_if, "fd99::1/64", "fd99::2/64");
    let api = w.pod("api").v6;
    let IpAddr::V4(cli_v4) = w.pod("cli").v4 else {
        panic!("cli's IPv4 address")
    };
    let cases = [
        ("off-node: cli's IPv6 address → api:7200", w.pod("cli").v6),
        (
            "off-node: its own address → api:7200",
            "fd99::2".parse().unwrap(),
        ),
        (
            "off-node: cli's IPv4 address, IPv4-mapped → api:7200",
            IpAddr::V6(cli_v4.to_ipv6_mapped()),
        ),
    ];
    let (node_mac, outside_mac) = (raw::mac(&w.node, &node_if), raw::mac(&outside.name, "eth0"));
    for (i, (name, src)) in cases.into_iter().enumerate() {
        let marker = format!("weir-mapped-{i}");
        let seg = raw::tcp(
            SocketAddr::new(src, 41000 + i as u16),
            SocketAddr::new(api, 7200),
            raw::TCP_SYN,
            marker.as_bytes(),
        );
        let frame = raw::ethernet(
            node_mac,
            outside_mac,
            &[],
            &raw::ip(src, api, raw::IPPROTO_TCP, &seg),
        );
        let sniffer = Sniffer::start(&w.pod("api").netns, "eth0", marker.as_bytes());
        raw::send_frames(&outside.name, "eth0", vec![frame.clone(), frame]);
        out.insert(name.to_string(), sniffer.stop(LINGER) > 0);
    }
}

/// What established flows do when a policy stops allowing them: red/api (ingress
/// isolated) allows TCP 7200 from red/cli; cli holds a connection; the allowing policy
/// is deleted. On both dataplanes the established connection keeps working (iptables
/// accepts ESTABLISHED first; eBPF passes packets of a flow its CT holds, either way) and
/// a new connection is refused at once.
fn policy_change(w: &World, out: &mut Outcomes) {
    let api = w.pod("api").v4;
    let api_ns = w.pod("api").netns.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        enter(&api_ns);
        let l = TcpListener::bind(("0.0.0.0", 7200)).expect("bind api:7200");
        tx.send(()).unwrap();
        let (mut c, _) = l.accept().expect("accept");
        // Never wait forever for the client's FIN (a dataplane could drop it).
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 64];
        while let Ok(n) = c.read(&mut buf) {
            if n == 0 || c.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        // Held until here: a refused new connection must not be the backlog's fault.
        drop(l);
    });
    rx.recv().unwrap();
    let mut conn = raw::tcp_connect_from(
        &w.pod("cli").netns,
        42000,
        SocketAddr::new(api, 7200),
        CONNECT_TIMEOUT,
    )
    .expect("cli → api:7200 must connect while api-allow-cli allows it");
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut echo = |msg: &[u8]| -> bool {
        let mut buf = vec![0u8; msg.len()];
        conn.write_all(msg).is_ok() && conn.read_exact(&mut buf).is_ok() && buf == msg
    };
    out.insert(
        "v4 policy change: established flow before the allowing policy is deleted".into(),
        echo(b"ping-1"),
    );
    let file = manifest(&w.lab, "api-allow-cli.yaml", API_ALLOW_CLI);
    w.lab
        .weir(&["delete", file.to_str().unwrap()])
        .expect("deleting api-allow-cli");
    out.insert(
        "v4 policy change: established flow after the allowing policy is deleted".into(),
        echo(b"ping-2"),
    );
    let fresh = raw::tcp_connect_from(
        &w.pod("cli").netns,
        42001,
        SocketAddr::new(api, 7200),
        CONNECT_TIMEOUT,
    )
    .is_some();
    out.insert(
        "v4 policy change: new flow after the allowing policy is deleted".into(),
        fresh,
    );
    drop(conn);
    server.join().expect("api server");
}

fn expected() -> Outcomes {
    let mut e = Outcomes::new();
    e.insert("off-node: cli's IPv6 address → api:7200".into(), true);
    e.insert("off-node: its own address → api:7200".into(), false);
    e.insert(
        "off-node: cli's IPv4 address, IPv4-mapped → api:7200".into(),
        false,
    );
    for f in ["v4", "v6"] {
        e.insert(
            format!("{f} control: cli → web from cli's own address"),
            true,
        );
        e.insert(format!("{f} spoofed: cli → web from db's address"), false);
        e.insert(
            format!("{f} control: cli → its node from cli's own address"),
            true,
        );
        e.insert(
            format!("{f} spoofed: cli → its node from db's address"),
            false,
        );
        e.insert(
            format!("{f} spoofed: cli → web from an off-cluster address"),
            false,
        );
        e.insert(
            format!("{f} forgery: cli → db:5432 before the forged reply"),
            false,
        );
        e.insert(
            format!("{f} forgery control: cli → web:80 from a fixed port"),
            true,
        );
        e.insert(
            format!("{f} forged ICMP error about cli's flow to web, sent to db"),
            false,
        );
        e.insert(
            format!("{f} forged ICMP error about cli's flow to web, sent to web"),
            true,
        );
    }
    e.insert(
        "v4 forgery: cli:40000 → db:5432 after a forged reply from db:5432".into(),
        false,
    );
    e.insert(
        "v6 forgery: cli:40100 → db:5432 after a forged reply from db:5432".into(),
        false,
    );
    e.insert(
        "v4 tagged: tagger → web control (untagged, egress default deny)".into(),
        false,
    );
    e.insert("v4 tagged: tagger → web 802.1Q-tagged".into(), false);
    e.insert(
        "v4 tagged: tagger → web QinQ (802.1ad + 802.1Q)".into(),
        false,
    );
    for f in ["v4", "v6"] {
        e.insert(
            format!("{f} fragments: 4000-byte UDP stub → resolver:6000 arrives whole"),
            true,
        );
        e.insert(
            format!("{f} fragments: its 4000-byte echo reaches stub (default-deny ingress)"),
            true,
        );
    }
    e.insert(
        "v6 neighbour solicitation forwarded from cli to db".into(),
        false,
    );
    for f in ["v4", "v6"] {
        e.insert(
            format!("{f} reply-shaped packet db:5432 → vc after db's ingress dropped vc's packet"),
            false,
        );
    }
    for (case, through) in [
        (
            "established flow before the allowing policy is deleted",
            true,
        ),
        (
            "established flow after the allowing policy is deleted",
            true,
        ),
        ("new flow after the allowing policy is deleted", false),
    ] {
        e.insert(format!("v4 policy change: {case}"), through);
    }
    for h in ["destination options", "hop-by-hop"] {
        e.insert(
            format!("v6 extension header: UDP stub → resolver:6000 behind {h}"),
            true,
        );
    }
    e.insert(
        "v4 ct flood: server speaks first before the flood".into(),
        true,
    );
    e.insert(
        "v4 ct flood: server speaks first after the flood".into(),
        true,
    );
    e
}

fn run(dataplane: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let w = up(dataplane);
    let mut out = Outcomes::new();
    let cases: [(&str, Case); 12] = [
        ("spoofing", spoofing),
        ("spoofed_to_node", spoofed_to_node),
        ("forgery", forgery),
        ("tagged", tagged),
        ("icmp_errors", icmp_errors),
        ("forwarded_nd", forwarded_nd),
        ("dropped_not_tracked", dropped_not_tracked),
        ("fragments", fragments),
        // Before policy_change, which deletes api's policy.
        ("mapped_source", mapped_source),
        ("policy_change", policy_change),
        // Last: on iptables the flood fills the node's conntrack table for a while.
        ("ct_flood", ct_flood),
        ("done", |_, _| {}),
    ];
    for (name, case) in cases {
        eprintln!("{dataplane}: {name}");
        case(&w, &mut out);
    }

    assert_outcomes(dataplane, "hostile traffic", &expected(), &out);

    // The verdict log (the lab agent's stderr) names the drops made before policy.
    let log = std::fs::read_to_string(w.lab.dir.join("agent.log")).expect("the agent's log");
    let records: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|r| r.get("verdict").is_some())
        .collect();
    let spoofed = records
        .iter()
        .find(|r| r["reason"] == "spoofed-source" && r["pod"] == "red/cli")
        .unwrap_or_else(|| {
            panic!("{dataplane}: no spoofed-source drop of red/cli in the verdict log:\n{log}")
        });
    assert_eq!(spoofed["verdict"], "drop");
    assert_eq!(spoofed["direction"], "egress");
    assert_eq!(spoofed["rule"], "anti-spoofing");
    // iptables never sees the tag (the frame goes nowhere), so only eBPF reports it.
    if dataplane == "ebpf" {
        assert!(
            records
                .iter()
                .any(|r| r["reason"] == "tagged-frame" && r["pod"] == "red/tagger"),
            "no tagged-frame drop of red/tagger in the verdict log:\n{log}"
        );
    }
    drop(w);
}

#[test]
fn hostile_pod_on_ebpf() {
    run("ebpf");
}

#[test]
fn hostile_pod_on_iptables() {
    run("iptables");
}
