//! weir's policy engine: Kubernetes NetworkPolicy semantics decided in one place, compiled
//! to the dataplane-neutral [`desired`] model that both dataplanes enforce.
//!
//! **What this crate may depend on:** Kubernetes' types (k8s-openapi), serde, ipnet,
//! thiserror and tracing. It does no I/O: no files, no sockets, no kernel (aya, libc), no
//! Kubernetes client (kube) and no async runtime (tokio, hyper). Callers hand it objects
//! ([`manifest`] parses YAML text) and take back desired state, deltas and verdicts; the
//! agent's crate (`weir`) reads files, watches the API server and programs the kernel.
//! `tests/tests/structure.rs` checks this list against `cargo metadata`.
//!
//! [`model`] is the cluster as the engine sees it, and depends on nothing else here.
//! [`validate`] mirrors the API server; [`Engine`] keeps the compiled state and returns
//! a [`desired::Delta`] per event; [`verdict()`] evaluates the compiled state.
//!
//! Decisions beyond the API text, shared by every dataplane:
//! - A pod's traffic to itself is always allowed (it never leaves the pod's netns);
//!   [`verdict()`] reports it as `to_self`.
//! - Host-network pods are never selected: not as endpoints, not as pod peers, and their
//!   container ports never resolve a named port. ipBlocks still match their (node) address.
//! - Pods without an address, and pods that finished (Succeeded/Failed), are neither
//!   endpoints nor peers.
//! - Every namespace carries `kubernetes.io/metadata.name`, as the API server sets it,
//!   also one known only from its pods.
//! - A named port resolves by name and protocol: on the local pod for ingress, and per
//!   destination pod for egress, where the peer's set is split by resolved number.
//! - At start-up, feed all objects through [`Engine::load`] (one compile) rather than
//!   one [`Engine::upsert`] each.

pub mod budget;
mod change;
pub mod cluster_policy;
mod compile;
pub mod crd;
pub mod desired;
mod engine;
mod error;
pub mod explain;
mod interner;
pub mod manifest;
pub mod model;
mod names;
mod registry;
pub mod selector;
pub mod service;
pub mod sets;
pub mod spec;
mod validate;
pub mod validated;
pub mod verdict;

pub use budget::Budget;
pub use engine::Engine;
pub use error::PolicyError;
pub use interner::{fnv1a, SetInterner};
pub use validate::{parse_policy, validate};
pub use validated::Validated;
pub use verdict::{verdict, verdict_between, Verdict, VerdictError};
