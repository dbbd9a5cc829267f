//! A label set as the engine keeps it: its pairs sorted by key, in one allocation of
//! exactly their size. A `BTreeMap`'s first node is 544 bytes however few labels it holds,
//! and every pod has its own set: at 50,000 pods that was a third of the agent's heap.

use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Labels(Box<[(Box<str>, Box<str>)]>);

impl Labels {
    /// The value of `key`, if the set has it.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| (**k).cmp(key))
            .ok()
            .map(|at| &*self.0[at].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// The pairs, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (&**k, &**v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// These labels with `key` set to `value` (in place of any value it had).
    pub fn with(self, key: &str, value: &str) -> Labels {
        let mut pairs = self.0.into_vec();
        match pairs.binary_search_by(|(k, _)| (**k).cmp(key)) {
            Ok(at) => pairs[at].1 = value.into(),
            Err(at) => pairs.insert(at, (key.into(), value.into())),
        }
        Labels(pairs.into_boxed_slice())
    }
}

/// As a map is built: a key given twice keeps its last value.
impl<K: Into<Box<str>>, V: Into<Box<str>>> FromIterator<(K, V)> for Labels {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Self {
        let mut pairs: Vec<(Box<str>, Box<str>)> = pairs
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        // Stable: of equal keys, the last given ends last, and is the one kept.
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        pairs.reverse();
        pairs.dedup_by(|later, earlier| later.0 == earlier.0);
        pairs.reverse();
        Labels(pairs.into_boxed_slice())
    }
}

impl From<BTreeMap<String, String>> for Labels {
    fn from(map: BTreeMap<String, String>) -> Self {
        // Already sorted and unique.
        Labels(map.into_iter().map(|(k, v)| (k.into(), v.into())).collect())
    }
}

impl<K: Into<Box<str>>, V: Into<Box<str>>, const N: usize> From<[(K, V); N]> for Labels {
    fn from(pairs: [(K, V); N]) -> Self {
        pairs.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_as_the_map_it_replaces() {
        let map = BTreeMap::from([
            ("b".to_string(), "2".to_string()),
            ("a".to_string(), "1".to_string()),
            ("c".to_string(), "3".to_string()),
        ]);
        let labels = Labels::from(map.clone());
        for (k, v) in &map {
            assert_eq!(labels.get(k), Some(v.as_str()));
        }
        assert_eq!(labels.get("d"), None);
        assert_eq!(
            labels.iter().collect::<Vec<_>>(),
            map.iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect::<Vec<_>>()
        );
        assert_eq!(labels, map.into_iter().rev().collect::<Labels>());
    }

    #[test]
    fn a_key_given_twice_keeps_its_last_value() {
        let labels: Labels = [("a", "1"), ("b", "x"), ("a", "2")].into_iter().collect();
        assert_eq!(labels.len(), 2);
        assert_eq!(labels.get("a"), Some("2"));
        let replaced = labels.with("b", "y").with("0", "z");
        assert_eq!(
            replaced.iter().collect::<Vec<_>>(),
            [("0", "z"), ("a", "2"), ("b", "y")]
        );
    }
}
