//! weir's TC classifiers. One program per direction on a pod's host-side interface:
//! `weir_from_pod` (TC ingress, the pod's egress policy) and `weir_to_pod` (TC egress, the
//! pod's ingress policy). Every decision comes from maps the agent fills:
//! ENDPOINT (is this interface a pod, its addresses, is the direction isolated), CT
//! (packets of flows this endpoint admitted), IDENTITY (peer address → identity) and
//! POLICY (endpoint, identity, direction, protocol, port → allowing rule).
//!
//! Order of judgement, from the pod: tagged frames dropped; then the source address must
//! be one of the pod's (link-local and `::` only towards link scope) or the packet is
//! dropped, before anything else looks at it. Then, both ways: link-scoped neighbour
//! discovery passes; ICMP errors about a flow of this endpoint pass when they travel that
//! flow's path and are no longer than an error may be; packets of a flow this endpoint's
//! hooks admitted pass (either way), but a TCP SYN is always judged as new, an RST ends
//! its flow's entry and a FIN shortens it to TIME_WAIT; the rest is judged by policy, and
//! only what that full verdict allows creates a CT entry, keyed to this endpoint and
//! direction.
//! Traffic with the node's own addresses is allowed, except a pod's egress to its node
//! where ClusterNetworkPolicy tiers judge it: then the node address's own POLICY entries
//! decide (see `host_policy_value`).
//!
//! Service traffic: a packet from an egress-isolated pod to a Service frontend (WEIR_SERVICE)
//! cannot be judged at `weir_from_pod`, before kube-proxy picks the backend (DNAT runs
//! later, in PREROUTING or, with IPVS, in LOCAL_IN). It passes with the pod's endpoint id
//! in `skb->mark` (DEFER_MARK_MASK) and is judged, as that pod's egress, at the
//! `weir_to_pod` hook it leaves the node's namespace through, against the backend it
//! reaches; that hook clears the bits, then judges the backend's own ingress as usual.
//! Every packet of such a flow takes that path (established ones through a CT entry
//! keyed by the tuple after DNAT). The client's reply entry is keyed by the tuple before
//! DNAT, since replies reach the client un-DNATed: it is made when the packet is passed
//! on and removed if the flow is denied after DNAT (WEIR_DEFER remembers the tuple). If
//! kube-proxy masqueraded the packet, the backend's ingress is judged on the client's own
//! address (WEIR_ENDPOINT_BY_ID), as iptables' FORWARD sees it before SNAT. A backend on
//! the node itself (host network) has no such hook: the packet is delivered locally, and
//! `weir_deferred_to_node`, a socket filter the iptables `bpf` match runs in the node's
//! INPUT chain, takes the same verdict there.
//!
//! CT entries go to WEIR_CT while the endpoint has budget (a token bucket of
//! CT_NEW_PER_SEC new entries per second, CT_NEW_BURST deep, per endpoint), otherwise to
//! WEIR_CT_OVERFLOW: one pod's flood of new flows churns the overflow table, not the flows
//! of other pods in WEIR_CT (see ARCHITECTURE.md for the bound).
//!
//! Built for Linux 5.10: helpers used are map lookup/update/delete, skb_load_bytes,
//! ktime_get_ns, ringbuf_output/reserve/submit (5.8) and, only when the agent enables
//! aya-log, probe_read/ringbuf for log records. No kfuncs, no BTF-dependent features.
#![no_std]
#![no_main]

mod packet;

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, TC_ACT_OK, TC_ACT_SHOT},
    helpers::bpf_ktime_get_ns,
    macros::{classifier, map, socket_filter},
    maps::{lpm_trie::Key, Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf},
    programs::{sk_buff::SkBuff, SkBuffContext, TcContext},
};
use aya_log_ebpf::debug;
use packet::{Frame, Packet, Tuple, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};
use weir_common::*;

/// Rodata, set by the loader: verdict events per second and CPU (also the burst).
#[unsafe(no_mangle)]
static EVENT_RATE_PER_SEC: u64 = 1000;
/// Rodata, set by the loader: new WEIR_CT entries per second and endpoint.
#[unsafe(no_mangle)]
static CT_NEW_PER_SEC: u64 = 100;
/// Rodata, set by the loader: how many new WEIR_CT entries an endpoint may make at once.
#[unsafe(no_mangle)]
static CT_NEW_BURST: u64 = 2000;

const NS_PER_SEC: u64 = 1_000_000_000;
/// An entry is refreshed at most once a second per direction, to keep map writes rare.
const CT_REFRESH_NS: u64 = NS_PER_SEC;
const CT_TIMEOUT_TCP_NS: u64 = 3600 * NS_PER_SEC;
const CT_TIMEOUT_OTHER_NS: u64 = 120 * NS_PER_SEC;
/// A TCP flow after its FIN: as long as conntrack keeps TIME_WAIT.
const CT_TIMEOUT_CLOSING_NS: u64 = 120 * NS_PER_SEC;
/// The most an ICMP error may carry, IP header included: RFC 1812's 576 bytes for IPv4
/// (Linux's own errors are cut there), IPv6's minimum MTU for ICMPv6 (RFC 4443).
const ICMP_ERROR_MAX_V4: u32 = 576;
const ICMP_ERROR_MAX_V6: u32 = 1280;
/// How long the later fragments of a datagram may follow its first (Linux's ipfrag_time).
const FRAG_TIMEOUT_NS: u64 = 30 * NS_PER_SEC;

// Sizes here are defaults; the agent sets them from its configuration at load time.
#[map]
static WEIR_IDENTITY: LpmTrie<IdentityKey, u32> = LpmTrie::pinned(65536, 0);
#[map]
static WEIR_ENDPOINT: HashMap<u32, EndpointInfo> = HashMap::pinned(4096, 0);
#[map]
static WEIR_POLICY: LpmTrie<PolicyKey, u32> = LpmTrie::pinned(65536, 0);
#[map]
static WEIR_CT: LruHashMap<CtKey, CtValue> = LruHashMap::pinned(262144, 0);
#[map]
static WEIR_CT_OVERFLOW: LruHashMap<CtKey, CtValue> = LruHashMap::pinned(65536, 0);
/// Ports of allowed first fragments, keyed by endpoint, direction, addresses, protocol
/// and IP id, so later fragments follow the verdict of their datagram.
#[map]
static WEIR_FRAG: LruHashMap<FragKey, FragValue> = LruHashMap::pinned(16384, 0);
/// Local pods' addresses → endpoint id: when a pod's ingress drops a packet from another
/// local pod, the sender's CT entry for it goes too (its full verdict was a drop).
#[map]
static WEIR_LOCAL: HashMap<IdentityKey, u32> = HashMap::pinned(8192, 0);
/// Service frontends: a pod's new traffic to one is judged after kube-proxy's DNAT.
#[map]
static WEIR_SERVICE: HashMap<ServiceKey, u32> = HashMap::pinned(65536, 0);
/// The ENDPOINT records by endpoint id: a deferred packet's client, by its mark.
#[map]
static WEIR_ENDPOINT_BY_ID: HashMap<u32, EndpointInfo> = HashMap::pinned(4096, 0);
/// Deferred flows' destinations before DNAT, to remove the client's reply entry when the
/// flow is denied after DNAT.
#[map]
static WEIR_DEFER: LruHashMap<DeferKey, DeferValue> = LruHashMap::pinned(65536, 0);
/// One token bucket per endpoint id (ids are small: the agent hands out the lowest free).
#[map]
static WEIR_CT_BUDGET: Array<RateState> = Array::pinned(4097, 0);
#[map]
static WEIR_COUNTERS: PerCpuArray<Counter> = PerCpuArray::pinned(16384, 0);
#[map]
static WEIR_EVENTS: RingBuf = RingBuf::pinned(1 << 20, 0);
#[map]
static WEIR_RATE: PerCpuArray<RateState> = PerCpuArray::pinned(1, 0);
/// Per-CPU scratch space for the parsed packet: the BPF stack (512 bytes) is too small
/// for two tuples, lookup keys and their copies.
#[map]
static SCRATCH: PerCpuArray<packet::Packet> = PerCpuArray::with_max_entries(1, 0);
#[map]
static WEIR_SETTINGS: Array<u32> = Array::pinned(SETTINGS_LEN, 0);
/// The agent's records (rule and endpoint names, identity signatures), chunked; never
/// read here. BPF_F_NO_PREALLOC: only the chunks in use take memory.
#[map]
static WEIR_RECORDS: HashMap<u32, RecordChunk> = HashMap::pinned(1024, BPF_F_NO_PREALLOC);

#[classifier]
pub fn weir_from_pod(ctx: TcContext) -> i32 {
    decide(&ctx, Direction::Egress)
}

#[classifier]
pub fn weir_to_pod(ctx: TcContext) -> i32 {
    decide(&ctx, Direction::Ingress)
}

/// Run by the iptables `bpf` match in the node's INPUT chain (the agent's
/// `WEIR-EBPF-TO-NODE`): a pod's packet to a Service frontend that kube-proxy DNATed to
/// one of the node's own addresses (a host-network backend) is delivered locally, past
/// every pod's TC hook, so its client's deferred egress verdict is taken here. 1: the
/// rule drops the packet; 0: it goes on.
#[socket_filter]
pub fn weir_deferred_to_node(ctx: SkBuffContext) -> i64 {
    let skb = &ctx.skb;
    let mark = unsafe { (*skb.skb).mark };
    let client = (mark & DEFER_MARK_MASK) >> DEFER_MARK_SHIFT;
    if client == 0 {
        return 0;
    }
    let Some(pkt) = SCRATCH.get_ptr_mut(0) else {
        return 1;
    };
    let pkt = unsafe { &mut *pkt };
    if !matches!(packet::parse_from_l3(skb, pkt), Ok(Frame::Ip)) {
        // Only an IP packet from a pod is ever marked.
        count(skb, COUNTER_MALFORMED);
        return 1;
    }
    // Delivered to one of the node's addresses. A Service frontend not yet DNATed
    // (kube-proxy's ipvs mode does it after this chain) is judged at its backend's hook.
    if to_frontend(&pkt.tuple) {
        return 0;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let isolated = mark & DEFER_MARK_EGRESS_ISOLATED != 0;
    let ifindex = unsafe { (*skb.skb).ifindex };
    match judge_deferred_parsed(skb, ifindex, client, isolated, pkt, now) {
        Deferred::Drop => {
            ct_forget_deferred(pkt, client);
            1
        }
        Deferred::Allow(_) => 0,
    }
}

/// Whether the pod may send with this source address: its own address of that family;
/// a link-local or unspecified IPv6 source only towards link scope (neighbour
/// discovery, MLD, duplicate address detection), which the node never forwards.
#[inline(always)]
fn source_ok(ep: &EndpointInfo, t: &Tuple) -> bool {
    // An interface isolated before its pod is known has no address yet: both directions
    // are isolated with no rules, so it reaches only the node, and its source cannot be
    // checked until the agent programs it; but it may not speak as a programmed pod of
    // this node (to the node, which would take it for that pod).
    if ep.flags & (EP_HAS_IPV4 | EP_HAS_IPV6) == 0 {
        return !is_local_pod(&t.saddr);
    }
    if t.family == 4 {
        return ep.flags & EP_HAS_IPV4 != 0 && packet::same_addr(&t.saddr, &ep.ipv4);
    }
    if ep.flags & EP_HAS_IPV6 != 0 && packet::same_addr(&t.saddr, &ep.ipv6) {
        return true;
    }
    (packet::is_link_local(&t.saddr) || packet::is_unspecified(&t.saddr))
        && (packet::is_link_local(&t.daddr) || packet::is_link_multicast(&t.daddr))
}

/// Whether a pod's packet is an encapsulation (IPIP, IPv6-in-IP, GRE, or UDP to a VXLAN
/// or Geneve port) addressed to its node: a node with such a tunnel device takes it apart
/// and forwards the inner packet, whose source no hook of the pod checks, from the tunnel
/// device. It is dropped as a spoofing attempt, whether or not the pod's egress is
/// isolated: a pod does not tunnel to its own node.
#[inline(always)]
fn tunnels_to_node(pkt: &Packet) -> bool {
    let t = &pkt.tuple;
    let encapsulated = match t.protocol {
        packet::IPPROTO_IPIP | packet::IPPROTO_IPV6 | packet::IPPROTO_GRE => true,
        packet::IPPROTO_UDP => {
            t.dport == packet::TUNNEL_UDP_PORTS[0]
                || t.dport == packet::TUNNEL_UDP_PORTS[1]
                || t.dport == packet::TUNNEL_UDP_PORTS[2]
        }
        _ => false,
    };
    encapsulated && is_host(identity_of(t.family, &t.daddr))
}

/// Whether a pod may send an ARP frame with this sender address: its own IPv4 address,
/// or none (`0.0.0.0`: an address probe). An interface not programmed yet may not claim a
/// programmed pod's address.
#[inline(always)]
fn arp_sender_ok(ep: &EndpointInfo, sender: &[u8; 16]) -> bool {
    if packet::same_addr(sender, &packet::mapped([0; 4])) {
        return true;
    }
    if ep.flags & (EP_HAS_IPV4 | EP_HAS_IPV6) == 0 {
        return !is_local_pod(sender);
    }
    ep.flags & EP_HAS_IPV4 != 0 && packet::same_addr(sender, &ep.ipv4)
}

/// Whether a pod's neighbour discovery claims only what a pod may: no router
/// advertisements or redirects (a pod is not the node's router), and neighbour
/// advertisements only for its own address or a link-local one (which the pod's own
/// interface derives, and weir does not know).
#[inline(always)]
fn nd_claim_ok(ep: &EndpointInfo, pkt: &Packet) -> bool {
    match pkt.nd_type {
        packet::ND_ROUTER_ADVERTISEMENT | packet::ND_REDIRECT => false,
        packet::ND_NEIGHBOR_ADVERTISEMENT => {
            packet::is_link_local(&pkt.nd_target)
                || (ep.flags & EP_HAS_IPV6 != 0 && packet::same_addr(&pkt.nd_target, &ep.ipv6))
        }
        _ => true,
    }
}

/// Neighbour discovery that cannot have crossed the node: hop limit 255 (a forwarded
/// packet has less) and a link-local or unspecified source, or a link-scope destination;
/// or between pods of one bridge (see [`bridged_nd`]).
#[inline(always)]
fn link_scoped_nd(pkt: &Packet, from_pod: bool) -> bool {
    let t = &pkt.tuple;
    pkt.neighbor_discovery
        && pkt.hop_limit == 255
        && (packet::is_link_local(&t.saddr)
            || packet::is_unspecified(&t.saddr)
            || packet::is_link_local(&t.daddr)
            || packet::is_link_multicast(&t.daddr)
            || bridged_nd(pkt, from_pod))
}

/// Pods on one bridge resolve each other with their own addresses (a solicited
/// advertisement goes unicast, global to global). Towards a pod, hop limit 255 means the
/// bridge passed it, unrouted; from a pod, only towards another local pod, whose own hook
/// decides again if the node routes it instead (at hop limit 254).
#[inline(always)]
fn bridged_nd(pkt: &Packet, from_pod: bool) -> bool {
    !from_pod || is_local_pod(&pkt.tuple.daddr)
}

/// Whether `addr` is one of this node's pods' (WEIR_LOCAL).
#[inline(always)]
fn is_local_pod(addr: &[u8; 16]) -> bool {
    unsafe { WEIR_LOCAL.get(&IdentityKey { addr: *addr }) }.is_some()
}

#[inline(always)]
fn decide(tc: &TcContext, direction: Direction) -> i32 {
    let ctx = &tc.skb;
    let ifindex = unsafe { (*ctx.skb).ifindex };
    // No ENDPOINT entry: not (or no longer) a pod we enforce for. The agent writes the
    // entry before it attaches and detaches before it deletes the entry, so this only
    // protects unrelated interfaces from a leftover filter. The node's other interfaces
    // carry `weir_to_pod` for deferred packets only.
    let ep = (unsafe { WEIR_ENDPOINT.get(&ifindex) }).copied();
    let mut deferred_client = 0;
    // The client's own address, when kube-proxy masqueraded a deferred packet.
    let mut original_source = None;
    if direction == Direction::Ingress {
        // A pod's packet to a Service frontend, DNATed on its way here: the client's
        // egress is judged on the backend first.
        let mark = unsafe { (*ctx.skb).mark };
        deferred_client = (mark & DEFER_MARK_MASK) >> DEFER_MARK_SHIFT;
        if deferred_client != 0 {
            if ep.is_some() {
                // A pod's hook is the packet's last: the backend's ingress comes next.
                unsafe { (*ctx.skb).mark = mark & !DEFER_MARK_ALL };
            }
            let Some(pkt) = SCRATCH.get_ptr_mut(0) else {
                return TC_ACT_SHOT;
            };
            let pkt = unsafe { &mut *pkt };
            let now = unsafe { bpf_ktime_get_ns() };
            let isolated = mark & DEFER_MARK_EGRESS_ISOLATED != 0;
            match judge_deferred(ctx, ifindex, deferred_client, isolated, pkt, now) {
                Deferred::Drop => {
                    ct_forget_deferred(pkt, deferred_client);
                    return TC_ACT_SHOT;
                }
                Deferred::Allow(source) => original_source = source,
            }
        }
    }
    let Some(ep) = ep else {
        return TC_ACT_OK;
    };
    let isolated = ep.flags
        & if direction == Direction::Ingress {
            EP_INGRESS_ISOLATED
        } else {
            EP_EGRESS_ISOLATED
        }
        != 0;
    let Some(pkt) = SCRATCH.get_ptr_mut(0) else {
        return TC_ACT_SHOT;
    };
    let pkt = unsafe { &mut *pkt };
    let now = unsafe { bpf_ktime_get_ns() };
    let mut v = Reporter {
        ifindex,
        endpoint_id: ep.endpoint_id,
        direction,
        identity: 0,
    };
    let rc = judge(
        tc,
        direction,
        &ep,
        isolated,
        pkt,
        &mut v,
        original_source,
        now,
    );
    if rc == TC_ACT_OK && pkt.frag.kind == packet::FRAG_FIRST {
        frag_record(pkt, ep.endpoint_id, direction, now);
    }
    if rc != TC_ACT_OK && deferred_client != 0 {
        // The backend refused it: the client's entries for the flow go too.
        ct_forget_deferred(pkt, deferred_client);
    }
    rc
}

enum Deferred {
    Drop,
    /// Allowed; the client's address before SNAT, if kube-proxy changed it.
    Allow(Option<[u8; 16]>),
}

/// The client's egress verdict on a deferred packet, after DNAT (see the module
/// documentation). The client is the endpoint whose id the mark carried; its source
/// may have been SNATed meanwhile (a nodePort, a hairpin), its destination is the
/// backend.
#[inline(always)]
fn judge_deferred(
    ctx: &SkBuff,
    ifindex: u32,
    client: u32,
    isolated: bool,
    pkt: &mut Packet,
    now: u64,
) -> Deferred {
    if !matches!(packet::parse(ctx, pkt), Ok(Frame::Ip)) {
        // Only an IP packet from a pod is ever marked.
        Reporter::client(ifindex, client).drop(
            ctx,
            &pkt.tuple,
            COUNTER_MALFORMED,
            Reason::Malformed,
            now,
        );
        return Deferred::Drop;
    }
    judge_deferred_parsed(ctx, ifindex, client, isolated, pkt, now)
}

/// [`judge_deferred`] on a packet already parsed into `pkt`.
#[inline(always)]
fn judge_deferred_parsed(
    ctx: &SkBuff,
    ifindex: u32,
    client: u32,
    isolated: bool,
    pkt: &mut Packet,
    now: u64,
) -> Deferred {
    let mut v = Reporter::client(ifindex, client);
    // Masqueraded (a nodePort, a hairpin): the client's own address of the family.
    let original_source = unsafe { WEIR_ENDPOINT_BY_ID.get(&client) }.and_then(|c| {
        let own = if pkt.tuple.family == 4 {
            (c.flags & EP_HAS_IPV4 != 0).then_some(c.ipv4)
        } else {
            (c.flags & EP_HAS_IPV6 != 0).then_some(c.ipv6)
        };
        own.filter(|a| !packet::same_addr(a, &pkt.tuple.saddr))
    });
    if pkt.frag.kind == packet::FRAG_LATER && frag_follow(pkt, client, Direction::Egress, now) {
        count(ctx, COUNTER_FRAGMENT_FOLLOWED);
    }
    if ct_lookup(
        &mut pkt.key,
        client,
        Direction::Egress,
        &pkt.tuple,
        false,
        now,
    ) != Seen::No
    {
        v.allow(ctx, &pkt.tuple, COUNTER_REPLY, Reason::Established);
        return Deferred::Allow(original_source);
    }
    let (counter, reason, rule) = if isolated {
        let identity = identity_of(pkt.tuple.family, &pkt.tuple.daddr);
        v.identity = identity;
        let host = is_host(identity);
        let rule = if host {
            host_policy_value(client, identity, Direction::Egress, &pkt.tuple)
        } else {
            policy_value(client, identity, Direction::Egress, &pkt.tuple)
        };
        if host && rule == 0 {
            (COUNTER_HOST, Reason::Host, 0)
        } else if allows(rule) {
            (rule, Reason::PolicyAllow, rule)
        } else {
            count(ctx, drop_counter(rule, Direction::Egress));
            let id = rule_id(rule);
            v.emit(ctx, &pkt.tuple, Verdict::Drop, Reason::PolicyDeny, id, now);
            return Deferred::Drop;
        }
    } else {
        (COUNTER_NOT_ISOLATED, Reason::NotIsolated, 0)
    };
    ct_track(
        ctx,
        &mut pkt.key,
        client,
        Direction::Egress,
        &pkt.tuple,
        rule,
        now,
    );
    if pkt.frag.kind == packet::FRAG_FIRST {
        frag_record(pkt, client, Direction::Egress, now);
    }
    v.allow(ctx, &pkt.tuple, counter, reason);
    Deferred::Allow(original_source)
}

/// Removes the client's entries for a deferred flow the backend's ingress dropped.
#[inline(always)]
fn ct_forget_deferred(pkt: &mut Packet, client: u32) {
    pkt.tuple
        .write_key(&mut pkt.key, client, Direction::Egress, false);
    ct_remove(&pkt.key);
    let defer_key = DeferKey {
        endpoint_id: client,
        sport: pkt.tuple.sport,
        protocol: pkt.tuple.protocol,
        family: pkt.tuple.family,
    };
    if let Some(before) = unsafe { WEIR_DEFER.get(&defer_key) } {
        let k = &mut pkt.key;
        k.saddr = before.saddr;
        k.daddr = before.daddr;
        k.dport = before.dport;
        ct_remove(k);
    }
}

/// Whether the packet goes to a Service frontend: its address and port, or a nodePort on
/// one of the node's addresses.
#[inline(always)]
fn to_frontend(t: &Tuple) -> bool {
    let mut key = ServiceKey {
        addr: t.daddr,
        port: t.dport,
        protocol: t.protocol,
        _pad: 0,
    };
    if unsafe { WEIR_SERVICE.get(&key) }.is_some() {
        return true;
    }
    key.addr = [0; 16];
    if unsafe { WEIR_SERVICE.get(&key) }.is_none() {
        return false;
    }
    WEIR_IDENTITY
        .get(&Key::new(128, IdentityKey { addr: t.daddr }))
        .is_some_and(|id| is_host(*id))
}

/// Passes a packet to a Service frontend on, to be judged after DNAT (module docs).
#[inline(always)]
fn defer(
    ctx: &SkBuff,
    endpoint_id: u32,
    isolated: bool,
    new_flow: bool,
    pkt: &mut Packet,
    v: &Reporter,
    now: u64,
) -> i32 {
    let t = &pkt.tuple;
    if new_flow {
        // The reply entry, as the client sent the flow: made now, while this hook has the
        // tuple before DNAT; removed again if the flow is denied after DNAT, through the
        // tuple remembered here (later packets find the entry and leave both alone).
        let key = DeferKey {
            endpoint_id,
            sport: t.sport,
            protocol: t.protocol,
            family: t.family,
        };
        let before = DeferValue {
            saddr: t.saddr,
            daddr: t.daddr,
            dport: t.dport,
            _pad: [0; 6],
        };
        let _ = WEIR_DEFER.insert(&key, &before, 0);
        ct_track(ctx, &mut pkt.key, endpoint_id, Direction::Egress, t, 0, now);
    }
    unsafe {
        let skb = ctx.skb;
        let flag = if isolated {
            DEFER_MARK_EGRESS_ISOLATED
        } else {
            0
        };
        (*skb).mark = ((*skb).mark & !DEFER_MARK_ALL) | (endpoint_id << DEFER_MARK_SHIFT) | flag;
    }
    v.allow(ctx, t, COUNTER_SERVICE_DEFERRED, Reason::ServiceDeferred)
}

/// The verdict on one frame (see the module documentation for the order).
#[inline(always)]
fn judge(
    tc: &TcContext,
    direction: Direction,
    ep: &EndpointInfo,
    isolated: bool,
    pkt: &mut Packet,
    v: &mut Reporter,
    original_source: Option<[u8; 16]>,
    now: u64,
) -> i32 {
    let ctx = &tc.skb;
    let from_pod = direction == Direction::Egress;
    let parsed = packet::parse(ctx, pkt);
    if from_pod {
        // A tag the kernel took off before TC shows only in the skb's metadata.
        let offloaded_tag = unsafe { (*ctx.skb).vlan_present } != 0;
        if offloaded_tag || matches!(parsed, Ok(Frame::Tagged)) {
            return v.drop(ctx, &pkt.tuple, COUNTER_TAGGED, Reason::Tagged, now);
        }
    }
    match parsed {
        Ok(Frame::Ip) => {}
        // ARP is outside NetworkPolicy, but a pod may claim only its own address: on a
        // bridge, another pod's would poison its neighbours' caches and take its traffic.
        Ok(Frame::Arp) => {
            if from_pod && !arp_sender_ok(ep, &pkt.tuple.saddr) {
                return v.drop(ctx, &pkt.tuple, COUNTER_SPOOFED, Reason::Spoofed, now);
            }
            return TC_ACT_OK;
        }
        // Not IP: outside NetworkPolicy. Tagged frames to a pod come from the node itself.
        Ok(Frame::NotIp) | Ok(Frame::Tagged) => return TC_ACT_OK,
        Err(()) => {
            if from_pod {
                // Its source cannot be checked.
                return v.drop(ctx, &pkt.tuple, COUNTER_MALFORMED, Reason::Malformed, now);
            }
            return if isolated { TC_ACT_SHOT } else { TC_ACT_OK };
        }
    }
    if from_pod && !source_ok(ep, &pkt.tuple) {
        return v.drop(ctx, &pkt.tuple, COUNTER_SPOOFED, Reason::Spoofed, now);
    }
    if from_pod && tunnels_to_node(pkt) {
        return v.drop(ctx, &pkt.tuple, COUNTER_SPOOFED, Reason::Spoofed, now);
    }
    if from_pod && pkt.neighbor_discovery && !nd_claim_ok(ep, pkt) {
        return v.drop(ctx, &pkt.tuple, COUNTER_SPOOFED, Reason::Spoofed, now);
    }
    if link_scoped_nd(pkt, from_pod) {
        count(ctx, COUNTER_NEIGHBOR_DISCOVERY);
        return TC_ACT_OK;
    }
    let id = ep.endpoint_id;
    if pkt.frag.kind == packet::FRAG_LATER && frag_follow(pkt, id, direction, now) {
        count(ctx, COUNTER_FRAGMENT_FOLLOWED);
    }
    if pkt.is_icmp_error && icmp_error_on_path(ctx, pkt, from_pod) {
        // The packet it reports on went the other way through this endpoint's hooks: its
        // reverse is a packet in this direction.
        if ct_lookup(&mut pkt.key, id, direction, &pkt.icmp_error_of, true, now) != Seen::No {
            return v.allow(ctx, &pkt.tuple, COUNTER_ICMP_ERROR, Reason::IcmpError);
        }
    }
    let mut seen = ct_lookup(&mut pkt.key, id, direction, &pkt.tuple, false, now);
    if seen != Seen::No && pkt.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN {
        // A SYN opens a new connection, even on the tuple of one this hook admitted (a
        // closed one, or an attacker reusing its port after the policy changed): it is
        // judged as new, and the old entry goes whatever the verdict.
        ct_remove(&pkt.key);
        seen = Seen::No;
    } else if seen != Seen::No {
        ct_follow_tcp(&pkt.key, pkt.tcp_flags);
    }
    if seen == Seen::Reply {
        return v.allow(ctx, &pkt.tuple, COUNTER_REPLY, Reason::Reply);
    }
    // Every packet to a frontend, established or not, is judged after DNAT: this hook
    // cannot know which backend kube-proxy gave the flow.
    if from_pod && id <= DEFER_MAX_ENDPOINT_ID && to_frontend(&pkt.tuple) {
        return defer(ctx, id, isolated, seen == Seen::No, pkt, v, now);
    }
    if seen == Seen::Forward {
        return v.allow(ctx, &pkt.tuple, COUNTER_REPLY, Reason::Established);
    }
    if !isolated {
        ct_track(ctx, &mut pkt.key, id, direction, &pkt.tuple, 0, now);
        return v.allow(ctx, &pkt.tuple, COUNTER_NOT_ISOLATED, Reason::NotIsolated);
    }
    let peer = match (direction, &original_source) {
        (Direction::Ingress, Some(client)) => client,
        (Direction::Ingress, None) => &pkt.tuple.saddr,
        _ => &pkt.tuple.daddr,
    };
    let mut identity = identity_of(pkt.tuple.family, peer);
    // The node's address on a packet the node forwarded rather than sent (it came in on an
    // interface): kube-proxy masqueraded a client off the node (a NodePort), or a host off
    // the node forged it. Neither is the node: judged as the world, as iptables' FORWARD
    // judges the client before SNAT. A deferred pod client is judged on its own address.
    if direction == Direction::Ingress
        && original_source.is_none()
        && is_host(identity)
        && unsafe { (*ctx.skb).ingress_ifindex } != 0
    {
        identity = IDENTITY_WORLD;
    }
    v.identity = identity;
    if identity == IDENTITY_UNLISTED_FRONTEND {
        // A frontend SERVICE had no room for: its backend, which decides, is unknown here.
        return v.drop(
            ctx,
            &pkt.tuple,
            COUNTER_UNLISTED_FRONTEND,
            Reason::UnlistedFrontend,
            now,
        );
    }
    let host = is_host(identity);
    let rule = if host {
        host_policy_value(id, identity, direction, &pkt.tuple)
    } else {
        policy_value(id, identity, direction, &pkt.tuple)
    };
    if host && rule == 0 {
        ct_track(ctx, &mut pkt.key, id, direction, &pkt.tuple, 0, now);
        return v.allow(ctx, &pkt.tuple, COUNTER_HOST, Reason::Host);
    }
    if allows(rule) {
        ct_track(ctx, &mut pkt.key, id, direction, &pkt.tuple, rule, now);
        return v.allow(ctx, &pkt.tuple, rule, Reason::PolicyAllow);
    }
    count(ctx, drop_counter(rule, direction));
    if direction == Direction::Ingress {
        ct_forget_sender(pkt);
    }
    // Compiled out by the verifier unless the agent loads with a log level (rodata).
    debug!(
        tc,
        "weir drop ifindex={} direction={} protocol={} dport={} identity={}",
        v.ifindex,
        direction as u8,
        pkt.tuple.protocol,
        pkt.tuple.dport,
        identity
    );
    v.emit(
        ctx,
        &pkt.tuple,
        Verdict::Drop,
        Reason::PolicyDeny,
        rule_id(rule),
        now,
    );
    TC_ACT_SHOT
}

/// The POLICY value for a peer of `identity`: its own entries, else the any-peer ones
/// (the world's identity has none of its own); 0 when neither has an entry.
#[inline(always)]
fn policy_value(endpoint_id: u32, identity: u32, direction: Direction, t: &Tuple) -> u32 {
    let mut value = 0;
    if identity != IDENTITY_WORLD {
        value = policy_lookup(endpoint_id, identity, direction, t);
    }
    if value == 0 {
        value = policy_lookup(endpoint_id, IDENTITY_ANY, direction, t);
    }
    value
}

/// The POLICY value for traffic with the node (a host identity): 0, allowed as the node's,
/// unless tiers judge the endpoint's egress, for which the agent writes entries under each
/// node address's identity (no any-peer fallback: the node is no pod).
#[inline(always)]
fn host_policy_value(endpoint_id: u32, identity: u32, direction: Direction, t: &Tuple) -> u32 {
    if direction != Direction::Egress {
        return 0;
    }
    policy_lookup(endpoint_id, identity, direction, t)
}

/// Whether a POLICY value admits the packet: a rule matched, and it is no drop.
#[inline(always)]
fn allows(value: u32) -> bool {
    value != 0 && value & TIER_DENY_BIT == 0
}

/// A peer's identity: the IDENTITY trie's longest match, or the world's. An IPv6 packet's
/// address inside ::ffff:0:0/96 (IPv4-mapped, which only a forged packet carries) is the
/// world's: the trie keeps IPv4 addresses there, and no IPv6 block holds that range.
#[inline(always)]
fn identity_of(family: u8, addr: &[u8; 16]) -> u32 {
    if family == 6 && packet::is_ipv4_mapped(addr) {
        return IDENTITY_WORLD;
    }
    WEIR_IDENTITY
        .get(&Key::new(128, IdentityKey { addr: *addr }))
        .copied()
        .unwrap_or(IDENTITY_WORLD)
}

#[inline(always)]
fn policy_lookup(endpoint_id: u32, identity: u32, direction: Direction, t: &Tuple) -> u32 {
    let key = Key::new(
        POLICY_PREFIX_FULL,
        PolicyKey {
            endpoint_id,
            identity,
            direction: direction as u8,
            protocol: t.protocol,
            port: t.policy_port.to_be_bytes(),
        },
    );
    WEIR_POLICY.get(&key).copied().unwrap_or(0)
}

/// Reports this hook's verdicts: counters and, rate-limited, events.
struct Reporter {
    ifindex: u32,
    endpoint_id: u32,
    direction: Direction,
    identity: u32,
}

impl Reporter {
    /// A deferred packet's client's egress, reported at the interface it reached.
    #[inline(always)]
    fn client(ifindex: u32, client: u32) -> Reporter {
        Reporter {
            ifindex,
            endpoint_id: client,
            direction: Direction::Egress,
            identity: 0,
        }
    }

    #[inline(always)]
    fn allow(&self, ctx: &SkBuff, t: &Tuple, counter: u32, reason: Reason) -> i32 {
        // An audit rule's allow is a would-be drop: always reported.
        let audit = counter & AUDIT_RULE_BIT != 0;
        count(ctx, rule_id(counter));
        let emit_allow = audit
            || WEIR_SETTINGS
                .get(SETTING_EMIT_ALLOW_EVENTS)
                .is_some_and(|v| *v != 0);
        if emit_allow {
            let now = unsafe { bpf_ktime_get_ns() };
            let verdict = if audit {
                Verdict::Audit
            } else {
                Verdict::Allow
            };
            self.emit(ctx, t, verdict, reason, counter, now);
        }
        TC_ACT_OK
    }

    /// A drop before policy (spoofed, tagged, malformed): counted and reported.
    #[inline(always)]
    fn drop(&self, ctx: &SkBuff, t: &Tuple, counter: u32, reason: Reason, now: u64) -> i32 {
        count(ctx, counter);
        self.emit(ctx, t, Verdict::Drop, reason, 0, now);
        TC_ACT_SHOT
    }

    #[inline(always)]
    fn emit(
        &self,
        ctx: &SkBuff,
        t: &Tuple,
        verdict: Verdict,
        reason: Reason,
        rule_id: u32,
        now: u64,
    ) {
        if !take_event_token(now) {
            count(ctx, COUNTER_EVENTS_SUPPRESSED);
            return;
        }
        // Written in place in the ring: no event copy on the (small) BPF stack.
        let Some(mut entry) = WEIR_EVENTS.reserve::<VerdictEvent>(0) else {
            count(ctx, COUNTER_EVENTS_SUPPRESSED);
            return;
        };
        entry.write(VerdictEvent {
            timestamp_ns: now,
            saddr: t.saddr,
            daddr: t.daddr,
            sport: t.sport,
            dport: t.dport,
            protocol: t.protocol,
            family: t.family,
            direction: self.direction as u8,
            verdict: verdict as u8,
            reason: reason as u8,
            _pad: [0; 3],
            ifindex: self.ifindex,
            endpoint_id: self.endpoint_id,
            rule_id,
            peer_identity: self.identity,
            packet_len: ctx.len(),
        });
        entry.submit(0);
    }
}

/// Per-CPU token bucket in nano-tokens: a flood of drops costs the agent at most
/// EVENT_RATE_PER_SEC events per second and CPU.
#[inline(always)]
fn take_event_token(now: u64) -> bool {
    let rate = unsafe { core::ptr::read_volatile(&EVENT_RATE_PER_SEC) };
    let Some(state) = WEIR_RATE.get_ptr_mut(0) else {
        return false;
    };
    let state = unsafe { &mut *state };
    let cap = rate * NS_PER_SEC;
    let elapsed = now.saturating_sub(state.last_ns).min(NS_PER_SEC);
    let tokens = (state.tokens + elapsed * rate).min(cap);
    state.last_ns = now;
    if tokens < NS_PER_SEC {
        state.tokens = tokens;
        return false;
    }
    state.tokens = tokens - NS_PER_SEC;
    true
}

#[inline(always)]
fn count(ctx: &SkBuff, index: u32) {
    if let Some(c) = WEIR_COUNTERS.get_ptr_mut(index) {
        let c = unsafe { &mut *c };
        c.packets += 1;
        c.bytes += ctx.len() as u64;
    }
}

#[inline(always)]
fn ct_timeout(protocol: u8, flags: u32) -> u64 {
    if protocol != packet::IPPROTO_TCP {
        CT_TIMEOUT_OTHER_NS
    } else if flags & CT_FLAG_CLOSING != 0 {
        CT_TIMEOUT_CLOSING_NS
    } else {
        CT_TIMEOUT_TCP_NS
    }
}

/// Whether an ICMP error travels the path of the packet it reports on, and may therefore
/// pass as part of that packet's flow: it goes to the reported packet's source, it comes
/// from that packet's destination (or, towards a pod, from a router on the path: any
/// address but another pod of this node), and it is no longer than an error may be. A
/// pod cannot otherwise reach, under the cover of its own flow, a peer its policy denies,
/// nor carry more than an error's bytes; the kernel's conntrack makes the same address
/// checks for the iptables dataplane. Anything else is judged as a packet of its own.
#[inline(always)]
fn icmp_error_on_path(ctx: &SkBuff, pkt: &Packet, from_pod: bool) -> bool {
    let len = ctx.len().saturating_sub(packet::ETH_HLEN as u32);
    let max = if pkt.tuple.family == 4 {
        ICMP_ERROR_MAX_V4
    } else {
        ICMP_ERROR_MAX_V6
    };
    let inner = &pkt.icmp_error_of;
    if len > max || !packet::same_addr(&pkt.tuple.daddr, &inner.saddr) {
        return false;
    }
    if packet::same_addr(&pkt.tuple.saddr, &inner.daddr) {
        return true;
    }
    !from_pod && !is_local_pod(&pkt.tuple.saddr)
}

/// Removes the entry `key` names from both CT tables.
#[inline(always)]
fn ct_remove(key: &CtKey) {
    let _ = WEIR_CT.remove(key);
    let _ = WEIR_CT_OVERFLOW.remove(key);
}

/// TCP state for an entry a packet just matched: an RST ends the flow (the entry goes,
/// after this packet), a FIN starts its close (the entry outlives it only by TIME_WAIT).
#[inline(always)]
fn ct_follow_tcp(key: &CtKey, tcp_flags: u8) {
    if tcp_flags & TCP_RST != 0 {
        ct_remove(key);
    } else if tcp_flags & TCP_FIN != 0 {
        let v = match WEIR_CT.get_ptr_mut(key) {
            Some(v) => v,
            None => match WEIR_CT_OVERFLOW.get_ptr_mut(key) {
                Some(v) => v,
                None => return,
            },
        };
        unsafe { (*v).flags |= CT_FLAG_CLOSING };
    }
}

/// The live entry for `key` in WEIR_CT or WEIR_CT_OVERFLOW, if any.
#[inline(always)]
fn ct_alive(key: &CtKey, now: u64) -> Option<*mut CtValue> {
    let v = match WEIR_CT.get_ptr_mut(key) {
        Some(v) => v,
        None => WEIR_CT_OVERFLOW.get_ptr_mut(key)?,
    };
    let (last, flags) = unsafe { ((*v).last_seen_ns, (*v).flags) };
    if now.saturating_sub(last) < ct_timeout(key.protocol, flags) {
        Some(v)
    } else {
        None
    }
}

#[inline(always)]
fn ct_refresh(v: *mut CtValue, now: u64) {
    unsafe {
        if now.saturating_sub((*v).last_seen_ns) > CT_REFRESH_NS {
            (*v).last_seen_ns = now;
        }
    }
}

#[derive(PartialEq, Eq)]
enum Seen {
    No,
    /// A later packet in the direction this endpoint admitted the flow.
    Forward,
    /// A packet the other way: the reply of a flow this endpoint admitted.
    Reply,
}

/// Whether `t` (or its reverse, with `reversed`) belongs to a flow this endpoint's hooks
/// admitted: as a later packet at the same hook, or as a reply at the other one.
/// Refreshes the flow if so.
#[inline(always)]
fn ct_lookup(
    key: &mut CtKey,
    endpoint_id: u32,
    direction: Direction,
    t: &Tuple,
    reversed: bool,
    now: u64,
) -> Seen {
    t.write_key(key, endpoint_id, direction, reversed);
    if let Some(v) = ct_alive(key, now) {
        ct_refresh(v, now);
        return Seen::Forward;
    }
    t.write_key(key, endpoint_id, direction.opposite(), !reversed);
    if let Some(v) = ct_alive(key, now) {
        ct_refresh(v, now);
        return Seen::Reply;
    }
    Seen::No
}

#[inline(always)]
fn frag_key(pkt: &mut Packet, endpoint_id: u32, direction: Direction) {
    let k = &mut pkt.frag_key;
    k.endpoint_id = endpoint_id;
    k.saddr = pkt.tuple.saddr;
    k.daddr = pkt.tuple.daddr;
    k.id = pkt.frag.id;
    k.protocol = pkt.tuple.protocol;
    k.direction = direction as u8;
    k._pad = [0; 2];
}

/// Remembers the ports of an allowed first fragment for the datagram's later fragments.
#[inline(always)]
fn frag_record(pkt: &mut Packet, endpoint_id: u32, direction: Direction, now: u64) {
    frag_key(pkt, endpoint_id, direction);
    let value = FragValue {
        first_seen_ns: now,
        sport: pkt.tuple.sport,
        dport: pkt.tuple.dport,
        policy_port: pkt.tuple.policy_port,
        _pad: 0,
    };
    let _ = WEIR_FRAG.insert(&pkt.frag_key, &value, 0);
}

/// Gives a later fragment the ports of its datagram's first fragment, if this hook
/// allowed that one recently; it is then judged as its flow (normally: established).
/// Without a record it keeps port 0 and is judged as such (dropped where isolated,
/// unless a rule allows every port of its protocol).
#[inline(always)]
fn frag_follow(pkt: &mut Packet, endpoint_id: u32, direction: Direction, now: u64) -> bool {
    frag_key(pkt, endpoint_id, direction);
    let Some(r) = WEIR_FRAG.get_ptr(&pkt.frag_key) else {
        return false;
    };
    let r = unsafe { &*r };
    if now.saturating_sub(r.first_seen_ns) >= FRAG_TIMEOUT_NS {
        return false;
    }
    pkt.tuple.sport = r.sport;
    pkt.tuple.dport = r.dport;
    pkt.tuple.policy_port = r.policy_port;
    true
}

/// The packet was dropped by this pod's ingress: if it came from another pod on this node,
/// that pod's egress hook admitted it and made a CT entry, which must not outlive the
/// drop (it would admit the "reply" into the sender; iptables confirms no state for a
/// packet dropped in FORWARD either).
#[inline(always)]
fn ct_forget_sender(pkt: &mut Packet) {
    let Some(sender) = (unsafe {
        WEIR_LOCAL.get(&IdentityKey {
            addr: pkt.tuple.saddr,
        })
    })
    .copied() else {
        return;
    };
    pkt.tuple
        .write_key(&mut pkt.key, sender, Direction::Egress, false);
    ct_remove(&pkt.key);
}

/// Takes one token of the endpoint's budget of new WEIR_CT entries. The bucket is shared
/// by all CPUs without locking: a race can at worst hand out a token twice.
#[inline(always)]
fn ct_budget(endpoint_id: u32, now: u64) -> bool {
    let rate = unsafe { core::ptr::read_volatile(&CT_NEW_PER_SEC) };
    let burst = unsafe { core::ptr::read_volatile(&CT_NEW_BURST) };
    let Some(state) = WEIR_CT_BUDGET.get_ptr_mut(endpoint_id) else {
        return false;
    };
    let state = unsafe { &mut *state };
    let cap = burst * NS_PER_SEC;
    // Capped so that rate × elapsed cannot overflow (an idle bucket is full anyway).
    let elapsed = now.saturating_sub(state.last_ns).min(1000 * NS_PER_SEC);
    let tokens = (state.tokens + elapsed * rate).min(cap);
    state.last_ns = now;
    if tokens < NS_PER_SEC {
        state.tokens = tokens;
        return false;
    }
    state.tokens = tokens - NS_PER_SEC;
    true
}

/// Records an admitted flow for this endpoint and direction (the caller found none).
#[inline(always)]
fn ct_track(
    ctx: &SkBuff,
    key: &mut CtKey,
    endpoint_id: u32,
    direction: Direction,
    t: &Tuple,
    rule_id: u32,
    now: u64,
) {
    t.write_key(key, endpoint_id, direction, false);
    ct_insert(ctx, key, endpoint_id, rule_id, now);
}

/// Inserts `key`, charged to `endpoint_id`'s budget of new WEIR_CT entries.
#[inline(always)]
fn ct_insert(ctx: &SkBuff, key: &CtKey, endpoint_id: u32, rule_id: u32, now: u64) {
    let value = CtValue {
        last_seen_ns: now,
        rule_id,
        flags: 0,
    };
    // A full LRU evicts its oldest entry; insertion never fails for lack of space.
    if ct_budget(endpoint_id, now) {
        let _ = WEIR_CT.insert(key, &value, 0);
    } else {
        count(ctx, COUNTER_CT_OVERFLOW);
        let _ = WEIR_CT_OVERFLOW.insert(key, &value, 0);
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
