//! Shared helpers for the integration tests (network namespaces, prerequisites).
