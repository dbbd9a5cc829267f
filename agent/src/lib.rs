//! weir: a Kubernetes NetworkPolicy agent for Linux nodes.
//!
//! Data flow: a [`source`] (kube watchers or manifest files) feeds the cluster model; the
//! policy engine ([`weir_policy`], its own pure crate) compiles it to a dataplane-neutral
//! desired state and deltas; a [`dataplane`] (eBPF or ipset/iptables) enforces them, driven
//! by the [`daemon`]; [`reset`] cleans a node.
//!
//! **Dependencies:** weir-policy (all policy semantics live there, none here), weir-common
//! (the kernel ABI), aya, kube-rs, tokio and hyper. Nothing depends on this crate but the
//! lab (weir-lab, which builds a node of network namespaces around this crate's binary),
//! the tests, the fuzz targets and the binary; it depends on none of them (`cargo xtask
//! structure`). Its top-level modules form no cycle: `kernel` ← `exec` ← `netfilter` ←
//! `reset` ← `dataplane` ← `daemon`, with `source` beside them.
pub mod daemon;
pub mod dataplane;
pub mod exec;
pub mod explain_cli;
pub mod kernel;
pub mod monitor_cli;
pub mod netfilter;
pub mod relay;
pub mod reset;
pub mod source;
pub mod status_cli;
pub mod stdout;
pub mod sys;
pub mod verdicts;
