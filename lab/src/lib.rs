//! `weir-lab`: a Kubernetes node built from network namespaces on one Linux machine.
//!
//! A "node" network namespace holds one veth per Pod (the pod interface the dataplane
//! attaches to); each Pod is its own network namespace with a listener on its declared
//! ports (this binary again, `weir-lab listen`). The real agent runs in the node namespace,
//! from the `weir` binary the lab is given ([`agent::WeirBinary`]: `--weir-bin`, else the
//! one beside `weir-lab`), fed from `objects.yaml` in the lab's state directory, and the
//! prober sends real TCP, UDP and SCTP traffic between pods.
//! With `--api server` the lab runs the real etcd and kube-apiserver in the node namespace
//! ([`control_plane`]), writes its objects there ([`api`]) and the agent runs in cluster
//! mode with the DaemonSet's ServiceAccount and RBAC.
//!
//! **Dependencies:** the weir crate (agent/) for what the agent and the lab share (`exec`,
//! `kernel`, `reset`, the status report, the source digest, the dataplane kinds) and
//! weir-policy for the model. Nothing of weir depends on this crate: the lab is a
//! development and test tool, and stays out of the agent's binary and image (`cargo xtask
//! structure` checks it). Its top-level modules form no cycle: `state` (everything
//! state.json holds) is below the modules that act on the lab.
pub mod addr;
pub mod agent;
pub mod api;
pub mod cli;
pub mod cluster;
pub mod container;
pub mod control_plane;
pub mod error;
pub mod listen;
pub mod netns;
pub mod objects;
pub mod ops;
pub mod output;
pub mod peers;
pub(crate) mod pki;
pub mod probe;
pub mod proxy;
pub mod sctp;
pub mod services;
pub mod state;
pub mod world;

pub use error::LabError;
