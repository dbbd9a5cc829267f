//! The policy engine: Kubernetes NetworkPolicy semantics decided in one place, compiled
//! to the dataplane-neutral [`desired`] model that both dataplanes enforce.
pub mod desired;
