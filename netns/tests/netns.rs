//! A namespace made, entered from a thread and from a child process, given a sysctl, and
//! gone when dropped. Needs root and iproute2 (it fails naming them otherwise).
use std::process::Command;

use weir_netns::{exists, in_netns, Netns};

fn devices(net_dev: &str) -> Vec<String> {
    net_dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(|d| d.trim().to_string())
        .collect()
}

#[test]
fn a_namespace_is_entered_and_deleted_on_drop() {
    let name = format!("weir-netns-test-{}", std::process::id());
    let ns = Netns::create(name.clone()).expect("creating a namespace (needs root and `ip`)");
    assert!(exists(&name));

    // A thread that entered it sees only its loopback.
    let inside = ns
        .run(|| std::fs::read_to_string("/proc/thread-self/net/dev"))
        .expect("entering")
        .expect("reading /proc/thread-self/net/dev");
    assert_eq!(devices(&inside), ["lo"]);

    // So does a child process started in it.
    let mut cat = Command::new("cat");
    cat.arg("/proc/self/net/dev");
    ns.command(&mut cat).expect("opening the namespace");
    let out = cat.output().expect("running cat");
    assert!(out.status.success());
    assert_eq!(devices(&String::from_utf8_lossy(&out.stdout)), ["lo"]);

    // A sysctl written inside stays inside.
    ns.sysctl("net.ipv4.ip_forward", "1").expect("sysctl");
    let forward = in_netns(&name, || {
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
    })
    .expect("entering")
    .expect("reading the sysctl");
    assert_eq!(forward.trim(), "1");

    let attached = Netns::attach(name.clone());
    drop(attached);
    assert!(
        exists(&name),
        "an attached namespace is not deleted on drop"
    );
    drop(ns);
    assert!(!exists(&name), "the owner deletes it on drop");
}
