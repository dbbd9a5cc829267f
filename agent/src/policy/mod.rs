//! The policy engine: Kubernetes NetworkPolicy semantics decided in one place, compiled
//! to the dataplane-neutral [`desired`] model that both dataplanes enforce.
//!
//! [`validate`] mirrors the API server; [`Engine`] keeps the compiled state and returns
//! a [`desired::Delta`] per event; [`verdict`] evaluates the compiled state.

mod change;
mod compile;
pub mod desired;
mod engine;
mod error;
pub mod explain;
pub mod explain_cli;
mod interner;
mod names;
mod registry;
pub mod selector;
pub mod sets;
pub mod spec;
mod validate;
pub mod verdict;

pub use engine::Engine;
pub use error::PolicyError;
pub use interner::{fnv1a, SetInterner};
pub use validate::{parse_policy, validate};
pub use verdict::{verdict, verdict_between, Verdict, VerdictError};
