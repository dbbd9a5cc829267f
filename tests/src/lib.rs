//! Shared helpers for the integration tests (network namespaces, prerequisites).
pub mod kernel_state;
pub mod lab;
pub mod netns;
pub mod weir_bin;
