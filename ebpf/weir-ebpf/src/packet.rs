//! Header parsing. IPv4 addresses become IPv4-mapped IPv6.
//!
//! The common frame (untagged Ethernet, IPv4 with no options and not a fragment or IPv6
//! with no extension header, then TCP or UDP) is read straight from the packet's linear
//! data: one bounds check, no helper call ([`parse_linear`]). Every other frame, and one
//! whose headers are not all in the linear data, is read with bpf_skb_load_bytes, one
//! call per field (bounds are the helper's, which keeps the verifier simple on old
//! kernels). Both fill [`Packet`] alike for the frames the first one takes.
//!
//! IPv6 extension headers (hop-by-hop, routing, fragment, destination options, AH) are
//! walked, at most [`MAX_EXT_HEADERS`] of them; a packet with more is unreadable. IPv4
//! and IPv6 fragments are reported in [`Packet::frag`]: non-first fragments have no ports
//! here; the caller restores them from the first fragment's record.
//!
//! VLAN-tagged frames (802.1Q, 802.1ad, the old 0x9100) are reported as [`Frame::Tagged`]
//! and never parsed further: a tag the kernel has already taken off shows up in
//! `skb->vlan_present` instead, which the caller checks.

use aya_ebpf::{cty::c_void, helpers::bpf_skb_load_bytes, programs::sk_buff::SkBuff};
use weir_common::{CtKey, Direction, FragKey};

pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;
pub const IPPROTO_ICMPV6: u8 = 58;
/// Encapsulations a node may take apart: IPv4-in-IP, IPv6-in-IP, GRE.
pub const IPPROTO_IPIP: u8 = 4;
pub const IPPROTO_IPV6: u8 = 41;
pub const IPPROTO_GRE: u8 = 47;
/// UDP ports of VXLAN (IANA's and Linux's/flannel's) and Geneve.
pub const TUNNEL_UDP_PORTS: [u16; 3] = [4789, 8472, 6081];

/// ICMPv6 neighbour discovery types ([`Packet::nd_type`]).
pub const ND_ROUTER_ADVERTISEMENT: u8 = 134;
pub const ND_NEIGHBOR_ADVERTISEMENT: u8 = 136;
pub const ND_REDIRECT: u8 = 137;

/// TCP header flags ([`Packet::tcp_flags`]).
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

pub const ETH_HLEN: usize = 14;
/// Extension headers walked before the upper-layer header.
pub const MAX_EXT_HEADERS: usize = 6;

/// [`Frag::kind`]: not a fragment.
pub const FRAG_NONE: u8 = 0;
/// The first fragment (offset 0, more to come): it has the L4 header.
pub const FRAG_FIRST: u8 = 1;
/// A later fragment: no L4 header.
pub const FRAG_LATER: u8 = 2;

/// Fragmentation of a packet: kind and IP identification (IPv6: the fragment header's).
#[derive(Clone, Copy)]
pub struct Frag {
    pub kind: u8,
    pub id: u32,
}
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_ARP: u16 = 0x0806;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const ETH_P_QINQ_OLD: u16 = 0x9100;

/// The flow a packet belongs to, as the conntrack table and the events see it.
#[derive(Clone, Copy)]
pub struct Tuple {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    /// Destination port for the POLICY lookup (0 for protocols without ports).
    pub policy_port: u16,
    pub protocol: u8,
    pub family: u8,
}

impl Tuple {
    /// Writes the conntrack key of this tuple (or of its reverse) as seen by the hook of
    /// `endpoint_id` in `direction` into `k` (scratch map memory: no stack copy).
    #[inline(always)]
    pub fn write_key(&self, k: &mut CtKey, endpoint_id: u32, direction: Direction, reversed: bool) {
        k.endpoint_id = endpoint_id;
        k.direction = direction as u8;
        k.protocol = self.protocol;
        k._pad = [0; 2];
        if reversed {
            k.saddr = self.daddr;
            k.daddr = self.saddr;
            k.sport = self.dport;
            k.dport = self.sport;
        } else {
            k.saddr = self.saddr;
            k.daddr = self.daddr;
            k.sport = self.sport;
            k.dport = self.dport;
        }
    }

    #[inline(always)]
    pub fn clear(&mut self) {
        self.saddr = [0; 16];
        self.daddr = [0; 16];
        self.sport = 0;
        self.dport = 0;
        self.policy_port = 0;
        self.protocol = 0;
        self.family = 0;
    }
}

pub struct Packet {
    pub tuple: Tuple,
    /// IPv6 hop limit (0 for IPv4): neighbour discovery is only trusted at 255.
    pub hop_limit: u8,
    /// The TCP header's flags byte (0 for other protocols and later fragments).
    pub tcp_flags: u8,
    pub is_icmp_error: bool,
    /// For an ICMP error: the packet it reports on (as that packet was sent).
    pub icmp_error_of: Tuple,
    /// ICMPv6 router/neighbor solicitation/advertisement and redirect: always allowed,
    /// since IPv6 cannot work without them.
    pub neighbor_discovery: bool,
    /// The ICMPv6 type of neighbour discovery (133-137), else 0.
    pub nd_type: u8,
    /// A neighbour advertisement's target address (what the sender announces).
    pub nd_target: [u8; 16],
    /// Conntrack key scratch (44 bytes the BPF stack need not hold).
    pub key: CtKey,
    pub frag: Frag,
    /// Fragmentation of the packet inside an ICMP error (not used).
    pub inner_frag: Frag,
    /// Fragment-record key scratch.
    pub frag_key: FragKey,
}

/// What kind of frame [`parse`] saw.
pub enum Frame {
    Ip,
    /// ARP: outside NetworkPolicy, but its sender address is the pod's claim to an
    /// address (in the tuple's `saddr`, IPv4-mapped).
    Arp,
    /// Everything else that is neither IP nor tagged: outside NetworkPolicy.
    NotIp,
    /// A VLAN tag still in the frame (QinQ's inner tag, or a tag not offloaded).
    Tagged,
}

enum Icmp {
    None,
    Error,
    NeighborDiscovery,
}

/// Fills `pkt` for IP frames; `Err` for truncated IP packets (and frames shorter than an
/// Ethernet header). The tuple is cleared for anything that is not IP.
#[inline(always)]
pub fn parse(ctx: &SkBuff, pkt: &mut Packet) -> Result<Frame, ()> {
    if parse_linear(ctx, pkt) {
        return Ok(Frame::Ip);
    }
    clear(pkt);
    let ethertype = u16::from_be(ctx.load::<u16>(12).map_err(|_| ())?);
    let family = match ethertype {
        ETH_P_IP => 4,
        ETH_P_IPV6 => 6,
        ETH_P_8021Q | ETH_P_8021AD | ETH_P_QINQ_OLD => return Ok(Frame::Tagged),
        ETH_P_ARP => {
            // Sender protocol address: after hardware and protocol types (2 + 2), their
            // lengths (1 + 1), the operation (2) and the sender's hardware address (6).
            let spa: [u8; 4] = ctx.load(ETH_HLEN + 14).map_err(|_| ())?;
            pkt.tuple.saddr = mapped(spa);
            pkt.tuple.family = 4;
            return Ok(Frame::Arp);
        }
        _ => return Ok(Frame::NotIp),
    };
    parse_ip(ctx, pkt, ETH_HLEN, family)
}

/// The header bytes [`parse_linear`] needs, from the frame's start: Ethernet, then IPv4
/// (20) or IPv6 (40), then UDP's ports and length (8) or TCP up to its flags byte (14).
const LINEAR_V4_UDP: usize = ETH_HLEN + 20 + 8;
const LINEAR_V4_TCP: usize = ETH_HLEN + 20 + 14;
const LINEAR_V6_UDP: usize = ETH_HLEN + 40 + 8;
const LINEAR_V6_TCP: usize = ETH_HLEN + 40 + 14;

/// Reads `T` at `offset` of the linear data that starts at `data`; the caller has checked
/// that `data + offset + size_of::<T>()` is within it.
#[inline(always)]
unsafe fn read_at<T: Copy>(data: usize, offset: usize) -> T {
    // SAFETY: per the caller; packet data has no alignment.
    unsafe { core::ptr::read_unaligned((data + offset) as *const T) }
}

/// The fast path of [`parse`]: fills `pkt` as the helper-based parse would and returns
/// true for an untagged Ethernet frame with IPv4 (header of 20 bytes, not a fragment) or
/// IPv6 (no extension header) carrying TCP or UDP, when all those headers are in the
/// packet's linear data. Returns false, having written nothing that parse does not
/// clear, for everything else. Only TC programs call it: a socket filter may not read
/// packet data directly.
#[inline(always)]
fn parse_linear(ctx: &SkBuff, pkt: &mut Packet) -> bool {
    // SAFETY: the skb pointer is the program's context.
    let (data, data_end) = unsafe { ((*ctx.skb).data as usize, (*ctx.skb).data_end as usize) };
    // The shortest frame taken here; each case checks its own length before reading more
    // (constant lengths, repeated per case: the verifier ties a read to a check on the
    // same constant, not to a length computed from the family).
    // A frame that fails a check takes the helper path.
    if data + LINEAR_V4_UDP > data_end {
        return false;
    }
    // SAFETY (each read_at): the offset and size are within a length checked before it.
    let ethertype = u16::from_be(unsafe { read_at::<u16>(data, 12) });
    let t = &mut pkt.tuple;
    match ethertype {
        ETH_P_IP => {
            let l3 = ETH_HLEN;
            let vihl: u8 = unsafe { read_at(data, l3) };
            let flags_offset = u16::from_be(unsafe { read_at::<u16>(data, l3 + 6) });
            let protocol: u8 = unsafe { read_at(data, l3 + 9) };
            // Options, fragments (more to come, or a later one): the helper path.
            if vihl != 0x45 || flags_offset & 0x3fff != 0 {
                return false;
            }
            let l4 = l3 + 20;
            if protocol == IPPROTO_TCP {
                if data + LINEAR_V4_TCP > data_end {
                    return false;
                }
                pkt.tcp_flags = unsafe { read_at(data, l4 + 13) };
            } else if protocol == IPPROTO_UDP {
                pkt.tcp_flags = 0;
            } else {
                return false;
            }
            t.saddr = mapped(unsafe { read_at::<[u8; 4]>(data, l3 + 12) });
            t.daddr = mapped(unsafe { read_at::<[u8; 4]>(data, l3 + 16) });
            t.sport = u16::from_be(unsafe { read_at::<u16>(data, l4) });
            t.dport = u16::from_be(unsafe { read_at::<u16>(data, l4 + 2) });
            t.protocol = protocol;
            t.family = 4;
            pkt.hop_limit = 0;
        }
        ETH_P_IPV6 => {
            if data + LINEAR_V6_UDP > data_end {
                return false;
            }
            let l3 = ETH_HLEN;
            let next: u8 = unsafe { read_at(data, l3 + 6) };
            let l4 = l3 + 40;
            if next == IPPROTO_TCP {
                if data + LINEAR_V6_TCP > data_end {
                    return false;
                }
                pkt.tcp_flags = unsafe { read_at(data, l4 + 13) };
            } else if next == IPPROTO_UDP {
                pkt.tcp_flags = 0;
            } else {
                return false;
            }
            t.saddr = unsafe { read_at::<[u8; 16]>(data, l3 + 8) };
            t.daddr = unsafe { read_at::<[u8; 16]>(data, l3 + 24) };
            t.sport = u16::from_be(unsafe { read_at::<u16>(data, l4) });
            t.dport = u16::from_be(unsafe { read_at::<u16>(data, l4 + 2) });
            t.protocol = next;
            t.family = 6;
            pkt.hop_limit = unsafe { read_at(data, l3 + 7) };
        }
        _ => return false,
    }
    t.policy_port = t.dport;
    pkt.is_icmp_error = false;
    pkt.neighbor_discovery = false;
    pkt.nd_type = 0;
    pkt.frag = Frag {
        kind: FRAG_NONE,
        id: 0,
    };
    true
}

/// Fills `pkt` from a packet whose IP header is at offset 0: netfilter's view, where the
/// iptables `bpf` match runs a program. `Err` for truncated packets.
#[inline(always)]
pub fn parse_from_l3(ctx: &SkBuff, pkt: &mut Packet) -> Result<Frame, ()> {
    clear(pkt);
    let version: u8 = ctx.load(0).map_err(|_| ())?;
    match version >> 4 {
        4 => parse_ip(ctx, pkt, 0, 4),
        6 => parse_ip(ctx, pkt, 0, 6),
        _ => Ok(Frame::NotIp),
    }
}

#[inline(always)]
fn clear(pkt: &mut Packet) {
    pkt.tuple.clear();
    pkt.is_icmp_error = false;
    pkt.neighbor_discovery = false;
    pkt.hop_limit = 0;
    pkt.tcp_flags = 0;
    pkt.frag = Frag {
        kind: FRAG_NONE,
        id: 0,
    };
}

/// The IP header at `l3` and what follows it.
#[inline(always)]
fn parse_ip(ctx: &SkBuff, pkt: &mut Packet, l3: usize, family: u8) -> Result<Frame, ()> {
    let l4 = parse_l3(ctx, l3, family, &mut pkt.tuple, &mut pkt.frag)?;
    if family == 6 {
        pkt.hop_limit = ctx.load(l3 + 7).map_err(|_| ())?;
    }
    let icmp = parse_l4(ctx, &mut pkt.tuple, l4)?;
    if pkt.tuple.protocol == IPPROTO_TCP && l4 != usize::MAX {
        pkt.tcp_flags = ctx.load(l4 + 13).map_err(|_| ())?;
    }
    pkt.neighbor_discovery = matches!(icmp, Icmp::NeighborDiscovery);
    pkt.nd_type = 0;
    if pkt.neighbor_discovery {
        pkt.nd_type = ctx.load(l4).map_err(|_| ())?;
        if pkt.nd_type == ND_NEIGHBOR_ADVERTISEMENT {
            // The target follows the type, code, checksum and flags (8 bytes).
            load_addr(ctx, l4 + 8, &mut pkt.nd_target)?;
        }
    }
    pkt.is_icmp_error = matches!(icmp, Icmp::Error);
    if pkt.is_icmp_error {
        // The offending packet follows the 8-byte ICMP header.
        let inner_l4 = parse_l3(
            ctx,
            l4 + 8,
            family,
            &mut pkt.icmp_error_of,
            &mut pkt.inner_frag,
        )?;
        // Only the first 8 bytes of the inner L4 header are guaranteed: enough for ports.
        parse_l4(ctx, &mut pkt.icmp_error_of, inner_l4)?;
    }
    Ok(Frame::Ip)
}

/// Fills `t` (ports zero) and `frag`, and returns the offset of the L4 header;
/// usize::MAX means "no L4 header" (a non-first fragment).
#[inline(always)]
fn parse_l3(
    ctx: &SkBuff,
    off: usize,
    family: u8,
    t: &mut Tuple,
    frag: &mut Frag,
) -> Result<usize, ()> {
    t.sport = 0;
    t.dport = 0;
    t.policy_port = 0;
    t.family = family;
    frag.kind = FRAG_NONE;
    frag.id = 0;
    if family == 4 {
        let vihl: u8 = ctx.load(off).map_err(|_| ())?;
        let id = u16::from_be(ctx.load::<u16>(off + 4).map_err(|_| ())?);
        let flags_offset = u16::from_be(ctx.load::<u16>(off + 6).map_err(|_| ())?);
        t.protocol = ctx.load(off + 9).map_err(|_| ())?;
        let s: [u8; 4] = ctx.load(off + 12).map_err(|_| ())?;
        let d: [u8; 4] = ctx.load(off + 16).map_err(|_| ())?;
        t.saddr = mapped(s);
        t.daddr = mapped(d);
        let more = flags_offset & 0x2000 != 0;
        let offset = flags_offset & 0x1fff;
        if offset != 0 {
            frag.kind = FRAG_LATER;
            frag.id = u32::from(id);
            return Ok(usize::MAX);
        }
        if more {
            frag.kind = FRAG_FIRST;
            frag.id = u32::from(id);
        }
        return Ok(off + ((vihl & 0x0f) as usize) * 4);
    }
    load_addr(ctx, off + 8, &mut t.saddr)?;
    load_addr(ctx, off + 24, &mut t.daddr)?;
    let mut next: u8 = ctx.load(off + 6).map_err(|_| ())?;
    let mut l4 = off + 40;
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            // Hop-by-hop, routing, destination options: length in 8-octet units, not
            // counting the first 8.
            0 | 43 | 60 => {
                let len: u8 = ctx.load(l4 + 1).map_err(|_| ())?;
                next = ctx.load(l4).map_err(|_| ())?;
                l4 += (len as usize + 1) * 8;
            }
            // Fragment: 8 octets; offset in the top 13 bits of bytes 2-3, then the id.
            44 => {
                let offset = u16::from_be(ctx.load::<u16>(l4 + 2).map_err(|_| ())?) & 0xfff8;
                frag.id = u32::from_be(ctx.load::<u32>(l4 + 4).map_err(|_| ())?);
                frag.kind = if offset != 0 { FRAG_LATER } else { FRAG_FIRST };
                next = ctx.load(l4).map_err(|_| ())?;
                l4 += 8;
            }
            // Authentication header: length in 4-octet units, not counting the first 2.
            51 => {
                let len: u8 = ctx.load(l4 + 1).map_err(|_| ())?;
                next = ctx.load(l4).map_err(|_| ())?;
                l4 += (len as usize + 2) * 4;
            }
            _ => break,
        }
        if frag.kind == FRAG_LATER {
            break;
        }
    }
    if matches!(next, 0 | 43 | 44 | 51 | 60) && frag.kind != FRAG_LATER {
        // More extension headers than we walk: unreadable.
        return Err(());
    }
    t.protocol = next;
    if frag.kind == FRAG_LATER {
        return Ok(usize::MAX);
    }
    Ok(l4)
}

#[inline(always)]
fn parse_l4(ctx: &SkBuff, t: &mut Tuple, l4: usize) -> Result<Icmp, ()> {
    if l4 == usize::MAX {
        return Ok(Icmp::None);
    }
    match t.protocol {
        IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP => {
            t.sport = u16::from_be(ctx.load::<u16>(l4).map_err(|_| ())?);
            t.dport = u16::from_be(ctx.load::<u16>(l4 + 2).map_err(|_| ())?);
            t.policy_port = t.dport;
            Ok(Icmp::None)
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 => {
            let ty: u8 = ctx.load(l4).map_err(|_| ())?;
            let v6 = t.protocol == IPPROTO_ICMPV6;
            let (request, reply) = if v6 { (128, 129) } else { (8, 0) };
            if ty == request || ty == reply {
                let id = u16::from_be(ctx.load::<u16>(l4 + 4).map_err(|_| ())?);
                // Requests and replies get mirrored tuples, so a reply is the reverse.
                if ty == request {
                    t.sport = id;
                } else {
                    t.dport = id;
                }
                return Ok(Icmp::None);
            }
            let error = if v6 {
                (1..=4).contains(&ty)
            } else {
                matches!(ty, 3 | 4 | 5 | 11 | 12)
            };
            if error {
                Ok(Icmp::Error)
            } else if v6 && (133..=137).contains(&ty) {
                Ok(Icmp::NeighborDiscovery)
            } else {
                Ok(Icmp::None)
            }
        }
        _ => Ok(Icmp::None),
    }
}

/// Copies 16 bytes straight into `dst` (map memory): a constant length, which the
/// verifier needs, and no stack copy.
#[inline(always)]
fn load_addr(ctx: &SkBuff, off: usize, dst: &mut [u8; 16]) -> Result<(), ()> {
    // SAFETY: dst is 16 writable bytes; the helper bounds-checks the packet.
    let rc = unsafe {
        bpf_skb_load_bytes(
            ctx.skb as *const _,
            off as u32,
            dst.as_mut_ptr() as *mut c_void,
            16,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(())
    }
}

/// Whether two 16-byte addresses are equal (two 64-bit compares: no memcmp in BPF).
#[inline(always)]
pub fn same_addr(a: &[u8; 16], b: &[u8; 16]) -> bool {
    let (a, b) = (a.as_ptr() as *const u64, b.as_ptr() as *const u64);
    // SAFETY: both point to 16 readable bytes.
    unsafe {
        core::ptr::read_unaligned(a) == core::ptr::read_unaligned(b)
            && core::ptr::read_unaligned(a.add(1)) == core::ptr::read_unaligned(b.add(1))
    }
}

/// fe80::/10.
#[inline(always)]
pub fn is_link_local(a: &[u8; 16]) -> bool {
    a[0] == 0xfe && a[1] & 0xc0 == 0x80
}

/// ::ffff:0:0/96, IPv4-mapped: where the IDENTITY trie keeps IPv4 addresses.
#[inline(always)]
pub fn is_ipv4_mapped(a: &[u8; 16]) -> bool {
    // Two loads, as in same_addr: no memcmp in BPF.
    let p = a.as_ptr();
    // SAFETY: `a` has 16 readable bytes; these reads cover bytes 0..8 and 8..12.
    unsafe {
        core::ptr::read_unaligned(p as *const u64) == 0
            && core::ptr::read_unaligned(p.add(8) as *const u32)
                == u32::from_ne_bytes([0, 0, 0xff, 0xff])
    }
}

/// `::`, the source of duplicate address detection.
#[inline(always)]
pub fn is_unspecified(a: &[u8; 16]) -> bool {
    same_addr(a, &[0; 16])
}

/// ff02::/16 (and other link-scope multicast: ffX2::/16).
#[inline(always)]
pub fn is_link_multicast(a: &[u8; 16]) -> bool {
    a[0] == 0xff && a[1] & 0x0f == 0x02
}

#[inline(always)]
pub fn mapped(a: [u8; 4]) -> [u8; 16] {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a[0], a[1], a[2], a[3],
    ]
}
