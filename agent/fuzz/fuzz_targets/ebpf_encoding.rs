//! The eBPF map encoding on cases the input's bytes choose (netpol-scenarios'
//! `generated::draw_from_bytes`): the planned maps, decided as the programs decide, must
//! agree with weir's verdict and the reference evaluator on every probe, over IPv4 and
//! IPv6 (agent/tests/support/encoding.rs, which agent/tests/ebpf_encoding.rs also runs).
#![no_main]

use libfuzzer_sys::fuzz_target;
use netpol_scenarios::generated;

#[path = "../../tests/support/encoding.rs"]
mod encoding;

/// Probes checked per input: one in this many (an unoptimized, instrumented build decides
/// about one input a second on all 864); which ones turns with the input.
const SAMPLE: usize = 27;

fuzz_target!(|data: &[u8]| {
    let case = generated::draw_from_bytes(data, &encoding::addresses());
    let offset = (case.seed % SAMPLE as u64) as usize;
    let wrong = encoding::disagreements(&case, |i| i % SAMPLE == offset);
    assert!(wrong.is_empty(), "{}{wrong:#?}", case.describe());
});
