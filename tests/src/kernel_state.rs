//! Reading a namespace's ipsets and rules back for assertions.

use anyhow::Result;

use crate::netns::NetNs;

/// Every set name in the namespace.
pub fn set_names(ns: &NetNs) -> Result<Vec<String>> {
    Ok(ns
        .ok("ipset", &["list", "-n"], None)?
        .lines()
        .map(str::to_string)
        .collect())
}

/// (name, number of entries) of every set, from `ipset list -t`.
pub fn set_sizes(ns: &NetNs) -> Result<Vec<(String, usize)>> {
    let text = ns.ok("ipset", &["list", "-t"], None)?;
    let mut sizes = Vec::new();
    let mut name = None;
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("Name: ") {
            name = Some(n.to_string());
        } else if let Some(count) = line.strip_prefix("Number of entries: ") {
            if let Some(n) = name.take() {
                sizes.push((n, count.trim().parse()?));
            }
        }
    }
    Ok(sizes)
}

/// The saved rules of all four (backend, family) combinations, concatenated.
pub fn all_rules(ns: &NetNs) -> Result<String> {
    let mut text = String::new();
    for save in [
        "iptables-legacy-save",
        "ip6tables-legacy-save",
        "iptables-nft-save",
        "ip6tables-nft-save",
    ] {
        text.push_str(&ns.ok(save, &[], None)?);
    }
    Ok(text)
}
