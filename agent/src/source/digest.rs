//! A digest of a cluster state: (kind, namespace/name, resourceVersion) of every object,
//! each hashed (FNV-1a) and XORed together, so it is updated per event in O(1) and does
//! not depend on the order objects arrived in. The agent reports the digest of what it has
//! applied in cluster mode; the lab computes one from a list of the API server, and equal
//! digests mean the agent enforces exactly the server's current state.

use std::fmt;

use weir_policy::model::ObjectRef;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateDigest(u64);

impl StateDigest {
    /// One object's contribution.
    pub fn entry(key: &ObjectRef, resource_version: &str) -> u64 {
        let text = format!(
            "{}\0{}\0{}\0{}",
            key.kind.name(),
            key.namespace.as_deref().unwrap_or(""),
            key.name,
            resource_version
        );
        text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// Adds an entry, or removes it if it is in (XOR is its own inverse).
    pub fn toggle(&mut self, entry: u64) {
        self.0 ^= entry;
    }
}

impl fmt::Display for StateDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_policy::model::Kind;

    #[test]
    fn order_does_not_matter_and_removal_undoes_addition() {
        let a = StateDigest::entry(&ObjectRef::new(Kind::Pod, Some("x"), "a"), "10");
        let b = StateDigest::entry(&ObjectRef::new(Kind::Pod, Some("x"), "b"), "11");
        let b2 = StateDigest::entry(&ObjectRef::new(Kind::Pod, Some("x"), "b"), "12");
        let (mut one, mut two) = (StateDigest::default(), StateDigest::default());
        one.toggle(a);
        one.toggle(b);
        two.toggle(b);
        two.toggle(a);
        assert_eq!(one, two);
        two.toggle(b);
        two.toggle(b2);
        assert_ne!(one, two, "a new resourceVersion changes the digest");
        one.toggle(b);
        one.toggle(a);
        assert_eq!(one, StateDigest::default());
    }
}
