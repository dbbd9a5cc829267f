//! The reset report: what was removed, what was left in place and why, how long it took
//! and how many restore runs it cost. Printed as text or JSON by `weir reset`.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use weir_policy::model::ObjectError;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ResetReport {
    /// Nothing was written; the lists say what a real run would remove.
    pub dry_run: bool,
    /// Azure NPM's chains and sets were included (asked for, or found on the node).
    pub azure_npm: bool,
    /// Jump rules and chains, as `<backend> <family> <table>: ...`.
    pub removed_iptables: Vec<String>,
    pub destroyed_sets: Vec<String>,
    /// Flushed but still present: referenced by something weir does not control.
    #[serde(with = "named_sets")]
    pub undeletable_sets: Vec<ObjectError>,
    /// Left in place and not even flushed: an owned chain that uses the set could not be
    /// removed, and an empty set would make that chain drop what it allows. Retried with
    /// the chains (the failure is in `errors`).
    #[serde(default, with = "named_sets")]
    pub kept_sets: Vec<ObjectError>,
    pub detached_filters: Vec<String>,
    pub removed_pins: Vec<String>,
    /// Failures other than undeletable sets (a tool failing, a restore refused).
    pub errors: Vec<String>,
    /// What was not looked at, and why (an iptables backend that is not installed).
    pub skipped: Vec<String>,
    pub ipset_restore_runs: u32,
    pub iptables_restore_runs: u32,
    pub duration_ms: f64,
}

/// `weir reset --output json` has listed sets as `{"name", "reason"}` since its first
/// release; the shared [`ObjectError`] calls the name `object`. Scripts keep working.
mod named_sets {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use weir_policy::model::ObjectError;

    #[derive(Serialize, Deserialize)]
    struct NamedSet {
        name: String,
        reason: String,
    }

    pub fn serialize<S: Serializer>(sets: &[ObjectError], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(sets.iter().map(|e| NamedSet {
            name: e.object.clone(),
            reason: e.reason.clone(),
        }))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ObjectError>, D::Error> {
        Ok(Vec::<NamedSet>::deserialize(d)?
            .into_iter()
            .map(|n| ObjectError {
                object: n.name,
                reason: n.reason,
            })
            .collect())
    }
}

impl ResetReport {
    /// True when everything weir meant to do was done; undeletable sets do not count.
    pub fn succeeded(&self) -> bool {
        self.errors.is_empty()
    }

    pub fn to_text(&self) -> String {
        let verb = if self.dry_run {
            "would remove"
        } else {
            "removed"
        };
        let mut s = String::new();
        let _ = writeln!(
            s,
            "weir reset{}{}: {:.1} ms, {} ipset restore run(s), {} iptables-restore run(s)",
            if self.dry_run { " (dry run)" } else { "" },
            if self.azure_npm {
                " incl. Azure NPM"
            } else {
                ""
            },
            self.duration_ms,
            self.ipset_restore_runs,
            self.iptables_restore_runs
        );
        let sections: [(&str, &[String]); 4] = [
            ("iptables rules and chains", &self.removed_iptables),
            ("ipsets", &self.destroyed_sets),
            ("tc filters", &self.detached_filters),
            ("bpf pins", &self.removed_pins),
        ];
        for (what, items) in sections {
            let _ = writeln!(s, "{verb} {} {what}", items.len());
            for item in items {
                let _ = writeln!(s, "  {item}");
            }
        }
        let _ = writeln!(
            s,
            "{} undeletable ipset(s) flushed and left in place (retried in the background):",
            self.undeletable_sets.len()
        );
        for u in &self.undeletable_sets {
            let _ = writeln!(s, "  {}: {}", u.object, u.reason);
        }
        if !self.kept_sets.is_empty() {
            let _ = writeln!(
                s,
                "{} ipset(s) left untouched because chains using them are still there:",
                self.kept_sets.len()
            );
        }
        for u in &self.kept_sets {
            let _ = writeln!(s, "  {}: {}", u.object, u.reason);
        }
        for note in &self.skipped {
            let _ = writeln!(s, "skipped: {note}");
        }
        for e in &self.errors {
            let _ = writeln!(s, "error: {e}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_names_undeletable_sets_and_reasons() {
        let report = ResetReport {
            destroyed_sets: vec!["weir-a".into()],
            undeletable_sets: vec![ObjectError {
                object: "weir-b".into(),
                reason: "in use".into(),
            }],
            ipset_restore_runs: 1,
            ..Default::default()
        };
        let text = report.to_text();
        assert!(text.contains("removed 1 ipsets\n  weir-a"));
        assert!(text.contains("  weir-b: in use"));
        assert!(report.succeeded());
    }
}
