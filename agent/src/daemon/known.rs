//! Every object the agent holds (applied or refused), with a count per kind kept as they
//! come and go: the metrics and the node report read the counts on every change, and a
//! walk of every object for them cost a tenth of the agent's time per change at 20,000
//! pods.
use std::collections::{BTreeMap, BTreeSet};

use weir_policy::model::{Kind, ObjectRef};

#[derive(Default)]
pub struct KnownObjects {
    keys: BTreeSet<ObjectRef>,
    by_kind: BTreeMap<Kind, usize>,
}

impl KnownObjects {
    pub fn insert(&mut self, key: ObjectRef) {
        let kind = key.kind;
        if self.keys.insert(key) {
            *self.by_kind.entry(kind).or_default() += 1;
        }
    }

    pub fn remove(&mut self, key: &ObjectRef) {
        if self.keys.remove(key) {
            if let Some(n) = self.by_kind.get_mut(&key.kind) {
                *n -= 1;
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// How many objects of `kind` there are.
    pub fn count(&self, kind: Kind) -> usize {
        self.by_kind.get(&kind).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_inserts_and_removes_once_each() {
        let pod = |name: &str| ObjectRef::new(Kind::Pod, Some("ns"), name);
        let policy = ObjectRef::new(Kind::NetworkPolicy, Some("ns"), "p");
        let mut known = KnownObjects::default();
        assert!(known.is_empty());
        known.insert(pod("a"));
        known.insert(pod("a"));
        known.insert(pod("b"));
        known.insert(policy.clone());
        assert_eq!(
            (known.count(Kind::Pod), known.count(Kind::NetworkPolicy)),
            (2, 1)
        );
        known.remove(&pod("a"));
        known.remove(&pod("a"));
        known.remove(&pod("never"));
        assert_eq!(known.count(Kind::Pod), 1);
        assert_eq!(known.count(Kind::Node), 0);
        known.remove(&pod("b"));
        known.remove(&policy);
        assert!(known.is_empty());
    }
}
