//! The reset removes the eBPF dataplane's state: TC filters of `weir_*` programs,
//! TCX links and every pin under the pin root, so traffic flows unfiltered afterwards.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;
use weir::dataplane::Scope;

use weir::dataplane::ebpf::{AttachMode, EbpfConfig, EbpfDataplane};
use weir::dataplane::Dataplane;
use weir::reset::{reset, ResetOptions, ResetReport};
use weir_tests::desired::{desired, endpoint};
use weir_tests::pods::{run_in, World};
use weir_tests::probe::{tcp_from, EchoServers};
use weir_tests::{require_root_and_tools, PinRoot};

const A: Ipv4Addr = Ipv4Addr::new(10, 203, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 203, 0, 2);
const T: Duration = Duration::from_millis(500);

fn reset_ebpf_in(world: &World, root: &PinRoot) -> ResetReport {
    let options = ResetOptions {
        iptables: false,
        ebpf: true,
        bpf_root: root.0.clone(),
        ..Default::default()
    };
    run_in(&world.node, move || reset(&options))
}

fn weir_filters(world: &World) -> String {
    // A failed listing must not read as "no filters".
    let out = weir_tests::netns::NetNs::attach(&world.node)
        .ok("tc", &["filter", "show", "dev", "lxc-b", "egress"], None)
        .expect("tc filter show dev lxc-b egress, in the node");
    out.lines()
        .filter(|l| l.contains("weir_"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn removes_everything(mode: AttachMode, tag: &str) {
    require_root_and_tools();
    if mode == AttachMode::Tcx && !weir_tests::tcx_or_its_refusal(tag) {
        return;
    }
    let world = World::new(tag, &[("a", A), ("b", B)]);
    let root = PinRoot::new(tag);
    let _servers = EchoServers::start(&world.pod("b").ns, &[80]);
    let a_ns = world.pod("a").ns.clone();
    let to_b = SocketAddr::from((B, 80));
    assert!(tcp_from(&a_ns, to_b, T), "world broken: a cannot reach b");

    // b admits nothing; the dataplane object is dropped, its attachments stay.
    let config = EbpfConfig {
        attach_mode: Some(mode),
        ..EbpfConfig::with_pin_root(root.0.clone())
    };
    let state = desired(vec![], vec![endpoint("x/b", B, Some(vec![]), None)]);
    run_in(&world.node, move || {
        let mut dp = EbpfDataplane::new(config).expect("load eBPF dataplane");
        let report = dp.converge(&state, Scope::Kernel).expect("reconcile");
        assert!(report.failures.is_empty(), "{:?}", report.failures);
    });
    assert!(
        !tcp_from(&a_ns, to_b, T),
        "eBPF must drop a->b before the reset"
    );

    let report = reset_ebpf_in(&world, &root);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(!report.removed_pins.is_empty(), "{report:?}");
    if mode == AttachMode::Netlink {
        assert!(!report.detached_filters.is_empty(), "{report:?}");
    }
    assert!(!root.0.exists(), "pin root left behind");
    assert_eq!(weir_filters(&world), "", "weir filters left on lxc-b");
    assert!(tcp_from(&a_ns, to_b, T), "after the reset a->b flows again");

    let again = reset_ebpf_in(&world, &root);
    assert!(again.errors.is_empty(), "{:?}", again.errors);
    assert!(again.removed_pins.is_empty() && again.detached_filters.is_empty());
}

#[test]
fn reset_removes_tcx_links_programs_and_maps() {
    removes_everything(AttachMode::Tcx, "rsttcx");
}

#[test]
fn reset_detaches_netlink_filters_and_removes_pins() {
    removes_everything(AttachMode::Netlink, "rstnl");
}
