//! The bounded-pass logic against a simulated ipset: sets with kernel reference counts,
//! list:set members, and a restore that stops at the first failing line exactly as
//! `ipset restore -exist` does. Changes are injected between listing and restoring,
//! which the real kernel tests cannot time.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::reset::ipset_list::SetInfo;

#[derive(Clone, Debug, Default)]
struct SimSet {
    list: bool,
    /// References held by something other than a list:set (rules, leaks).
    outside_refs: u64,
    members: Vec<String>,
    entries: usize,
}

/// A change someone else makes just before a restore run.
#[derive(Clone, Debug)]
enum Change {
    /// A new reference on a set (a rule appears).
    Reference(String),
    /// A set disappears.
    Destroy(String),
}

#[derive(Default)]
struct SimKernel {
    sets: BTreeMap<String, SimSet>,
    /// Applied before the 1st, 2nd, ... restore run.
    changes_before_restore: Vec<Vec<Change>>,
    restores: usize,
}

impl SimKernel {
    fn refs(&self, name: &str) -> u64 {
        let in_lists = self
            .sets
            .values()
            .filter(|s| s.list && s.members.iter().any(|m| m == name))
            .count() as u64;
        self.sets[name].outside_refs + in_lists
    }

    fn apply(&mut self, change: &Change) {
        match change {
            Change::Reference(n) => {
                if let Some(s) = self.sets.get_mut(n) {
                    s.outside_refs += 1;
                }
            }
            Change::Destroy(n) => {
                if self.sets.contains_key(n) && self.refs(n) == 0 {
                    self.sets.remove(n);
                }
            }
        }
    }

    fn line(&mut self, line: &str) -> Result<(), String> {
        let (op, name) = line.split_once(' ').ok_or("bad line")?;
        match op {
            "flush" => {
                let set = self
                    .sets
                    .get_mut(name)
                    .ok_or("The set with the given name does not exist")?;
                set.members.clear();
                set.entries = 0;
                Ok(())
            }
            "destroy" if !self.sets.contains_key(name) => Ok(()),
            "destroy" if self.refs(name) > 0 => {
                Err("Set cannot be destroyed: it is in use by a kernel component".into())
            }
            "destroy" => {
                self.sets.remove(name);
                Ok(())
            }
            _ => Err(format!("unknown op {op}")),
        }
    }
}

impl SetTool for SimKernel {
    fn list(&mut self) -> Result<Vec<SetInfo>, String> {
        Ok(self
            .sets
            .iter()
            .map(|(name, s)| SetInfo {
                name: name.clone(),
                set_type: if s.list { "list:set" } else { "hash:net" }.into(),
                references: self.refs(name),
                member_sets: s.members.clone(),
            })
            .collect())
    }

    fn restore(&mut self, script: &str) -> Result<(), IpsetRestoreError> {
        let changes = self
            .changes_before_restore
            .get(self.restores)
            .cloned()
            .unwrap_or_default();
        self.restores += 1;
        for c in &changes {
            self.apply(c);
        }
        for (i, line) in script.lines().enumerate() {
            self.line(line).map_err(|message| {
                IpsetRestoreError::Stopped(RestoreFailure {
                    line: Some(i + 1),
                    message,
                })
            })?;
        }
        Ok(())
    }
}

fn weir(name: &str) -> bool {
    name.starts_with("weir-")
}

fn kernel(sets: &[(&str, u64)]) -> SimKernel {
    SimKernel {
        sets: sets
            .iter()
            .map(|(n, refs)| {
                let set = SimSet {
                    outside_refs: *refs,
                    entries: 3,
                    ..Default::default()
                };
                (n.to_string(), set)
            })
            .collect(),
        ..Default::default()
    }
}

#[test]
fn a_reference_that_appears_after_listing_costs_one_more_pass() {
    let mut k = kernel(&[("weir-a", 0), ("weir-b", 0), ("weir-c", 1)]);
    k.changes_before_restore = vec![vec![Change::Reference("weir-a".into())]];
    let out = remove_with(&mut k, &weir);
    assert_eq!(out.restore_runs, 2);
    assert_eq!(out.destroyed, ["weir-b"]);
    let left: Vec<_> = out.undeletable.iter().map(|u| u.object.as_str()).collect();
    assert_eq!(left, ["weir-a", "weir-c"]);
    assert!(out.errors.is_empty());
    assert!(
        k.sets.values().all(|s| s.entries == 0),
        "everything left is flushed"
    );
}

#[test]
fn a_set_that_vanishes_after_listing_is_not_an_error() {
    let mut k = kernel(&[("weir-a", 0), ("weir-b", 0)]);
    k.changes_before_restore = vec![vec![Change::Destroy("weir-a".into())]];
    let out = remove_with(&mut k, &weir);
    assert_eq!(out.restore_runs, 2);
    assert_eq!(out.destroyed, ["weir-b"]);
    assert!(out.undeletable.is_empty() && out.errors.is_empty());
    assert!(k.sets.is_empty());
}

#[test]
fn owned_lists_release_their_members_in_the_same_run() {
    let mut k = kernel(&[("weir-m", 0), ("foreign-l", 0)]);
    k.sets.insert(
        "weir-l".into(),
        SimSet {
            list: true,
            members: vec!["weir-m".into()],
            ..Default::default()
        },
    );
    let out = remove_with(&mut k, &weir);
    assert_eq!(out.restore_runs, 1);
    assert_eq!(out.destroyed.len(), 2);
    assert_eq!(k.sets.keys().collect::<Vec<_>>(), ["foreign-l"]);
}

fn arb_change(n: usize) -> impl Strategy<Value = Change> {
    (0..n, any::<bool>()).prop_map(|(i, reference)| {
        let name = format!("weir-{i}");
        if reference {
            Change::Reference(name)
        } else {
            Change::Destroy(name)
        }
    })
}

proptest! {
    /// Whatever references exist and whatever changes between the runs: no error, at
    /// most two restore runs, and every owned set ends destroyed or reported (flushed).
    #[test]
    fn bounded_and_complete_under_any_changes(
        refs in proptest::collection::vec(0u64..3, 1..60),
        first in proptest::collection::vec(arb_change(60), 0..5),
        second in proptest::collection::vec(arb_change(60), 0..5),
    ) {
        let names: Vec<String> = (0..refs.len()).map(|i| format!("weir-{i}")).collect();
        let mut k = kernel(&names.iter().map(String::as_str).zip(refs.iter().copied()).collect::<Vec<_>>());
        k.changes_before_restore = vec![first, second];
        let out = remove_with(&mut k, &weir);
        prop_assert!(out.errors.is_empty());
        prop_assert!(out.restore_runs <= 2);
        for name in &out.destroyed {
            prop_assert!(!k.sets.contains_key(name), "{name} reported destroyed but present");
        }
        for name in k.sets.keys() {
            prop_assert!(
                out.undeletable.iter().any(|u| &u.object == name),
                "{name} left in the kernel but not reported"
            );
        }
    }
}
