//! Inverted index from `(label key, value)` to the objects carrying that label.

use std::collections::{BTreeSet, HashMap};

use super::Labels;

#[derive(Clone, Debug, Default)]
pub struct LabelIndex {
    by_label: HashMap<(String, String), BTreeSet<String>>,
}

impl LabelIndex {
    pub fn insert(&mut self, key: &str, labels: &Labels) {
        for (k, v) in labels.iter() {
            self.by_label
                .entry((k.to_owned(), v.to_owned()))
                .or_default()
                .insert(key.to_owned());
        }
    }

    pub fn remove(&mut self, key: &str, labels: &Labels) {
        for (k, v) in labels.iter() {
            let label = (k.to_owned(), v.to_owned());
            if let Some(keys) = self.by_label.get_mut(&label) {
                keys.remove(key);
                if keys.is_empty() {
                    self.by_label.remove(&label);
                }
            }
        }
    }

    /// Keys of the objects labelled `key=value`.
    pub fn get(&self, key: &str, value: &str) -> Option<&BTreeSet<String>> {
        // A borrowed tuple key cannot be looked up without allocating; labels are short.
        self.by_label.get(&(key.to_owned(), value.to_owned()))
    }
}
