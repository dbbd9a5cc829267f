//! The kernel/user boundary: every BPF map key and value, laid out `#[repr(C)]`,
//! shared by the TC classifiers (ebpf/weir-ebpf) and the agent so the two cannot
//! disagree on a layout.
//!
//! Addresses are 16 bytes everywhere: IPv4 is stored IPv4-mapped (`::ffff:a.b.c.d`), so
//! one LPM trie and one conntrack table serve both families.
//!
//! Layout changes in the hostile-packets release, for versioned pins: the
//! WEIR_ENDPOINT value [`EndpointInfo`] grew from 8 to 40 bytes (the pod's addresses), the
//! WEIR_CT key [`CtKey`] from 40 to 44 bytes (endpoint id and direction); new maps
//! WEIR_CT_OVERFLOW ([`CtKey`] → [`CtValue`]), WEIR_CT_BUDGET (array of [`RateState`]) and
//! WEIR_FRAG ([`FragKey`] → [`FragValue`]) and WEIR_LOCAL ([`IdentityKey`] → endpoint id).
//! Pins of the previous release do not match.
//!
//! **Dependencies:** none (`no_std`); with feature `user`, aya, for `aya::Pod`. Both the
//! programs and the agent build it, so the layout checks at the end run on both sides.
#![no_std]

use core::mem::{offset_of, size_of};

/// Map names, as declared by the kernel programs and pinned under `<root>/maps/`.
pub mod map_names {
    pub const IDENTITY: &str = "WEIR_IDENTITY";
    pub const ENDPOINT: &str = "WEIR_ENDPOINT";
    pub const POLICY: &str = "WEIR_POLICY";
    pub const CT: &str = "WEIR_CT";
    /// Flows of endpoints over their new-flow budget (see [`super::CtBudget`]).
    pub const CT_OVERFLOW: &str = "WEIR_CT_OVERFLOW";
    /// Per-endpoint token buckets for new WEIR_CT entries, indexed by endpoint id.
    pub const CT_BUDGET: &str = "WEIR_CT_BUDGET";
    /// Ports of allowed first fragments, for the later fragments of the same datagram.
    pub const FRAG: &str = "WEIR_FRAG";
    /// Local pods' addresses ([`super::IdentityKey`], IPv4-mapped) → endpoint id.
    pub const LOCAL: &str = "WEIR_LOCAL";
    /// Service frontends ([`super::ServiceKey`] → 1): a pod's traffic to one is judged
    /// after kube-proxy's DNAT (see [`super::DEFER_MARK_SHIFT`]).
    pub const SERVICE: &str = "WEIR_SERVICE";
    /// Endpoint id → [`super::EndpointInfo`]: a deferred packet's client by the id in its mark.
    pub const ENDPOINT_BY_ID: &str = "WEIR_ENDPOINT_BY_ID";
    /// The destination before DNAT of a deferred flow ([`super::DeferKey`] →
    /// [`super::DeferValue`]), for the client's conntrack entry that admits the replies.
    pub const DEFER: &str = "WEIR_DEFER";
    pub const COUNTERS: &str = "WEIR_COUNTERS";
    pub const EVENTS: &str = "WEIR_EVENTS";
    pub const RATE: &str = "WEIR_RATE";
    pub const SETTINGS: &str = "WEIR_SETTINGS";
    /// Not used by the programs: the agent's own records (ids, names), see [`RecordChunk`].
    pub const RECORDS: &str = "WEIR_RECORDS";
}

/// Program names (the `weir_` prefix lets `weir reset` find our TC filters by name).
pub mod program_names {
    /// TC ingress of the pod's host-side interface: traffic from the pod (pod egress).
    pub const FROM_POD: &str = "weir_from_pod";
    /// TC egress of the pod's host-side interface: traffic to the pod (pod ingress).
    pub const TO_POD: &str = "weir_to_pod";
    /// A socket filter the iptables `bpf` match runs in the node's INPUT chain: a pod's
    /// Service traffic that kube-proxy DNATed to the node itself.
    pub const DEFERRED_TO_NODE: &str = "weir_deferred_to_node";
    /// Every program, as pinned.
    pub const ALL: [&str; 3] = [FROM_POD, TO_POD, DEFERRED_TO_NODE];
}

/// Identity of a peer that matched no trie entry, or an entry whose prefix belongs to no
/// set (an `except` hole). Only `Peer::Any` rules apply to it.
pub const IDENTITY_WORLD: u32 = 1;
/// The node's own addresses: traffic between a pod and its node is always allowed by
/// NetworkPolicies (Kubernetes semantics), and ClusterNetworkPolicy ingress peers never
/// select it. Only a pod's egress to its node, where ClusterNetworkPolicy tiers judge
/// that direction, is looked up: then the node's addresses carry [`IDENTITY_HOST_BIT`].
pub const IDENTITY_HOST: u32 = 2;
/// Marks a node address whose set memberships are those of identity
/// `value & !IDENTITY_HOST_BIT` (a `networks` or `nodes` peer can name it). The agent uses
/// it only while some endpoint's egress is tiered; otherwise every node address is
/// [`IDENTITY_HOST`]. Dynamic identities stay far below it.
pub const IDENTITY_HOST_BIT: u32 = 1 << 31;

/// Whether an IDENTITY value is one of the node's own addresses.
pub const fn is_host(identity: u32) -> bool {
    identity == IDENTITY_HOST || identity & IDENTITY_HOST_BIT != 0
}
/// Identity used in POLICY keys of rules whose peer is "any address".
pub const IDENTITY_ANY: u32 = 0;
/// A Service frontend's address that the SERVICE map had no room for: a pod's traffic to
/// it would be judged before kube-proxy picks a backend, on the frontend's address, so a
/// direction that is judged at all drops it (fails closed) instead. It has no POLICY
/// entries.
pub const IDENTITY_UNLISTED_FRONTEND: u32 = 3;
/// First identity handed out for a set-membership signature.
pub const IDENTITY_FIRST_DYNAMIC: u32 = 16;

/// Reserved COUNTERS slots; rule ids start at [`RULE_ID_FIRST`].
/// Drops: an isolated pod's ingress that no rule allows. (Before per-direction counts this
/// slot counted both directions; a pinned map carried over from then starts high.)
pub const COUNTER_DEFAULT_DENY: u32 = 0;
/// Drops: an isolated pod's egress that no rule allows.
pub const COUNTER_DEFAULT_DENY_EGRESS: u32 = 13;
pub const COUNTER_REPLY: u32 = 1;
pub const COUNTER_NOT_ISOLATED: u32 = 2;
pub const COUNTER_EVENTS_SUPPRESSED: u32 = 3;
pub const COUNTER_ICMP_ERROR: u32 = 4;
pub const COUNTER_HOST: u32 = 5;
/// Drops: a packet from a pod whose source address is not one of the pod's.
pub const COUNTER_SPOOFED: u32 = 6;
/// Drops: a VLAN- or QinQ-tagged frame from a pod.
pub const COUNTER_TAGGED: u32 = 7;
/// Drops: an IP packet from a pod too short to read its addresses.
pub const COUNTER_MALFORMED: u32 = 8;
/// New flows tracked in WEIR_CT_OVERFLOW because their endpoint was over its budget.
pub const COUNTER_CT_OVERFLOW: u32 = 9;
/// Allows: neighbour discovery that stays on the pod's link (hop limit 255, link scope).
pub const COUNTER_NEIGHBOR_DISCOVERY: u32 = 10;
/// Later fragments whose ports came from their datagram's allowed first fragment.
pub const COUNTER_FRAGMENT_FOLLOWED: u32 = 11;
/// Packets from a pod to a Service frontend, passed on to be judged after DNAT.
pub const COUNTER_SERVICE_DEFERRED: u32 = 12;
/// Drops: a judged direction's packet with a frontend the SERVICE map had no room for.
pub const COUNTER_UNLISTED_FRONTEND: u32 = 14;
pub const RULE_ID_FIRST: u32 = 16;
const _: () = assert!(COUNTER_DEFAULT_DENY_EGRESS < RULE_ID_FIRST);
const _: () = assert!(COUNTER_UNLISTED_FRONTEND < RULE_ID_FIRST);
const _: () = assert!(IDENTITY_UNLISTED_FRONTEND < IDENTITY_FIRST_DYNAMIC);

/// Set in a POLICY value whose rule is an audit rule (what it allows, audit-mode policies
/// would drop): the programs report it as [`Verdict::Audit`], always, and count it at the
/// rule id without the bit.
pub const AUDIT_RULE_BIT: u32 = 1 << 30;

/// Set in a POLICY value that drops: a ClusterNetworkPolicy Deny rule (its id in the
/// other bits), or, with no id, the NetworkPolicies' default deny in a direction that
/// ClusterNetworkPolicy tiers also judge. Only such directions have these values, and
/// every point of their key space is decided (see the agent's policy_map).
pub const TIER_DENY_BIT: u32 = 1 << 29;

/// The rule id (COUNTERS slot) of a POLICY value or an event's `rule_id`.
pub const fn rule_id(value: u32) -> u32 {
    value & !(AUDIT_RULE_BIT | TIER_DENY_BIT)
}

/// The COUNTERS slot of a drop by POLICY value `value` (0 when nothing matched): the
/// ClusterNetworkPolicy Deny rule's, or `direction`'s default deny.
pub const fn drop_counter(value: u32, direction: Direction) -> u32 {
    match rule_id(value) {
        0 => default_deny_counter(direction),
        id => id,
    }
}

/// The default-deny counter of `direction`.
pub const fn default_deny_counter(direction: Direction) -> u32 {
    match direction {
        Direction::Ingress => COUNTER_DEFAULT_DENY,
        Direction::Egress => COUNTER_DEFAULT_DENY_EGRESS,
    }
}

/// One chunk of the agent's serialized records (bpffs holds no regular files, so the
/// table naming rules, endpoints and identities lives in a pinned hash map of chunks).
pub const RECORD_CHUNK_BYTES: usize = 4096;
pub type RecordChunk = [u8; RECORD_CHUNK_BYTES];

/// A pod's traffic to a Service frontend is judged after kube-proxy's DNAT (and any
/// SNAT): `weir_from_pod` writes the pod's endpoint id into [`DEFER_MARK_MASK`] of
/// `skb->mark`, with [`DEFER_MARK_EGRESS_ISOLATED`] when the pod's egress is isolated
/// (the mark survives forwarding within the node's network namespace and is scrubbed
/// whenever a packet crosses into another one, so a pod cannot set it); the `weir_to_pod`
/// hook the packet leaves through judges the client's egress against the backend it
/// reaches, and the backend's ingress against the client's own address even when
/// kube-proxy masqueraded it (as iptables' FORWARD sees it), then clears the bits.
/// Bits 18–31: an isolation flag and 13 bits of endpoint id (ids up to 8191); kube-proxy
/// uses bits 14 and 15, Azure NPM bits 12, 13 and 16.
pub const DEFER_MARK_SHIFT: u32 = 19;
pub const DEFER_MARK_MASK: u32 = 0x1fff << DEFER_MARK_SHIFT;
pub const DEFER_MARK_EGRESS_ISOLATED: u32 = 1 << 18;
/// Every bit weir uses.
pub const DEFER_MARK_ALL: u32 = DEFER_MARK_MASK | DEFER_MARK_EGRESS_ISOLATED;
/// The largest endpoint id the mark can carry.
pub const DEFER_MAX_ENDPOINT_ID: u32 = DEFER_MARK_MASK >> DEFER_MARK_SHIFT;

/// SERVICE key: a frontend address (IPv4-mapped; all zeros for a nodePort, which is on
/// every node address), destination port (host byte order) and protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub addr: [u8; 16],
    pub port: u16,
    pub protocol: u8,
    pub _pad: u8,
}

/// DEFER key: a deferred flow as its client sent it, by the fields DNAT leaves alone.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DeferKey {
    pub endpoint_id: u32,
    pub sport: u16,
    pub protocol: u8,
    /// 4 or 6.
    pub family: u8,
}

/// DEFER value: the flow's addresses and destination port before DNAT.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeferValue {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub dport: u16,
    pub _pad: [u8; 6],
}

/// SETTINGS array slots (u32 values, changeable at run time).
pub const SETTING_EMIT_ALLOW_EVENTS: u32 = 0;
pub const SETTINGS_LEN: u32 = 4;

/// IDENTITY trie key: 128-bit address, prefix length counted over all 128 bits
/// (an IPv4 /24 is prefix 96 + 24).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdentityKey {
    pub addr: [u8; 16],
}

/// ENDPOINT flags.
pub const EP_INGRESS_ISOLATED: u32 = 1;
pub const EP_EGRESS_ISOLATED: u32 = 2;
/// `ipv4` holds the pod's IPv4 address (else every IPv4 packet from the pod is spoofed).
pub const EP_HAS_IPV4: u32 = 4;
/// `ipv6` holds the pod's IPv6 address.
pub const EP_HAS_IPV6: u32 = 8;

/// Per-interface endpoint record, keyed by the pod's host-side ifindex (u32).
///
/// Layout changed in the hostile-packets release: 8 → 40 bytes (the pod's addresses, for
/// anti-spoofing). Pins of the previous release do not match.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointInfo {
    pub endpoint_id: u32,
    /// [`EP_INGRESS_ISOLATED`] | [`EP_EGRESS_ISOLATED`] | [`EP_HAS_IPV4`] | [`EP_HAS_IPV6`].
    pub flags: u32,
    /// The pod's IPv4 address, IPv4-mapped (valid with [`EP_HAS_IPV4`]).
    pub ipv4: [u8; 16],
    /// The pod's IPv6 address (valid with [`EP_HAS_IPV6`]).
    pub ipv6: [u8; 16],
}

/// The direction a key, entry or event is about, from the pod's side. Stored as its `u8`
/// (`Direction::Ingress as u8`) in the `direction` fields below; user space decodes it
/// with `TryFrom<u8>`.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// To the pod (the TC egress hook of its host-side interface).
    Ingress = 0,
    /// From the pod (the TC ingress hook).
    Egress = 1,
}

impl Direction {
    pub const fn opposite(self) -> Direction {
        match self {
            Direction::Ingress => Direction::Egress,
            Direction::Egress => Direction::Ingress,
        }
    }
}

/// POLICY trie key. Field order is prefix order: endpoint, identity and direction are
/// always matched in full (72 bits); protocol (8 bits) and destination port (16 bits,
/// network byte order) may be wildcarded by a shorter prefix, so a port range becomes a
/// handful of prefixes and "all ports" or "all protocols" is a single entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKey {
    pub endpoint_id: u32,
    pub identity: u32,
    pub direction: u8,
    pub protocol: u8,
    /// Big-endian bytes of the destination port.
    pub port: [u8; 2],
}

/// Prefix lengths (in bits) of [`PolicyKey`], from its layout: everything before the
/// protocol (any protocol), everything before the port (any port), the whole key.
pub const POLICY_PREFIX_ANY_PROTOCOL: u32 = 8 * offset_of!(PolicyKey, protocol) as u32;
pub const POLICY_PREFIX_ANY_PORT: u32 = 8 * offset_of!(PolicyKey, port) as u32;
pub const POLICY_PREFIX_FULL: u32 = 8 * size_of::<PolicyKey>() as u32;

/// Conntrack key: the endpoint and direction whose full verdict admitted the flow, and
/// the tuple as first seen there (the initiator's direction). An entry made at one
/// endpoint's hook is only ever consulted at that endpoint's hooks, so no pod can make
/// state for another. ICMP echo uses the identifier as `sport` for requests and as
/// `dport` for replies.
///
/// Layout changed in the hostile-packets release: 40 → 44 bytes (endpoint id and
/// direction added). Pins of the previous release do not match.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey {
    pub endpoint_id: u32,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub protocol: u8,
    /// A [`Direction`]: the hook that admitted the first packet.
    pub direction: u8,
    pub _pad: [u8; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtValue {
    /// bpf_ktime_get_ns of the last packet that refreshed the entry.
    pub last_seen_ns: u64,
    /// Rule id that admitted the flow first (0 when the direction was not isolated).
    pub rule_id: u32,
    /// [`CT_FLAG_CLOSING`] once a FIN of the flow passed (was padding before: 0).
    pub flags: u32,
}

/// [`CtValue::flags`]: a FIN of this TCP flow passed; the entry lives only as long as
/// TIME_WAIT would, however often it is refreshed.
pub const CT_FLAG_CLOSING: u32 = 1;

/// FRAG key: a fragmented datagram as one endpoint's hook saw it (IP identification:
/// IPv4's 16 bits, or the IPv6 fragment header's 32).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    pub endpoint_id: u32,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub id: u32,
    pub protocol: u8,
    /// A [`Direction`].
    pub direction: u8,
    pub _pad: [u8; 2],
}

/// FRAG value: the ports of the datagram's first fragment, which the full verdict allowed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragValue {
    /// bpf_ktime_get_ns of the first fragment.
    pub first_seen_ns: u64,
    pub sport: u16,
    pub dport: u16,
    pub policy_port: u16,
    pub _pad: u16,
}

/// Per-CPU COUNTERS value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

/// Per-CPU token bucket for events (RATE map, one slot); also the per-endpoint budget of
/// new WEIR_CT entries (CT_BUDGET map, one slot per endpoint id, shared by all CPUs).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateState {
    pub tokens: u64,
    pub last_ns: u64,
}

/// A [`VerdictEvent`]'s verdict, stored as its `u8`.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Drop = 0,
    Allow = 1,
    /// Allowed by an audit rule: an audit-mode policy would have dropped it.
    Audit = 2,
}

/// Why a [`VerdictEvent`] was allowed or dropped, stored as its `u8`.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    PolicyDeny = 1,
    PolicyAllow = 2,
    Reply = 3,
    NotIsolated = 4,
    IcmpError = 5,
    Host = 6,
    /// Dropped: the source address is not one of the sending pod's.
    Spoofed = 7,
    /// Dropped: a VLAN/QinQ-tagged frame from a pod.
    Tagged = 8,
    /// Allowed: a later packet of a flow this endpoint's hook admitted (same direction).
    Established = 9,
    /// Dropped: an IP packet from a pod whose header cannot be read.
    Malformed = 10,
    /// Allowed: a packet to a Service frontend, to be judged after DNAT.
    ServiceDeferred = 11,
    /// Dropped: a Service frontend the SERVICE map had no room for, in a judged direction.
    UnlistedFrontend = 12,
}

/// A byte that names no variant of the enum it was read as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownValue(pub u8);

/// `TryFrom<u8>` for the enums above, from their variant lists: user space decodes what
/// the kernel wrote, and a byte the agent does not know is an error, not a guess.
macro_rules! decode_u8 {
    ($enum:ident: $($variant:ident),+ $(,)?) => {
        impl TryFrom<u8> for $enum {
            type Error = UnknownValue;
            fn try_from(value: u8) -> Result<Self, UnknownValue> {
                $(if value == $enum::$variant as u8 {
                    return Ok($enum::$variant);
                })+
                Err(UnknownValue(value))
            }
        }
    };
}
decode_u8!(Direction: Ingress, Egress);
decode_u8!(Verdict: Drop, Allow, Audit);
decode_u8!(Reason: PolicyDeny, PolicyAllow, Reply, NotIsolated, IcmpError, Host, Spoofed,
    Tagged, Established, Malformed, ServiceDeferred, UnlistedFrontend);

/// One verdict sent to user space through EVENTS.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VerdictEvent {
    pub timestamp_ns: u64,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub protocol: u8,
    /// 4 or 6.
    pub family: u8,
    /// A [`Direction`].
    pub direction: u8,
    /// A [`Verdict`].
    pub verdict: u8,
    /// A [`Reason`].
    pub reason: u8,
    pub _pad: [u8; 3],
    pub ifindex: u32,
    pub endpoint_id: u32,
    /// The allowing rule, or [`COUNTER_DEFAULT_DENY`] for a drop.
    pub rule_id: u32,
    pub peer_identity: u32,
    pub packet_len: u32,
}

/// Checks a boundary struct at compile time, on both sides (the programs and the agent
/// build this crate): its size, every field's offset, and that the fields fill it with no
/// implicit padding (so the kernel and user space never read different bytes). A change
/// to a struct that is not made here too fails the build.
macro_rules! layout {
    ($t:ty, $size:expr, { $($field:ident: $ft:ty = $offset:expr),+ $(,)? }) => {
        const _: () = {
            assert!(size_of::<$t>() == $size);
            $(assert!(offset_of!($t, $field) == $offset);)+
            assert!(0 $(+ size_of::<$ft>())+ == $size, "implicit padding");
        };
    };
}

layout!(ServiceKey, 20, { addr: [u8; 16] = 0, port: u16 = 16, protocol: u8 = 18, _pad: u8 = 19 });
layout!(DeferKey, 8, { endpoint_id: u32 = 0, sport: u16 = 4, protocol: u8 = 6, family: u8 = 7 });
layout!(DeferValue, 40, { saddr: [u8; 16] = 0, daddr: [u8; 16] = 16, dport: u16 = 32,
    _pad: [u8; 6] = 34 });
layout!(IdentityKey, 16, { addr: [u8; 16] = 0 });
layout!(EndpointInfo, 40, { endpoint_id: u32 = 0, flags: u32 = 4, ipv4: [u8; 16] = 8,
    ipv6: [u8; 16] = 24 });
layout!(PolicyKey, 12, { endpoint_id: u32 = 0, identity: u32 = 4, direction: u8 = 8,
    protocol: u8 = 9, port: [u8; 2] = 10 });
layout!(CtKey, 44, { endpoint_id: u32 = 0, saddr: [u8; 16] = 4, daddr: [u8; 16] = 20,
    sport: u16 = 36, dport: u16 = 38, protocol: u8 = 40, direction: u8 = 41,
    _pad: [u8; 2] = 42 });
layout!(CtValue, 16, { last_seen_ns: u64 = 0, rule_id: u32 = 8, flags: u32 = 12 });
layout!(FragKey, 44, { endpoint_id: u32 = 0, saddr: [u8; 16] = 4, daddr: [u8; 16] = 20,
    id: u32 = 36, protocol: u8 = 40, direction: u8 = 41, _pad: [u8; 2] = 42 });
layout!(FragValue, 16, { first_seen_ns: u64 = 0, sport: u16 = 8, dport: u16 = 10,
    policy_port: u16 = 12, _pad: u16 = 14 });
layout!(Counter, 16, { packets: u64 = 0, bytes: u64 = 8 });
layout!(RateState, 16, { tokens: u64 = 0, last_ns: u64 = 8 });
layout!(VerdictEvent, 72, { timestamp_ns: u64 = 0, saddr: [u8; 16] = 8, daddr: [u8; 16] = 24,
    sport: u16 = 40, dport: u16 = 42, protocol: u8 = 44, family: u8 = 45, direction: u8 = 46,
    verdict: u8 = 47, reason: u8 = 48, _pad: [u8; 3] = 49, ifindex: u32 = 52,
    endpoint_id: u32 = 56, rule_id: u32 = 60, peer_identity: u32 = 64, packet_len: u32 = 68 });
// The prefix lengths the agent and the programs have always used.
const _: () = assert!(
    POLICY_PREFIX_ANY_PROTOCOL == 72 && POLICY_PREFIX_ANY_PORT == 80 && POLICY_PREFIX_FULL == 96
);

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: all plain-old-data, #[repr(C)], every bit pattern valid, no implicit padding.
    unsafe impl aya::Pod for super::EndpointInfo {}
    unsafe impl aya::Pod for super::IdentityKey {}
    unsafe impl aya::Pod for super::PolicyKey {}
    unsafe impl aya::Pod for super::CtKey {}
    unsafe impl aya::Pod for super::CtValue {}
    unsafe impl aya::Pod for super::FragKey {}
    unsafe impl aya::Pod for super::FragValue {}
    unsafe impl aya::Pod for super::Counter {}
    unsafe impl aya::Pod for super::RateState {}
    unsafe impl aya::Pod for super::VerdictEvent {}
    unsafe impl aya::Pod for super::ServiceKey {}
    unsafe impl aya::Pod for super::DeferKey {}
    unsafe impl aya::Pod for super::DeferValue {}
}
