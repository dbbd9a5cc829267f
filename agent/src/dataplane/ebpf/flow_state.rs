//! The per-flow state the programs keep for each endpoint (WEIR_CT, WEIR_CT_OVERFLOW and
//! WEIR_FRAG, keyed by endpoint id), forgotten when the endpoint goes. Endpoint ids are
//! handed out lowest-free-first, and IPAM hands out a deleted pod's address again: without
//! this a new pod at the same address and id would inherit the old pod's connections
//! (replies and established packets its own policy denies would pass as the old flows').
//! A pod made again under the same name (a new sandbox on a new interface) keeps its
//! endpoint id, and is a new pod too: an id's flows are forgotten whenever it leaves an
//! interface. They are removed after the ENDPOINT entries (the programs make no entry for
//! an interface without one); a flow the re-made pod opened in between is forgotten too,
//! and its next packet is judged again.

use std::collections::BTreeSet;
use std::path::Path;

use aya::maps::{HashMap, Map, MapData};
use weir_common::{map_names, CtKey, CtValue, FragKey, FragValue};

use super::pins::PinLayout;
use crate::dataplane::DataplaneError;

/// Removes every entry of the endpoints `ids` from one pinned map whose key starts with
/// the endpoint id; returns how many went.
fn forget<K, V>(
    path: &Path,
    name: &str,
    ids: &BTreeSet<u32>,
    endpoint_of: impl Fn(&K) -> u32,
) -> Result<usize, DataplaneError>
where
    K: aya::Pod,
    V: aya::Pod,
{
    let context = || format!("map {name}");
    let data = MapData::from_pin(path).map_err(|e| DataplaneError::map(context(), e))?;
    // CT and FRAG are LRU hashes, which aya's HashMap reads and writes too.
    let map = Map::from_map_data(data).map_err(|e| DataplaneError::map(context(), e))?;
    let mut map: HashMap<MapData, K, V> =
        HashMap::try_from(map).map_err(|e| DataplaneError::map(context(), e))?;
    // Keys first, removals after: removing while walking restarts the kernel's walk.
    let doomed: Vec<K> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| ids.contains(&endpoint_of(k)))
        .collect();
    let mut removed = 0;
    for key in &doomed {
        // Gone meanwhile (expired, evicted) is as good as removed.
        if map.remove(key).is_ok() {
            removed += 1;
        }
    }
    Ok(removed)
}

/// Forgets the flows and fragment records of the endpoints `ids` (see the module
/// documentation). Returns how many entries went.
pub fn forget_endpoints(layout: &PinLayout, ids: &BTreeSet<u32>) -> Result<usize, DataplaneError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let mut removed = 0;
    for name in [map_names::CT, map_names::CT_OVERFLOW] {
        removed += forget::<CtKey, CtValue>(&layout.map(name), name, ids, |k| k.endpoint_id)?;
    }
    removed +=
        forget::<FragKey, FragValue>(&layout.map(map_names::FRAG), map_names::FRAG, ids, |k| {
            k.endpoint_id
        })?;
    Ok(removed)
}
