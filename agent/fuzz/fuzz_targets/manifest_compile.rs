//! YAML → objects → engine, on arbitrary input: nothing may panic, the incremental
//! engine must agree with a cold compile, and deleting everything must leave nothing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weir_policy::manifest::parse_str;
use weir_policy::Engine;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(objects) = parse_str(text) else {
        return;
    };
    let mut incremental = Engine::new(None);
    for object in objects.iter().cloned() {
        // Rejections are expected; they must leave the engine unchanged.
        let before = incremental.desired().clone();
        if incremental.upsert(object).is_err() {
            assert_eq!(&before, incremental.desired());
        }
    }
    let mut cold = Engine::new(None);
    let _ = cold.load(objects.iter().cloned());
    assert_eq!(incremental.desired(), cold.desired());
    for object in &objects {
        incremental.delete(&object.key());
    }
    assert!(incremental.desired().endpoints.is_empty());
    assert!(incremental.desired().sets.is_empty());
});
