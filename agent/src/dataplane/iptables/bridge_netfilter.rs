//! Whether the node passes bridged packets to iptables. On a bridged CNI (flannel,
//! kubenet, Azure CNI in bridge mode) packets between two pods of the bridge never reach
//! FORWARD unless br_netfilter is loaded and `net.bridge.bridge-nf-call-iptables` (and
//! `-ip6tables`) are 1 in the node's network namespace (per namespace since Linux 5.3):
//! without it the iptables dataplane enforces nothing between them. The agent cannot set
//! them from its container (/proc/sys is read-only there); it says so instead.
use std::path::Path;

/// The sysctls, by the name an operator sets, as files under `/proc/sys`.
const SYSCTLS: [&str; 2] = [
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
];

/// What is off, or `None` when both are on: read under `proc_sys` (`/proc/sys`).
pub fn off(proc_sys: &Path) -> Option<String> {
    let mut off = Vec::new();
    for sysctl in SYSCTLS {
        let name = sysctl.replace('/', ".");
        match std::fs::read_to_string(proc_sys.join(sysctl)) {
            Ok(v) if v.trim() == "1" => {}
            Ok(v) => off.push(format!("{name} is {}", v.trim())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => off.push(format!(
                "{name} does not exist (br_netfilter is not loaded)"
            )),
            Err(e) => off.push(format!("{name} cannot be read: {e}")),
        }
    }
    (!off.is_empty()).then(|| {
        format!(
            "{}: iptables does not see packets between pods of the node's bridge, so no \
             policy between them is enforced; load br_netfilter and set both to 1",
            off.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc_sys(values: &[(&str, &str)]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "weir-bridge-nf-{}-{}",
            std::process::id(),
            values.len()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("net/bridge")).unwrap();
        for (file, v) in values {
            std::fs::write(dir.join("net/bridge").join(file), v).unwrap();
        }
        dir
    }

    #[test]
    fn both_on_is_quiet_and_each_gap_is_named() {
        let on = proc_sys(&[
            ("bridge-nf-call-iptables", "1\n"),
            ("bridge-nf-call-ip6tables", "1\n"),
        ]);
        assert_eq!(off(&on), None);
        let half = proc_sys(&[("bridge-nf-call-iptables", "0\n")]);
        let why = off(&half).unwrap();
        assert!(
            why.starts_with("net.bridge.bridge-nf-call-iptables is 0, net.bridge.bridge-nf-call-ip6tables does not exist (br_netfilter is not loaded): "),
            "{why}"
        );
        for dir in [on, half] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
