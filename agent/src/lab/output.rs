//! Probe results as the usual reachability matrices (one per port/protocol) or as JSON.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use serde::Serialize;

use super::probe::Probe;
use crate::policy::desired::Protocol;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

/// (from, to) → connected, for one port and protocol.
type Matrix<'a> = BTreeMap<(&'a str, &'a str), bool>;

#[derive(Serialize)]
struct ProbeReport<'a> {
    dataplane: &'a str,
    probes: &'a [Probe],
}

pub fn json(dataplane: &str, probes: &[Probe]) -> String {
    serde_json::to_string(&ProbeReport { dataplane, probes }).expect("probe report serializes")
}

/// One matrix per (port, protocol): rows are sources, columns targets; `.` connected,
/// `X` blocked, `-` not probed (the pod itself).
pub fn table(dataplane: &str, probes: &[Probe]) -> String {
    let pods: BTreeSet<&str> = probes
        .iter()
        .flat_map(|p| [p.from.as_str(), p.to.as_str()])
        .collect();
    let mut matrices: BTreeMap<(u16, Protocol), Matrix> = BTreeMap::new();
    for p in probes {
        matrices
            .entry((p.port, p.protocol))
            .or_default()
            .insert((p.from.as_str(), p.to.as_str()), p.connected);
    }
    let width = pods.iter().map(|p| p.len()).max().unwrap_or(0) + 1;
    let mut out = String::new();
    for ((port, protocol), cells) in &matrices {
        let targets: BTreeSet<&str> = cells.keys().map(|(_, to)| *to).collect();
        let connected = cells.values().filter(|c| **c).count();
        let _ = writeln!(
            out,
            "{port}/{protocol} on {dataplane}: {connected}/{} connected",
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
        }
    }

    #[test]
    fn json_has_the_documented_shape() {
        let out = json("ebpf", &[probe("x/a", "y/b", true)]);
        assert_eq!(
            out,
            r#"{"dataplane":"ebpf","probes":[{"from":"x/a","to":"y/b","port":80,"protocol":"TCP","connected":true}]}"#
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
