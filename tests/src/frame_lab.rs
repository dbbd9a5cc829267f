//! A `weir-lab` node whose pods the hostile tests address with hand-made frames: each
//! pod's namespace, node-side interface and addresses from the lab's state.json, and
//! "does this frame from one pod reach another" judged by a sniffer on the target.
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use serde_json::Value;

use crate::lab::{manifest, Lab};
use crate::raw::{self, Sniffer};

/// How long a sniffer keeps watching after the frames were sent.
pub const LINGER: Duration = Duration::from_millis(300);

/// One pod of the lab.
pub struct LabPod {
    pub netns: String,
    pub host_if: String,
    pub v4: IpAddr,
    pub v6: IpAddr,
}

impl LabPod {
    /// The pod's address of one family.
    pub fn addr(&self, v6: bool) -> IpAddr {
        if v6 {
            self.v6
        } else {
            self.v4
        }
    }
}

pub struct FrameLab {
    /// Torn down (`weir-lab down`) when dropped.
    pub lab: Lab,
    pub node: String,
    /// Namespace of the pods [`FrameLab::pod`] names without one.
    pub namespace: String,
    pub pods: BTreeMap<String, LabPod>,
}

impl FrameLab {
    /// `weir-lab up --dataplane DATAPLANE` on `yaml`, in a lab tagged `tag`.
    pub fn up(tag: &str, dataplane: &str, namespace: &str, yaml: &str) -> FrameLab {
        let lab = Lab::new(&format!("{tag}-{dataplane}"));
        let file = manifest(&lab, &format!("{tag}.yaml"), yaml);
        lab.weir(&["up", "--dataplane", dataplane, file.to_str().unwrap()])
            .unwrap_or_else(|e| panic!("{dataplane}: weir-lab up: {e}"));
        let mut this = FrameLab {
            node: String::new(),
            namespace: namespace.to_string(),
            lab,
            pods: BTreeMap::new(),
        };
        this.refresh();
        this
    }

    /// Reads the node and the pods from the lab's state.json again (after `weir-lab
    /// apply` made or re-made pods).
    pub fn refresh(&mut self) {
        let state: Value = serde_json::from_str(
            &std::fs::read_to_string(self.lab.dir.join("state.json")).unwrap(),
        )
        .unwrap();
        self.pods = state["pods"]
            .as_object()
            .expect("state.json pods")
            .iter()
            .map(|(key, p)| {
                let addr = |f: &str| p[f].as_str().expect(f).parse::<IpAddr>().unwrap();
                let info = LabPod {
                    netns: p["netns"].as_str().unwrap().to_string(),
                    host_if: p["host_if"].as_str().unwrap().to_string(),
                    v4: addr("ipv4"),
                    v6: addr("ipv6"),
                };
                (key.clone(), info)
            })
            .collect();
        self.node = state["node_netns"].as_str().unwrap().to_string();
    }

    /// The pod `name` ("ns/name", or a name in [`FrameLab::namespace`]).
    pub fn pod(&self, name: &str) -> &LabPod {
        let key = if name.contains('/') {
            name.to_string()
        } else {
            format!("{}/{name}", self.namespace)
        };
        self.pods
            .get(&key)
            .unwrap_or_else(|| panic!("no pod {key} in the lab"))
    }

    /// Source and destination MACs of a frame the pod sends to its node.
    pub fn macs(&self, from: &str) -> ([u8; 6], [u8; 6]) {
        let p = self.pod(from);
        (raw::mac(&self.node, &p.host_if), raw::mac(&p.netns, "eth0"))
    }

    /// Sends `packet` from `from`'s eth0 (tagged with `tags`) and reports whether a frame
    /// carrying `marker` showed up on `to`'s eth0.
    pub fn reaches(
        &self,
        from: &str,
        to: &str,
        tags: raw::Tags,
        packet: &[u8],
        marker: &[u8],
    ) -> bool {
        self.arrivals(from, to, tags, packet, marker, 2) > 0
    }

    /// Sends `packet` `count` times from `from`'s eth0 and counts the frames carrying
    /// `marker` that showed up on `to`'s eth0.
    pub fn arrivals(
        &self,
        from: &str,
        to: &str,
        tags: raw::Tags,
        packet: &[u8],
        marker: &[u8],
        count: usize,
    ) -> usize {
        let sniffer = Sniffer::start(&self.pod(to).netns, "eth0", marker);
        let (dst_mac, src_mac) = self.macs(from);
        let frame = raw::ethernet(dst_mac, src_mac, tags, packet);
        raw::send_frames(&self.pod(from).netns, "eth0", vec![frame; count]);
        sniffer.stop(LINGER)
    }
}

/// "v4" or "v6".
pub fn family(v6: bool) -> &'static str {
    if v6 {
        "v6"
    } else {
        "v4"
    }
}

/// Whether a UDP socket bound to `port` in namespace `ns` receives a datagram carrying
/// `marker` while (and shortly after) `send` runs.
pub fn udp_arrives(ns: &str, port: u16, v6: bool, marker: &[u8], send: impl FnOnce()) -> bool {
    let (ns, marker) = (ns.to_string(), marker.to_vec());
    let (ready, bound) = std::sync::mpsc::channel();
    let receiver = std::thread::spawn(move || {
        crate::pods::enter(&ns);
        let any: IpAddr = if v6 {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        };
        let socket = std::net::UdpSocket::bind(std::net::SocketAddr::new(any, port))
            .unwrap_or_else(|e| panic!("bind UDP {port} in {ns}: {e}"));
        socket.set_read_timeout(Some(LINGER)).unwrap();
        ready.send(()).unwrap();
        let mut buf = [0u8; 2048];
        let deadline = std::time::Instant::now() + LINGER * 3;
        while std::time::Instant::now() < deadline {
            if let Ok(n) = socket.recv(&mut buf) {
                if buf[..n]
                    .windows(marker.len())
                    .any(|w| w == marker.as_slice())
                {
                    return true;
                }
            }
        }
        false
    });
    bound.recv().expect("the UDP socket is bound");
    send();
    receiver.join().expect("the UDP receiver")
}

/// Outcome of every case: name → whether the hostile traffic got through.
pub type Outcomes = BTreeMap<String, bool>;

/// Prints every outcome and fails naming each that differs from `expected` (both
/// dataplanes have the same expectations), or any case not expected.
pub fn assert_outcomes(dataplane: &str, what: &str, expected: &Outcomes, out: &Outcomes) {
    eprintln!("{dataplane} outcomes:");
    for (k, got) in out {
        eprintln!("  {} {k}", if *got { "THROUGH" } else { "blocked" });
    }
    let wrong: Vec<String> = expected
        .iter()
        .filter(|(k, want)| out.get(*k) != Some(want))
        .map(|(k, want)| {
            let got = out.get(k).map_or("missing".to_string(), |g| g.to_string());
            format!(
                "  {k}: expected {}, got {got}",
                if *want { "through" } else { "blocked" }
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{dataplane}: {what} outcomes differ from the expected ones (identical on both \
         dataplanes):\n{}",
        wrong.join("\n")
    );
    assert_eq!(
        out.len(),
        expected.len(),
        "{dataplane}: unexpected cases {out:?}"
    );
}
