//! `weir lab`: a Kubernetes node built from network namespaces on one Linux machine.
//!
//! A "node" network namespace holds one veth per Pod (the pod interface the dataplane
//! attaches to); each Pod is its own network namespace with a listener on its declared
//! ports. The real agent runs in the node namespace, fed from `objects.yaml` in the lab's
//! state directory, and the prober sends real TCP, UDP and SCTP traffic between pods.
pub mod addr;
pub mod agent;
pub mod cli;
pub mod error;
pub mod listen;
pub mod netns;
pub mod objects;
pub mod ops;
pub mod output;
pub mod probe;
pub mod sctp;
pub mod state;
pub mod world;

pub use error::LabError;
