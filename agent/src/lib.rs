//! weir: a Kubernetes NetworkPolicy agent for Linux nodes.
//!
//! Data flow: a source (kube watchers or manifest files) feeds the cluster [`model`]; the
//! [`policy`] engine compiles it to a dataplane-neutral desired state and deltas; a
//! [`dataplane`] (eBPF or ipset/iptables) enforces them; [`reset`] cleans a node.
pub mod daemon;
pub mod dataplane;
pub mod kernel;
pub mod lab;
pub mod model;
pub mod policy;
pub mod reset;
pub mod source;
pub mod stdout;
