//! Classification of owned ipsets into those one `ipset restore` can destroy and those
//! it cannot, decided from the kernel's reference counts before anything is written.
//!
//! Every owned set is flushed, owned `list:set` sets first: flushing a list releases the
//! references it holds on its members. What still references a set after that (a rule
//! weir does not own, a foreign `list:set`, a leaked kernel reference) makes it
//! undeletable; it stays, empty, and is reported with the reason.

use std::collections::BTreeMap;

use weir_policy::model::ObjectError;

use super::ipset_list::SetInfo;

/// One line of an `ipset restore` script.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SetOp {
    Flush(String),
    Destroy(String),
}

impl SetOp {
    pub fn set_name(&self) -> &str {
        match self {
            SetOp::Flush(n) | SetOp::Destroy(n) => n,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SetPlan {
    /// Flushes (owned lists first), then destroys: the order of the restore script.
    pub ops: Vec<SetOp>,
    pub undeletable: Vec<ObjectError>,
}

impl SetPlan {
    pub fn script(&self) -> String {
        self.ops
            .iter()
            .map(|op| match op {
                SetOp::Flush(n) => format!("flush {n}\n"),
                SetOp::Destroy(n) => format!("destroy {n}\n"),
            })
            .collect()
    }

    pub fn destroys(&self) -> impl Iterator<Item = &str> {
        self.ops.iter().filter_map(|op| match op {
            SetOp::Destroy(n) => Some(n.as_str()),
            SetOp::Flush(_) => None,
        })
    }
}

/// Classifies the owned sets of a full `ipset list` (with list members). `released`
/// counts references that go away before the restore runs (the rules of owned chains,
/// when planning a dry run before they are removed); empty otherwise.
pub fn classify(
    sets: &[SetInfo],
    owned: &dyn Fn(&str) -> bool,
    released: &BTreeMap<String, u64>,
) -> SetPlan {
    // For each set, the list:sets that hold it, split by owner.
    let mut holders: BTreeMap<&str, (u64, Vec<&str>)> = BTreeMap::new();
    for list in sets.iter().filter(|s| s.is_list_set()) {
        for member in &list.member_sets {
            let entry = holders.entry(member.as_str()).or_default();
            if owned(&list.name) {
                entry.0 += 1;
            } else {
                entry.1.push(&list.name);
            }
        }
    }
    let mut owned_sets: Vec<&SetInfo> = sets.iter().filter(|s| owned(&s.name)).collect();
    // Lists first, so that their flush releases member references before any destroy.
    owned_sets.sort_by_key(|s| !s.is_list_set());

    let mut plan = SetPlan::default();
    plan.ops
        .extend(owned_sets.iter().map(|s| SetOp::Flush(s.name.clone())));
    for set in owned_sets {
        let (owned_lists, foreign_lists) = holders
            .get(set.name.as_str())
            .map(|(o, f)| (*o, f.as_slice()))
            .unwrap_or((0, &[]));
        let released = released.get(&set.name).copied().unwrap_or(0);
        let remaining = set.references.saturating_sub(owned_lists + released);
        if remaining == 0 {
            plan.ops.push(SetOp::Destroy(set.name.clone()));
        } else {
            plan.undeletable.push(ObjectError {
                object: set.name.clone(),
                reason: reason(remaining, foreign_lists),
            });
        }
    }
    plan
}

fn reason(references: u64, foreign_lists: &[&str]) -> String {
    let others = references.saturating_sub(foreign_lists.len() as u64);
    let mut parts = Vec::new();
    if !foreign_lists.is_empty() {
        parts.push(format!(
            "member of list:set {} that weir does not own",
            foreign_lists.join(", ")
        ));
    }
    if others > 0 {
        parts.push(format!(
            "{others} kernel reference(s) not held by any list:set (a rule in a chain or \
             iptables backend weir does not own, or a leaked reference)"
        ));
    }
    format!("in use: {}", parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reset::ipset_list::parse;

    fn weir(name: &str) -> bool {
        name.starts_with("weir-") || name.starts_with("azure-npm-")
    }

    #[test]
    fn classifies_a_captured_listing() {
        let sets = parse(include_str!("testdata/ipset-list.txt")).unwrap();
        let plan = classify(&sets, &weir, &BTreeMap::new());
        assert_eq!(plan.destroys().collect::<Vec<_>>(), ["weir-t"]);
        let undeletable: Vec<_> = plan.undeletable.iter().map(|u| &u.object[..]).collect();
        assert_eq!(undeletable, ["weir-b", "weir-c", "azure-npm-123"]);
        assert!(plan.undeletable[0].reason.contains("list:set foreign-list"));
        assert!(plan.undeletable[1].reason.contains("2 kernel reference(s)"));
        // Every owned set is flushed, even the undeletable ones.
        assert_eq!(plan.ops.len(), 5);
        assert!(plan.script().starts_with("flush weir-t\n"));
    }

    #[test]
    fn owned_lists_are_flushed_first_and_free_their_members() {
        let text = "Name: weir-m\nType: hash:net\nReferences: 1\nMembers:\n\n\
                    Name: weir-l\nType: list:set\nReferences: 0\nMembers:\nweir-m\n";
        let plan = classify(&parse(text).unwrap(), &weir, &BTreeMap::new());
        assert_eq!(
            plan.script(),
            "flush weir-l\nflush weir-m\ndestroy weir-l\ndestroy weir-m\n"
        );
        assert!(plan.undeletable.is_empty());
    }

    #[test]
    fn foreign_sets_are_never_touched() {
        let text = "Name: kube-x\nType: hash:net\nReferences: 0\n";
        assert_eq!(
            classify(&parse(text).unwrap(), &weir, &BTreeMap::new()),
            SetPlan::default()
        );
    }
}
