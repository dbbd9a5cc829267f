//! The eBPF map encoding on cases the input's bytes choose (netpol-scenarios'
//! `generated::draw_from_bytes`): the planned maps, decided as the programs decide, must
//! agree with weir's verdict and the reference evaluator on every probe, over IPv4 and
//! IPv6 (agent/tests/support/encoding.rs, which agent/tests/ebpf_encoding.rs also runs).
#![no_main]

use libfuzzer_sys::fuzz_target;
use netpol_scenarios::generated;

#[path = "../../tests/support/encoding.rs"]
mod encoding;

fuzz_target!(|data: &[u8]| {
    let case = generated::draw_from_bytes(data, &encoding::addresses());
    let wrong = encoding::disagreements(&case);
    assert!(wrong.is_empty(), "{}{wrong:#?}", case.describe());
});
