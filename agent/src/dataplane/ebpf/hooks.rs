//! What the other eBPF modules say about where programs are attached, in a leaf they all
//! use: how (TCX or netlink), on what kind of interface, and the endpoint id of an
//! interface isolated before its pod is known.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttachMode {
    Tcx,
    Netlink,
}

/// What an interface carries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// A pod's host-side interface: both programs.
    #[default]
    Pod,
    /// Any other interface of the node (uplink, tunnel, bridge): `weir_to_pod` on egress
    /// only, which judges pods' Service traffic that leaves the node after DNAT (a remote
    /// backend) and passes everything else.
    Leaving,
}

/// Where an endpoint's programs are attached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub ifname: String,
    pub ifindex: u32,
    pub mode: AttachMode,
    #[serde(default)]
    pub role: Role,
}

/// Endpoint id of an interface isolated before its pod is known (ids of real endpoints
/// are allocated from 1 upwards).
pub const PENDING_ENDPOINT_ID: u32 = u32::MAX;
