//! Sources of cluster state: Kubernetes YAML manifests (lab, explain) and, in cluster
//! mode, the API server or the relay's store.
pub mod digest;
pub mod event;
pub mod file;
pub mod kinds;
pub mod kube;
pub(crate) mod lean_pod;
pub mod manifest;
pub mod relay;
