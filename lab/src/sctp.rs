//! Just enough SCTP (RFC 9260) to open an association's first half: an INIT and the
//! INIT-ACK that answers it, valid for conntrack (nf_conntrack_proto_sctp) and for any
//! dataplane that tracks SCTP. The kernel has no SCTP sockets here, so these travel over
//! raw IP sockets of protocol 132.

pub const IPPROTO_SCTP: i32 = 132;
const CHUNK_INIT: u8 = 1;
const CHUNK_INIT_ACK: u8 = 2;
const PARAM_STATE_COOKIE: u16 = 7;
const COMMON_HEADER_LEN: usize = 12;

/// The fields of an INIT or INIT-ACK that the lab cares about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub src_port: u16,
    pub dst_port: u16,
    /// The verification tag of the common header.
    pub vtag: u32,
    pub kind: ChunkKind,
    /// The chunk's Initiate Tag: the tag the peer must put in its replies.
    pub initiate_tag: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkKind {
    Init,
    InitAck,
}

/// An INIT from `src_port` to `dst_port` (verification tag 0, as RFC 9260 requires).
pub fn init(src_port: u16, dst_port: u16, initiate_tag: u32) -> Vec<u8> {
    packet(src_port, dst_port, 0, CHUNK_INIT, initiate_tag, &[])
}

/// The INIT-ACK answering `init`, carrying our own initiate tag and a state cookie.
pub fn init_ack(init: &Chunk, initiate_tag: u32) -> Vec<u8> {
    let cookie = init.initiate_tag.to_be_bytes();
    packet(
        init.dst_port,
        init.src_port,
        init.initiate_tag,
        CHUNK_INIT_ACK,
        initiate_tag,
        &cookie,
    )
}

fn packet(src: u16, dst: u16, vtag: u32, kind: u8, initiate_tag: u32, cookie: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(64);
    p.extend_from_slice(&src.to_be_bytes());
    p.extend_from_slice(&dst.to_be_bytes());
    p.extend_from_slice(&vtag.to_be_bytes());
    p.extend_from_slice(&[0; 4]); // checksum, filled below
    let param_len = if cookie.is_empty() {
        0
    } else {
        4 + cookie.len()
    };
    let chunk_len = 20 + param_len;
    p.push(kind);
    p.push(0); // flags
    p.extend_from_slice(&(chunk_len as u16).to_be_bytes());
    p.extend_from_slice(&initiate_tag.to_be_bytes());
    p.extend_from_slice(&65535u32.to_be_bytes()); // advertised receiver window
    p.extend_from_slice(&1u16.to_be_bytes()); // outbound streams
    p.extend_from_slice(&1u16.to_be_bytes()); // inbound streams
    p.extend_from_slice(&initiate_tag.to_be_bytes()); // initial TSN
    if !cookie.is_empty() {
        p.extend_from_slice(&PARAM_STATE_COOKIE.to_be_bytes());
        p.extend_from_slice(&(param_len as u16).to_be_bytes());
        p.extend_from_slice(cookie);
        p.resize(p.len().next_multiple_of(4), 0);
    }
    // The CRC32c is stored in little-endian order (RFC 9260, appendix A).
    let crc = crc32c::crc32c(&p);
    p[8..12].copy_from_slice(&crc.to_le_bytes());
    p
}

/// Parses an SCTP packet (without IP header) whose first chunk is an INIT or INIT-ACK
/// and whose checksum is right; anything else is `None`.
pub fn parse(p: &[u8]) -> Option<Chunk> {
    if p.len() < COMMON_HEADER_LEN + 20 {
        return None;
    }
    let mut zeroed = p.to_vec();
    zeroed[8..12].fill(0);
    if crc32c::crc32c(&zeroed).to_le_bytes() != p[8..12] {
        return None;
    }
    let be16 = |i: usize| u16::from_be_bytes([p[i], p[i + 1]]);
    let be32 = |i: usize| u32::from_be_bytes([p[i], p[i + 1], p[i + 2], p[i + 3]]);
    let kind = match p[COMMON_HEADER_LEN] {
        CHUNK_INIT => ChunkKind::Init,
        CHUNK_INIT_ACK => ChunkKind::InitAck,
        _ => return None,
    };
    Some(Chunk {
        src_port: be16(0),
        dst_port: be16(2),
        vtag: be32(4),
        kind,
        initiate_tag: be32(COMMON_HEADER_LEN + 4),
    })
}

/// The SCTP payload of a packet read from a raw IPv4 socket, which includes the IP header.
pub fn strip_ipv4_header(p: &[u8]) -> Option<&[u8]> {
    let ihl = usize::from(p.first()? & 0x0f) * 4;
    p.get(ihl..)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_rfc_3720_check_value() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn init_and_init_ack_round_trip() {
        let init_bytes = init(40000, 80, 0x1234_5678);
        let parsed = parse(&init_bytes).unwrap();
        assert_eq!(
            parsed,
            Chunk {
                src_port: 40000,
                dst_port: 80,
                vtag: 0,
                kind: ChunkKind::Init,
                initiate_tag: 0x1234_5678
            }
        );
        let ack = parse(&init_ack(&parsed, 0x9abc_def0)).unwrap();
        assert_eq!(ack.src_port, 80);
        assert_eq!(ack.dst_port, 40000);
        assert_eq!(ack.vtag, 0x1234_5678);
        assert_eq!(ack.kind, ChunkKind::InitAck);
        assert_eq!(ack.initiate_tag, 0x9abc_def0);
    }

    #[test]
    fn corrupted_packet_is_rejected() {
        let mut bytes = init(1, 2, 3);
        bytes[20] ^= 1;
        assert_eq!(parse(&bytes), None);
        assert_eq!(parse(&bytes[..10]), None);
    }
}
