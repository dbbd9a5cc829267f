//! Probe results as the usual reachability matrices (one per port/protocol) or as JSON.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use serde::Serialize;

use super::probe::{Probe, Route, Skipped};
use weir_policy::desired::Protocol;

pub use weir::stdout::OutputFormat;

/// (from, to) → connected, for one port and protocol.
type Matrix<'a> = BTreeMap<(&'a str, &'a str), bool>;

#[derive(Serialize)]
struct ProbeReport<'a> {
    dataplane: &'a str,
    probes: &'a [Probe],
    /// Service probes not made: no Service reaches that target (only with --via
    /// service|both, and only when there are any).
    #[serde(skip_serializing_if = "<[Skipped]>::is_empty")]
    skipped: &'a [Skipped],
}

pub fn json(dataplane: &str, probes: &[Probe]) -> String {
    json_with_skipped(dataplane, probes, &[])
}

pub fn json_with_skipped(dataplane: &str, probes: &[Probe], skipped: &[Skipped]) -> String {
    serde_json::to_string(&ProbeReport {
        dataplane,
        probes,
        skipped,
    })
    .expect("probe report serializes")
}

/// One line per target whose service probes were skipped, and why.
pub fn skipped(skipped: &[Skipped]) -> String {
    let mut out = String::new();
    if !skipped.is_empty() {
        let _ = writeln!(out, "via service, skipped (not counted):");
    }
    for s in skipped {
        let _ = writeln!(out, "  {} {}/{}: {}", s.to, s.port, s.protocol, s.reason);
    }
    out
}

/// One matrix per (port, protocol) and route: rows are sources, columns targets; `.`
/// connected, `X` blocked, `-` not probed (the pod itself, or no Service reaches it).
/// Matrices of probes through Services say `via service` in their title.
pub fn table(dataplane: &str, probes: &[Probe]) -> String {
    let pods: BTreeSet<&str> = probes
        .iter()
        .flat_map(|p| [p.from.as_str(), p.to.as_str()])
        .collect();
    let mut matrices: BTreeMap<(u16, Protocol, Route), Matrix> = BTreeMap::new();
    for p in probes {
        matrices
            .entry((p.port, p.protocol, p.via))
            .or_default()
            .insert((p.from.as_str(), p.to.as_str()), p.connected);
    }
    let width = pods.iter().map(|p| p.len()).max().unwrap_or(0) + 1;
    let mut out = String::new();
    for ((port, protocol, via), cells) in &matrices {
        let targets: BTreeSet<&str> = cells.keys().map(|(_, to)| *to).collect();
        let connected = cells.values().filter(|c| **c).count();
        let route = match via {
            Route::Pod => "",
            Route::Service => " via service",
        };
        let _ = writeln!(
            out,
            "{port}/{protocol}{route} on {dataplane}: {connected}/{} connected",
            cells.len()
        );
        let _ = write!(out, "{:width$}", "");
        for to in &targets {
            let _ = write!(out, "{to:width$}");
        }
        out.push('\n');
        for from in &pods {
            let _ = write!(out, "{from:width$}");
            for to in &targets {
                let cell = match cells.get(&(*from, *to)) {
                    Some(true) => ".",
                    Some(false) => "X",
                    None => "-",
                };
                let _ = write!(out, "{cell:width$}");
            }
            out.push('\n');
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(from: &str, to: &str, connected: bool) -> Probe {
        Probe {
            from: from.into(),
            to: to.into(),
            port: 80,
            protocol: Protocol::Tcp,
            connected,
            via: Route::Pod,
        }
    }

    #[test]
    fn json_has_the_documented_shape() {
        let out = json("ebpf", &[probe("x/a", "y/b", true)]);
        assert_eq!(
            out,
            r#"{"dataplane":"ebpf","probes":[{"from":"x/a","to":"y/b","port":80,"protocol":"TCP","connected":true,"via":"pod"}]}"#
        );
    }

    #[test]
    fn service_probes_get_their_own_matrix_and_skipped_targets_are_listed() {
        let mut via_service = probe("x/a", "x/b", false);
        via_service.via = Route::Service;
        let out = table("ebpf", &[probe("x/a", "x/b", true), via_service]);
        assert!(
            out.contains("80/TCP on ebpf: 1/1 connected\n")
                && out.contains("80/TCP via service on ebpf: 0/1 connected\n"),
            "{out}"
        );
        let skipped_one = [Skipped {
            to: "x/c".into(),
            port: 81,
            protocol: Protocol::Udp,
            reason: "no Service".into(),
        }];
        assert_eq!(
            skipped(&skipped_one),
            "via service, skipped (not counted):\n  x/c 81/UDP: no Service\n"
        );
        let json = json_with_skipped("ebpf", &[], &skipped_one);
        assert_eq!(
            json,
            r#"{"dataplane":"ebpf","probes":[],"skipped":[{"to":"x/c","port":81,"protocol":"UDP","reason":"no Service"}]}"#
        );
    }

    #[test]
    fn table_marks_connected_blocked_and_self() {
        let out = table(
            "iptables",
            &[probe("x/a", "x/b", true), probe("x/b", "x/a", false)],
        );
        assert_eq!(
            out,
            "80/TCP on iptables: 1/2 connected\n    x/a x/b \nx/a -   .   \nx/b X   -   \n\n"
        );
    }
}
