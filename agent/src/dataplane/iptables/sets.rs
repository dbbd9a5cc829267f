//! ipset contents for address sets: one `hash:net` set per family, `except` members as
//! `nomatch` entries (hash:net matches the most specific prefix first, so an except
//! carves its hole out of the covering block). Scripts for `ipset restore -exist`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use weir_policy::desired::{programmed_members, AddressSet, Member, SetId};

use super::names::{node_set_name, node_staging_set_name, set_name, staging_set_name};
use crate::netfilter::backend::Family;

/// ipset's default maxelem (65,536) is reached by one namespace selector in a large
/// cluster; the hash grows on demand, so a high cap costs nothing until it is used.
pub const MAXELEM: u32 = 1 << 20;

/// `maxelem` of each set in `ipset list -t` output (headers only). A set whose maxelem
/// differs from [`MAXELEM`] (made by an earlier release, at 65,536) makes `create -exist`
/// fail, which would stop every later write: such sets are upgraded by a swap instead.
pub fn maxelems(list_terse: &str) -> BTreeMap<String, u32> {
    let mut out = BTreeMap::new();
    let mut name: Option<&str> = None;
    for line in list_terse.lines() {
        if let Some(n) = line.strip_prefix("Name: ") {
            name = Some(n.trim());
        } else if let (Some(header), Some(n)) = (line.strip_prefix("Header: "), name) {
            let words: Vec<&str> = header.split_whitespace().collect();
            let maxelem = words
                .windows(2)
                .find(|w| w[0] == "maxelem")
                .and_then(|w| w[1].parse().ok());
            if let Some(m) = maxelem {
                out.insert(n.to_string(), m);
            }
        }
    }
    out
}

/// `hash:net` cannot hold a /0: such a block becomes its two /1 halves.
fn split_zero(net: IpNet) -> Vec<IpNet> {
    match net {
        IpNet::V4(n) if n.prefix_len() == 0 => [0u32, 1 << 31]
            .iter()
            .map(|a| IpNet::V4(Ipv4Net::new((*a).into(), 1).expect("/1 is valid")))
            .collect(),
        IpNet::V6(n) if n.prefix_len() == 0 => [0u128, 1 << 127]
            .iter()
            .map(|a| IpNet::V6(Ipv6Net::new((*a).into(), 1).expect("/1 is valid")))
            .collect(),
        other => vec![other],
    }
}

fn in_family(net: &IpNet, family: Family) -> bool {
    matches!(
        (net, family),
        (IpNet::V4(_), Family::V4) | (IpNet::V6(_), Family::V6)
    )
}

/// One kernel entry: the network and whether it is a hole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Entry {
    pub net: IpNet,
    pub nomatch: bool,
}

impl Entry {
    fn render(&self) -> String {
        if self.nomatch {
            format!("{} nomatch", self.net)
        } else {
            self.net.to_string()
        }
    }
}

/// The kernel entries of `members` in `family`, as the dataplanes program them
/// ([`programmed_members`]: no IPv6 block holds an IPv4-mapped address).
pub fn entries<'a>(
    members: impl IntoIterator<Item = &'a Member>,
    family: Family,
) -> BTreeSet<Entry> {
    programmed_members(members)
        .into_iter()
        .filter(|m| in_family(&m.net, family))
        .flat_map(|m| {
            split_zero(m.net.trunc()).into_iter().map(move |net| Entry {
                net,
                nomatch: m.except,
            })
        })
        .collect()
}

/// Creates both families' sets of `set` (if absent) and replaces their contents
/// atomically: fill a staging set, swap it in, destroy it. `existing` is the kernel's
/// sets with their maxelem: a set of another size is not created again (that fails) but
/// upgraded by the same swap, which replaces it with the staging set made at
/// [`MAXELEM`], under the same name and references, without a gap.
pub fn replace_script(set: &AddressSet, existing: &BTreeMap<String, u32>, out: &mut String) {
    for family in Family::ALL {
        let (name, staging) = (set_name(set.id, family), staging_set_name(set.id, family));
        replace_family(&name, &staging, family, &set.members, existing, out);
    }
}

/// The node's addresses ([`crate::dataplane::node_addresses`]) as
/// [`node_set_name`](super::names::node_set_name) sets, made or replaced as
/// [`replace_script`] does.
pub fn node_script(addrs: &[IpAddr], existing: &BTreeMap<String, u32>, out: &mut String) {
    let members: Vec<Member> = addrs
        .iter()
        .map(|a| Member {
            net: IpNet::from(*a),
            except: false,
        })
        .collect();
    for family in Family::ALL {
        let (name, staging) = (node_set_name(family), node_staging_set_name(family));
        replace_family(&name, &staging, family, &members, existing, out);
    }
}

fn replace_family<'a>(
    name: &str,
    staging: &str,
    family: Family,
    members: impl IntoIterator<Item = &'a Member>,
    existing: &BTreeMap<String, u32>,
    out: &mut String,
) {
    let f = family.ipset_family();
    let other_size = |n: &str| existing.get(n).is_some_and(|m| *m != MAXELEM);
    if !other_size(name) {
        let _ = writeln!(out, "create {name} hash:net family {f} maxelem {MAXELEM}");
    }
    if other_size(staging) {
        // A staging set left by an interrupted run of an earlier release.
        let _ = writeln!(out, "destroy {staging}");
    }
    let _ = writeln!(
        out,
        "create {staging} hash:net family {f} maxelem {MAXELEM}"
    );
    let _ = writeln!(out, "flush {staging}");
    for e in entries(members, family) {
        let _ = writeln!(out, "add {staging} {}", e.render());
    }
    let _ = writeln!(out, "swap {staging} {name}");
    let _ = writeln!(out, "destroy {staging}");
}

/// Lines that turn `old` members into `new` ones: adds (and nomatch flips, which
/// `add -exist` performs in place) in `adds`, deletions in `dels`.
pub fn member_delta(
    id: SetId,
    old: &BTreeSet<Member>,
    new: &BTreeSet<Member>,
    adds: &mut String,
    dels: &mut String,
) {
    for family in Family::ALL {
        let name = set_name(id, family);
        let (before, after) = (entries(old, family), entries(new, family));
        let kept_nets: BTreeSet<IpNet> = after.iter().map(|e| e.net).collect();
        for e in after.difference(&before) {
            let _ = writeln!(adds, "add {name} {}", e.render());
        }
        for e in before.difference(&after) {
            if !kept_nets.contains(&e.net) {
                let _ = writeln!(dels, "del {name} {}", e.net);
            }
        }
    }
}

/// Creates a new set (both families) with its members.
pub fn create_script(set: &AddressSet, out: &mut String) {
    for family in Family::ALL {
        let name = set_name(set.id, family);
        let _ = writeln!(
            out,
            "create {name} hash:net family {} maxelem {MAXELEM}",
            family.ipset_family()
        );
        for e in entries(&set.members, family) {
            let _ = writeln!(out, "add {name} {}", e.render());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(net: &str, except: bool) -> Member {
        Member {
            net: net.parse().unwrap(),
            except,
        }
    }

    #[test]
    fn zero_prefixes_split_and_excepts_become_nomatch() {
        let members = [member("0.0.0.0/0", false), member("10.1.0.0/16", true)];
        let rendered: Vec<_> = entries(&members, Family::V4)
            .iter()
            .map(Entry::render)
            .collect();
        assert_eq!(
            rendered,
            ["0.0.0.0/1", "10.1.0.0/16 nomatch", "128.0.0.0/1"]
        );
        assert!(entries(&members, Family::V6).is_empty());
        // ::/0 holds no IPv4-mapped address: that range becomes a hole.
        let v6: Vec<_> = entries(&[member("::/0", false)], Family::V6)
            .iter()
            .map(Entry::render)
            .collect();
        assert_eq!(v6, ["::/1", "::ffff:0.0.0.0/96 nomatch", "8000::/1"]);
        // An IPv4-mapped member stands for an IPv4 address: left out.
        assert!(entries(&[member("::ffff:10.0.0.1/128", false)], Family::V6).is_empty());
    }

    #[test]
    fn sets_of_another_maxelem_are_swapped_not_created() {
        let listed = "Name: weir-0000000000000001-4\nType: hash:net\nRevision: 7\n\
                      Header: family inet hashsize 1024 maxelem 65536 bucketsize 12 initval 0x1\n\
                      Size in memory: 456\nReferences: 1\nNumber of entries: 0\n\n\
                      Name: weir-0000000000000001-6\nType: hash:net\nRevision: 7\n\
                      Header: family inet6 hashsize 1024 maxelem 1048576 bucketsize 12\n";
        let existing = maxelems(listed);
        assert_eq!(existing["weir-0000000000000001-4"], 65536);
        assert_eq!(existing["weir-0000000000000001-6"], MAXELEM);
        let set = AddressSet {
            id: SetId(1),
            definition: "x".into(),
            members: BTreeSet::from([member("10.0.0.1/32", false)]),
        };
        let mut script = String::new();
        replace_script(&set, &existing, &mut script);
        assert!(
            !script.contains("create weir-0000000000000001-4 "),
            "{script}"
        );
        assert!(
            script.contains("create weir-0000000000000001-6 "),
            "{script}"
        );
        assert!(script.contains("swap "), "{script}");
    }

    #[test]
    fn node_addresses_replace_the_node_sets_by_family() {
        let addrs: Vec<IpAddr> = ["10.0.0.1", "fd00::1", "::ffff:10.0.0.2"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let mut script = String::new();
        node_script(&addrs, &BTreeMap::new(), &mut script);
        let adds: Vec<&str> = script.lines().filter(|l| l.starts_with("add ")).collect();
        assert_eq!(
            adds,
            [
                "add weir-node-4t 10.0.0.1/32",
                "add weir-node-6t fd00::1/128"
            ]
        );
        assert!(
            script.contains("swap weir-node-4t weir-node-4\n"),
            "{script}"
        );
        assert!(
            script.contains("create weir-node-6 hash:net family inet6 "),
            "{script}"
        );
    }

    #[test]
    fn flipping_except_is_one_add_without_delete() {
        let old = BTreeSet::from([member("10.1.0.0/16", true), member("10.2.0.0/16", false)]);
        let new = BTreeSet::from([member("10.1.0.0/16", false)]);
        let (mut adds, mut dels) = (String::new(), String::new());
        member_delta(SetId(1), &old, &new, &mut adds, &mut dels);
        assert_eq!(adds, "add weir-0000000000000001-4 10.1.0.0/16\n");
        assert_eq!(dels, "del weir-0000000000000001-4 10.2.0.0/16\n");
    }
}
