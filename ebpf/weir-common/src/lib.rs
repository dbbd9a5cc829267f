//! The kernel/user boundary: every BPF map key and value, laid out `#[repr(C)]`,
//! shared by the TC classifiers (ebpf/weir-ebpf) and the agent so the two cannot
//! disagree on a layout.
#![no_std]

/// Per-interface endpoint record, keyed by the pod's host-side ifindex.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointInfo {
    pub endpoint_id: u32,
    /// Bit 0: ingress isolated, bit 1: egress isolated.
    pub flags: u32,
}

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: plain-old-data, #[repr(C)], no padding-dependent invariants.
    unsafe impl aya::Pod for super::EndpointInfo {}
}
