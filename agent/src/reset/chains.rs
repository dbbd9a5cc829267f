//! Removing owned iptables chains and the jumps into them, in dependency order, in
//! every table of both families of both backends: one `iptables-restore --noflush` per
//! (backend, family) that first deletes jumps from chains weir does not own, then
//! flushes every owned chain, then deletes them. Each table commits atomically, so
//! traffic never sees a half-removed chain.

use std::collections::BTreeMap;

use crate::netfilter::backend::{Backend, Family};

use super::iptables_save::SavedTable;

/// What to remove from one table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableRemoval {
    pub table: String,
    /// `<chain> <spec>` of rules in foreign chains that jump into owned chains.
    pub jumps: Vec<String>,
    pub chains: Vec<String>,
}

pub fn plan(tables: &[SavedTable], owned: &dyn Fn(&str) -> bool) -> Vec<TableRemoval> {
    tables
        .iter()
        .map(|t| TableRemoval {
            table: t.name.clone(),
            jumps: t
                .rules
                .iter()
                .filter(|r| !owned(&r.chain) && r.target.as_deref().is_some_and(owned))
                .map(|r| format!("{} {}", r.chain, r.spec))
                .collect(),
            chains: t.chains.iter().filter(|c| owned(c)).cloned().collect(),
        })
        .filter(|r| !r.jumps.is_empty() || !r.chains.is_empty())
        .collect()
}

/// How many references on each set the owned chains hold: what removing them releases.
pub fn set_references(
    tables: &[SavedTable],
    owned: &dyn Fn(&str) -> bool,
) -> BTreeMap<String, u64> {
    let mut refs = BTreeMap::new();
    for rule in tables
        .iter()
        .flat_map(|t| &t.rules)
        .filter(|r| owned(&r.chain))
    {
        for set in &rule.sets {
            *refs.entry(set.clone()).or_default() += 1;
        }
    }
    refs
}

/// (set, chain) for every set a rule of an owned chain uses.
pub fn sets_used(tables: &[SavedTable], owned: &dyn Fn(&str) -> bool) -> Vec<(String, String)> {
    let mut used = Vec::new();
    for rule in tables
        .iter()
        .flat_map(|t| &t.rules)
        .filter(|r| owned(&r.chain))
    {
        for set in &rule.sets {
            let pair = (set.clone(), rule.chain.clone());
            if !used.contains(&pair) {
                used.push(pair);
            }
        }
    }
    used
}

/// The `iptables-restore --noflush` script for `removals`.
pub fn script(removals: &[TableRemoval]) -> String {
    let mut s = String::new();
    for r in removals {
        s.push_str(&format!("*{}\n", r.table));
        for jump in &r.jumps {
            s.push_str(&format!("-D {jump}\n"));
        }
        for chain in &r.chains {
            s.push_str(&format!("-F {chain}\n"));
        }
        for chain in &r.chains {
            s.push_str(&format!("-X {chain}\n"));
        }
        s.push_str("COMMIT\n");
    }
    s
}

/// Human-readable names of what `removals` takes away, for the report.
pub fn describe(backend: Backend, family: Family, removals: &[TableRemoval]) -> Vec<String> {
    removals
        .iter()
        .flat_map(|r| {
            let jumps = r
                .jumps
                .iter()
                .map(move |j| format!("{backend} {family} {}: rule -A {j}", r.table));
            let chains = r
                .chains
                .iter()
                .map(move |c| format!("{backend} {family} {}: chain {c}", r.table));
            jumps.chain(chains)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reset::iptables_save::parse;

    #[test]
    fn removes_jumps_then_flushes_then_deletes() {
        let tables = parse(include_str!("testdata/iptables-nft-save.txt")).unwrap();
        let removals = plan(&tables, &|c| c.starts_with("AZURE-NPM"));
        assert_eq!(
            script(&removals),
            "*filter\n\
             -D FORWARD -m conntrack --ctstate NEW -j AZURE-NPM\n\
             -F AZURE-NPM\n-F AZURE-NPM-INGRESS\n\
             -X AZURE-NPM\n-X AZURE-NPM-INGRESS\n\
             COMMIT\n"
        );
    }

    #[test]
    fn sets_used_by_owned_chains_are_named_with_the_chain() {
        let tables = parse(include_str!("testdata/iptables-nft-save.txt")).unwrap();
        assert_eq!(
            sets_used(&tables, &|c| c.starts_with("AZURE-NPM")),
            [("weir-c".to_string(), "AZURE-NPM-INGRESS".to_string())]
        );
        assert!(sets_used(&tables, &|c| c.starts_with("WEIR-")).is_empty());
    }

    #[test]
    fn nothing_owned_means_no_script() {
        let tables = parse(include_str!("testdata/iptables-nft-save.txt")).unwrap();
        assert!(plan(&tables, &|c| c.starts_with("WEIR-")).is_empty());
    }
}
