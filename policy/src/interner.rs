//! Stable set ids: a 64-bit FNV-1a hash of the set's canonical definition, so the same
//! definition gets the same id across restarts. Two definitions never share an id: a
//! collision is detected and the newcomer is re-hashed with a salt.

use std::collections::HashMap;

use crate::desired::SetId;

pub type Hasher = fn(&[u8]) -> u64;

/// FNV-1a, 64 bits: stable across Rust releases, unlike `std`'s hasher.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[derive(Clone, Debug)]
pub struct SetInterner {
    ids: HashMap<String, SetId>,
    definitions: HashMap<SetId, String>,
    hasher: Hasher,
}

impl Default for SetInterner {
    fn default() -> Self {
        SetInterner::with_hasher(fnv1a)
    }
}

impl SetInterner {
    pub fn with_hasher(hasher: Hasher) -> Self {
        SetInterner {
            ids: HashMap::new(),
            definitions: HashMap::new(),
            hasher,
        }
    }

    /// The id of `definition`, assigning one if it has none.
    pub fn intern(&mut self, definition: &str) -> SetId {
        if let Some(id) = self.ids.get(definition) {
            return *id;
        }
        let mut salt = 0u32;
        let id = loop {
            let id = if salt == 0 {
                SetId((self.hasher)(definition.as_bytes()))
            } else {
                SetId((self.hasher)(format!("{definition}\0{salt}").as_bytes()))
            };
            match self.definitions.get(&id) {
                None => break id,
                Some(other) => {
                    tracing::warn!(%id, definition, other = other.as_str(), "set id collision; re-hashing with a salt");
                    salt += 1;
                }
            }
        };
        self.ids.insert(definition.to_owned(), id);
        self.definitions.insert(id, definition.to_owned());
        id
    }

    pub fn definition(&self, id: SetId) -> Option<&str> {
        self.definitions.get(&id).map(String::as_str)
    }

    /// Forgets an id that no set uses any more.
    pub fn release(&mut self, id: SetId) {
        if let Some(definition) = self.definitions.remove(&id) {
            self.ids.remove(&definition);
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_definition_same_id_and_stable() {
        let mut a = SetInterner::default();
        let mut b = SetInterner::default();
        b.intern("something else");
        assert_eq!(
            a.intern("pods(namespace=x; pods={})"),
            b.intern("pods(namespace=x; pods={})")
        );
        // Pinned: ids name kernel objects (ipsets, map entries) that survive restarts.
        assert_eq!(
            SetId(fnv1a(b"cidr(10.0.0.0/8)")).to_string(),
            format!("{:016x}", fnv1a(b"cidr(10.0.0.0/8)"))
        );
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn collisions_never_merge() {
        fn first_byte_collides(b: &[u8]) -> u64 {
            // Every definition collides on its first try; salted retries differ.
            if b.contains(&0) {
                fnv1a(b)
            } else {
                7
            }
        }
        let mut i = SetInterner::with_hasher(first_byte_collides);
        let a = i.intern("a");
        let b = i.intern("b");
        let c = i.intern("c");
        assert_ne!(a, b);
        assert_ne!(b, c);
        assert_ne!(a, c);
        assert_eq!(i.intern("b"), b);
        assert_eq!(i.definition(b), Some("b"));
        i.release(a);
        assert_eq!(i.len(), 2);
        assert_eq!(i.intern("d"), SetId(7), "a released id is free again");
    }
}
