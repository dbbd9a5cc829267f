//! The agent's own records (identity signatures, rule names, endpoint ids and their
//! interfaces), kept on bpffs next to the maps so that a restarted agent adopts the same
//! ids and `weir monitor` can name rules. bpffs holds no regular files, so the JSON is
//! stored in chunks of the pinned WEIR_RECORDS hash map: data chunks first, then the
//! header with length and checksum, so a torn write reads as "no records" (the agent then
//! rebuilds ids and reconciles, without a gap), never as wrong names.

use std::collections::BTreeMap;

use aya::maps::{HashMap, MapData, MapError};
use serde::{Deserialize, Serialize};
use weir_common::{RecordChunk, RECORD_CHUNK_BYTES};

use super::{hooks::Attachment, identities::IdentityTable, policy_map::RuleTable};
use weir_policy::desired::PodKey;

const MAGIC: u32 = 0x7765_6972; // "weir"
const HEADER: u32 = 0;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointRecord {
    pub id: u32,
    pub attachment: Attachment,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Records {
    /// [`super::loader::fingerprint`] of the pinned programs.
    #[serde(default)]
    pub fingerprint: Option<String>,
    pub identities: IdentityTable,
    pub rules: RuleTable,
    pub endpoints: BTreeMap<PodKey, EndpointRecord>,
    /// The node's other interfaces, by ifindex, with `weir_to_pod` on egress (see
    /// [`super::hooks::Role::Leaving`]).
    #[serde(default)]
    pub leaving: BTreeMap<u32, Attachment>,
}

impl Records {
    /// Every interface that carries programs: pods' and leaving ones.
    pub fn attachments(&self) -> impl Iterator<Item = &Attachment> {
        self.endpoints
            .values()
            .map(|r| &r.attachment)
            .chain(self.leaving.values())
    }

    pub fn endpoint_name(&self, id: u32) -> Option<&str> {
        if id == super::hooks::PENDING_ENDPOINT_ID {
            return Some("(pod interface not programmed yet)");
        }
        self.endpoints
            .iter()
            .find(|(_, r)| r.id == id)
            .map(|(pod, _)| pod.as_str())
    }
}

fn checksum(bytes: &[u8]) -> u64 {
    // FNV-1a: detects a torn write, nothing more is needed.
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

pub type RecordsMap = HashMap<MapData, u32, RecordChunk>;

pub fn load(map: &RecordsMap) -> Option<Records> {
    let header = map.get(&HEADER, 0).ok()?;
    let word = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().expect("4 bytes"));
    if word(0) != MAGIC {
        return None;
    }
    let len = word(4) as usize;
    let sum = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    let mut bytes = Vec::with_capacity(len);
    for i in 0..len.div_ceil(RECORD_CHUNK_BYTES) {
        bytes.extend_from_slice(&map.get(&(i as u32 + 1), 0).ok()?);
    }
    bytes.truncate(len);
    if checksum(&bytes) != sum {
        tracing::warn!("eBPF records torn or corrupt; ids will be rebuilt");
        return None;
    }
    serde_json::from_slice(&bytes).ok()
}

pub fn store(map: &mut RecordsMap, records: &Records) -> Result<(), MapError> {
    let bytes = serde_json::to_vec(records).expect("records serialize");
    let chunks = bytes.chunks(RECORD_CHUNK_BYTES).count() as u32;
    for (i, part) in bytes.chunks(RECORD_CHUNK_BYTES).enumerate() {
        let mut chunk = [0u8; RECORD_CHUNK_BYTES];
        chunk[..part.len()].copy_from_slice(part);
        map.insert(i as u32 + 1, chunk, 0)?;
    }
    let mut header = [0u8; RECORD_CHUNK_BYTES];
    header[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    header[4..8].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
    header[8..16].copy_from_slice(&checksum(&bytes).to_le_bytes());
    map.insert(HEADER, header, 0)?;
    let stale: Vec<u32> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| *k > chunks)
        .collect();
    for k in stale {
        map.remove(&k)?;
    }
    Ok(())
}
