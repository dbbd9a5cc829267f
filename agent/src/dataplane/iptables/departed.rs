//! A pod's connections go with it. The kernel's conntrack keys a connection by its
//! addresses and ports only, and IPAM hands a deleted pod's address out again: without
//! this a new pod at the same address would inherit the old pod's ESTABLISHED entries
//! (replies and later packets of the old flows pass `WEIR-FILTER`'s conntrack rule before
//! any policy chain). Each write records every programmed pod's interface and addresses;
//! the entries of an address whose pod went, or was made again on another interface (a new
//! sandbox is a new pod), are deleted (`conntrack -D`, both directions) once the write is
//! in, as the eBPF dataplane forgets a departed endpoint's CT entries.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::dataplane::DataplaneError;
use crate::exec::{self, ExecError};

/// A programmed pod's interface (host route device or bridge port; empty when none was
/// found) and addresses.
pub type Placement = (String, Vec<IpAddr>);

/// The addresses of `before`'s pods that left, lost that address, or moved to another
/// interface in `after` (an interface not found, on either side, is no move), and are not
/// some pod's on the same interface in `after`.
pub fn departed(
    before: &BTreeMap<String, Placement>,
    after: &BTreeMap<String, Placement>,
) -> BTreeSet<IpAddr> {
    let kept: BTreeSet<(&str, IpAddr)> = after
        .values()
        .flat_map(|(iface, addrs)| addrs.iter().map(move |a| (iface.as_str(), *a)))
        .collect();
    let mut out = BTreeSet::new();
    for (pod, (iface, addrs)) in before {
        let now = after.get(pod);
        let moved = now.is_some_and(|(i, _)| !i.is_empty() && !iface.is_empty() && i != iface);
        for a in addrs {
            let still = now.is_some_and(|(_, now_addrs)| now_addrs.contains(a));
            if (moved || !still) && !kept.contains(&(iface.as_str(), *a)) {
                out.insert(*a);
            }
        }
    }
    out
}

/// Deletes the conntrack entries to and from `addr`; `Err` says why not.
pub fn forget(addr: IpAddr) -> Result<(), DataplaneError> {
    let family = if addr.is_ipv6() { "ipv6" } else { "ipv4" };
    let addr = addr.to_string();
    for side in ["--orig-src", "--orig-dst"] {
        let context = || format!("conntrack -D {side} {addr}");
        let out =
            exec::run("conntrack", &["-D", "-f", family, side, &addr], None).map_err(|e| {
                DataplaneError::Tool {
                    context: context(),
                    source: Box::new(e),
                }
            })?;
        // conntrack exits 1 when there was nothing to delete.
        if !out.success && !out.stderr.contains("0 flow entries have been deleted") {
            return Err(DataplaneError::Tool {
                context: context(),
                source: Box::new(ExecError::Failed {
                    program: "conntrack".into(),
                    stderr: out.stderr.trim().to_string(),
                }),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placed(entries: &[(&str, &str, &[&str])]) -> BTreeMap<String, Placement> {
        entries
            .iter()
            .map(|(pod, iface, addrs)| {
                let addrs = addrs.iter().map(|a| a.parse().unwrap()).collect();
                (pod.to_string(), (iface.to_string(), addrs))
            })
            .collect()
    }

    #[test]
    fn gone_and_remade_pods_depart_moved_addresses_stay() {
        let before = placed(&[
            ("x/gone", "lxc1", &["10.0.0.1", "fd00::1"]),
            ("x/remade", "lxc2", &["10.0.0.2"]),
            ("x/same", "lxc3", &["10.0.0.3"]),
            ("x/renamed", "lxc4", &["10.0.0.4"]),
            // Its interface is found only now: not a move.
            ("x/found", "", &["10.0.0.5"]),
        ]);
        let after = placed(&[
            // A new sandbox: another interface, the same address.
            ("x/remade", "lxc9", &["10.0.0.2"]),
            ("x/same", "lxc3", &["10.0.0.3"]),
            // The same interface and address under another name: not a new pod's.
            ("x/other", "lxc4", &["10.0.0.4"]),
            ("x/found", "lxc5", &["10.0.0.5"]),
        ]);
        let gone: Vec<String> = departed(&before, &after)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(gone, ["10.0.0.1", "10.0.0.2", "fd00::1"]);
    }
}
