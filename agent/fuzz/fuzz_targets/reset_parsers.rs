//! Reset's parsers of tool output (`ipset list`, `ipset restore` errors,
//! `iptables-save`, `tc filter show`, `ip -o link`) on arbitrary text: they return
//! values or typed errors, never panic, and what they accept feeds the planners safely.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use weir::reset::{chains, classify, ipset_list, ipset_restore, iptables_save, tc_filters};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let failure = ipset_restore::parse_restore_error(&text);
    assert!(failure.line.is_some() || failure.message == text.trim());

    if let Ok(sets) = ipset_list::parse(&text) {
        let plan = classify::classify(&sets, &|n| n.starts_with("weir-"), &BTreeMap::new());
        // Every owned set is flushed exactly once, destroyed or reported.
        let owned = sets.iter().filter(|s| s.name.starts_with("weir-")).count();
        let flushes = plan
            .ops
            .iter()
            .filter(|op| matches!(op, classify::SetOp::Flush(_)))
            .count();
        assert_eq!(flushes, owned);
        assert_eq!(plan.destroys().count() + plan.undeletable.len(), owned);
        let _ = plan.script();
    }
    if let Ok(tables) = iptables_save::parse(&text) {
        let owned = |c: &str| c.starts_with("WEIR-");
        let _ = chains::script(&chains::plan(&tables, &owned));
        let _ = chains::set_references(&tables, &owned);
    }
    let _ = tc_filters::parse_filters("dev", "ingress", &text, "weir_");
    let _ = tc_filters::parse_link_names(&text);
});
