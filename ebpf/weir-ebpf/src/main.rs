//! weir's TC classifiers. One program per direction on a pod's host-side interface:
//! `weir_from_pod` (TC ingress, the pod's egress policy) and `weir_to_pod` (TC egress, the
//! pod's ingress policy). Every decision comes from maps the agent fills:
//! ENDPOINT (is this interface a pod, is the direction isolated), CT (replies and ICMP
//! errors of tracked flows), IDENTITY (peer address → identity) and POLICY (endpoint,
//! identity, direction, protocol, port → allowing rule).
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
    macros::{classifier, map},
    maps::{lpm_trie::Key, Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf},
    programs::TcContext,
};
use aya_log_ebpf::debug;
use packet::Tuple;
use weir_common::*;

/// Rodata, set by the loader: verdict events per second and CPU (also the burst).
#[unsafe(no_mangle)]
static EVENT_RATE_PER_SEC: u64 = 1000;

const NS_PER_SEC: u64 = 1_000_000_000;
/// An entry is refreshed at most once a second per direction, to keep map writes rare.
const CT_REFRESH_NS: u64 = NS_PER_SEC;
const CT_TIMEOUT_TCP_NS: u64 = 3600 * NS_PER_SEC;
const CT_TIMEOUT_OTHER_NS: u64 = 120 * NS_PER_SEC;

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
    decide(&ctx, DIR_EGRESS)
}

#[classifier]
pub fn weir_to_pod(ctx: TcContext) -> i32 {
    decide(&ctx, DIR_INGRESS)
}

#[inline(always)]
fn decide(ctx: &TcContext, direction: u8) -> i32 {
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // No ENDPOINT entry: not (or no longer) a pod we enforce for. The agent writes the
    // entry before it attaches and detaches before it deletes the entry, so this only
    // protects unrelated interfaces from a leftover filter.
    let Some(ep) = (unsafe { WEIR_ENDPOINT.get(&ifindex) }).copied() else {
        return TC_ACT_OK;
    };
    let isolated = ep.flags
        & if direction == DIR_INGRESS {
            EP_INGRESS_ISOLATED
        } else {
            EP_EGRESS_ISOLATED
        }
        != 0;
    let Some(pkt) = SCRATCH.get_ptr_mut(0) else {
        return TC_ACT_OK;
    };
    let pkt = unsafe { &mut *pkt };
    match packet::parse(ctx, pkt) {
        Ok(true) => {}
        // Not IP (ARP, ...): outside NetworkPolicy.
        Ok(false) => return TC_ACT_OK,
        Err(()) => return if isolated { TC_ACT_SHOT } else { TC_ACT_OK },
    }
    if pkt.neighbor_discovery {
        return TC_ACT_OK;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let mut v = Verdict {
        ifindex,
        endpoint_id: ep.endpoint_id,
        direction,
        identity: 0,
    };
    if pkt.is_icmp_error {
        let inner = &pkt.icmp_error_of;
        if ct_alive(&inner.key(), now).is_some() || ct_alive(&inner.reversed().key(), now).is_some()
        {
            return v.allow(ctx, &pkt.tuple, COUNTER_ICMP_ERROR, REASON_ICMP_ERROR);
        }
    }
    if ct_reply(&pkt.tuple, now) {
        return v.allow(ctx, &pkt.tuple, COUNTER_REPLY, REASON_REPLY);
    }
    if !isolated {
        ct_track(&pkt.tuple, 0, now);
        return v.allow(ctx, &pkt.tuple, COUNTER_NOT_ISOLATED, REASON_NOT_ISOLATED);
    }
    let peer = if direction == DIR_INGRESS {
        &pkt.tuple.saddr
    } else {
        &pkt.tuple.daddr
    };
    let identity = WEIR_IDENTITY
        .get(&Key::new(128, IdentityKey { addr: *peer }))
        .copied()
        .unwrap_or(IDENTITY_WORLD);
    v.identity = identity;
    if identity == IDENTITY_HOST {
        ct_track(&pkt.tuple, 0, now);
        return v.allow(ctx, &pkt.tuple, COUNTER_HOST, REASON_HOST);
    }
    let mut rule = 0;
    if identity != IDENTITY_WORLD {
        rule = policy_lookup(&ep, identity, direction, &pkt.tuple);
    }
    if rule == 0 {
        rule = policy_lookup(&ep, IDENTITY_ANY, direction, &pkt.tuple);
    }
    if rule != 0 {
        ct_track(&pkt.tuple, rule, now);
        return v.allow(ctx, &pkt.tuple, rule, REASON_POLICY_ALLOW);
    }
    count(ctx, COUNTER_DEFAULT_DENY);
    // Compiled out by the verifier unless the agent loads with a log level (rodata).
    debug!(
        ctx,
        "weir drop ifindex={} direction={} protocol={} dport={} identity={}",
        ifindex,
        direction,
        pkt.tuple.protocol,
        pkt.tuple.dport,
        identity
    );
    v.emit(ctx, &pkt.tuple, VERDICT_DROP, REASON_POLICY_DENY, 0, now);
    TC_ACT_SHOT
}

#[inline(always)]
fn policy_lookup(ep: &EndpointInfo, identity: u32, direction: u8, t: &Tuple) -> u32 {
    let key = Key::new(
        POLICY_PREFIX_FULL,
        PolicyKey {
            endpoint_id: ep.endpoint_id,
            identity,
            direction,
            protocol: t.protocol,
            port: t.policy_port.to_be_bytes(),
        },
    );
    WEIR_POLICY.get(&key).copied().unwrap_or(0)
}

struct Verdict {
    ifindex: u32,
    endpoint_id: u32,
    direction: u8,
    identity: u32,
}

impl Verdict {
    #[inline(always)]
    fn allow(&self, ctx: &TcContext, t: &Tuple, counter: u32, reason: u8) -> i32 {
        count(ctx, counter);
        let emit_allow = WEIR_SETTINGS
            .get(SETTING_EMIT_ALLOW_EVENTS)
            .is_some_and(|v| *v != 0);
        if emit_allow {
            let now = unsafe { bpf_ktime_get_ns() };
            self.emit(ctx, t, VERDICT_ALLOW, reason, counter, now);
        }
        TC_ACT_OK
    }

    #[inline(always)]
    fn emit(&self, ctx: &TcContext, t: &Tuple, verdict: u8, reason: u8, rule_id: u32, now: u64) {
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
            direction: self.direction,
            verdict,
            reason,
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
fn count(ctx: &TcContext, index: u32) {
    if let Some(c) = WEIR_COUNTERS.get_ptr_mut(index) {
        let c = unsafe { &mut *c };
        c.packets += 1;
        c.bytes += ctx.len() as u64;
    }
}

#[inline(always)]
fn ct_timeout(protocol: u8) -> u64 {
    if protocol == packet::IPPROTO_TCP {
        CT_TIMEOUT_TCP_NS
    } else {
        CT_TIMEOUT_OTHER_NS
    }
}

/// The live entry for `key`, if any.
#[inline(always)]
fn ct_alive(key: &CtKey, now: u64) -> Option<*mut CtValue> {
    let v = WEIR_CT.get_ptr_mut(key)?;
    let last = unsafe { (*v).last_seen_ns };
    if now.saturating_sub(last) < ct_timeout(key.protocol) {
        Some(v)
    } else {
        None
    }
}

/// Whether `t` is the reply of a tracked flow; refreshes the flow if so.
#[inline(always)]
fn ct_reply(t: &Tuple, now: u64) -> bool {
    let Some(v) = ct_alive(&t.reversed().key(), now) else {
        return false;
    };
    unsafe {
        if now.saturating_sub((*v).last_seen_ns) > CT_REFRESH_NS {
            (*v).last_seen_ns = now;
        }
    }
    true
}

/// Records (or refreshes) an admitted flow so its replies pass.
#[inline(always)]
fn ct_track(t: &Tuple, rule_id: u32, now: u64) {
    let key = t.key();
    if let Some(v) = WEIR_CT.get_ptr_mut(&key) {
        unsafe {
            if now.saturating_sub((*v).last_seen_ns) > CT_REFRESH_NS {
                (*v).last_seen_ns = now;
            }
        }
        return;
    }
    let value = CtValue {
        last_seen_ns: now,
        rule_id,
        _pad: 0,
    };
    // A full LRU evicts its oldest entry; insertion never fails for lack of space.
    let _ = WEIR_CT.insert(&key, &value, 0);
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
