//! Line-based parser for `ipset list` output (with or without `-t`): per set its name,
//! type, kernel reference count and, for `list:set` sets, the member set names.
//! Every set block is read in full: no cap on the number of sets or references (the
//! Azure NPM reader stopped after 11 names).

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetInfo {
    pub name: String,
    /// `hash:net`, `list:set`, ...
    pub set_type: String,
    /// The kernel's reference count: iptables rules, list:set memberships, leaks.
    pub references: u64,
    /// Member set names, for `list:set` sets listed without `-t`; empty otherwise.
    pub member_sets: Vec<String>,
}

impl SetInfo {
    pub fn is_list_set(&self) -> bool {
        self.set_type == "list:set"
    }
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ListParseError {
    #[error("ipset list output line {line}: `{field}` appears before any `Name:` line")]
    FieldOutsideSet { line: usize, field: String },
    #[error("ipset list output line {line}: set `{set}` has a bad `References` value `{value}`")]
    BadReferences {
        line: usize,
        set: String,
        value: String,
    },
    #[error("ipset list output: set `{set}` has no `{field}` line")]
    MissingField { set: String, field: &'static str },
}

/// A set block being read; fields are checked when the block ends.
struct Partial {
    name: String,
    set_type: Option<String>,
    references: Option<u64>,
    member_sets: Vec<String>,
    in_members: bool,
}

impl Partial {
    fn finish(self) -> Result<SetInfo, ListParseError> {
        let missing = |field| ListParseError::MissingField {
            set: self.name.clone(),
            field,
        };
        let set_type = self.set_type.clone().ok_or_else(|| missing("Type"))?;
        let references = self.references.ok_or_else(|| missing("References"))?;
        let is_list = set_type == "list:set";
        Ok(SetInfo {
            name: self.name,
            set_type,
            references,
            member_sets: if is_list {
                self.member_sets
            } else {
                Vec::new()
            },
        })
    }
}

/// Parses the whole listing. Unknown header lines are ignored so that newer ipset
/// versions keep parsing; a block without `Type` or `References` is an error.
pub fn parse(text: &str) -> Result<Vec<SetInfo>, ListParseError> {
    let mut sets = Vec::new();
    let mut current: Option<Partial> = None;
    for (index, line) in text.lines().enumerate() {
        let line_no = index + 1;
        if let Some(name) = line.strip_prefix("Name: ") {
            if let Some(done) = current.take() {
                sets.push(done.finish()?);
            }
            current = Some(Partial {
                name: name.trim().to_string(),
                set_type: None,
                references: None,
                member_sets: Vec::new(),
                in_members: false,
            });
            continue;
        }
        if line.trim().is_empty() {
            // A blank line ends the member list (and the block).
            if let Some(p) = current.as_mut() {
                p.in_members = false;
            }
            continue;
        }
        let Some(p) = current.as_mut() else {
            return Err(ListParseError::FieldOutsideSet {
                line: line_no,
                field: line.chars().take(40).collect(),
            });
        };
        if p.in_members {
            if let Some(member) = line.split_whitespace().next() {
                p.member_sets.push(member.to_string());
            }
        } else if let Some(t) = line.strip_prefix("Type: ") {
            p.set_type = Some(t.trim().to_string());
        } else if let Some(r) = line.strip_prefix("References: ") {
            let value = r.trim();
            p.references = Some(value.parse().map_err(|_| ListParseError::BadReferences {
                line: line_no,
                set: p.name.clone(),
                value: value.to_string(),
            })?);
        } else if line.trim_end() == "Members:" {
            p.in_members = true;
        }
    }
    if let Some(done) = current {
        sets.push(done.finish()?);
    }
    Ok(sets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_captured_listing_with_members() {
        let sets = parse(include_str!("testdata/ipset-list.txt")).unwrap();
        let names: Vec<_> = sets.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "weir-t",
                "weir-b",
                "weir-c",
                "azure-npm-123",
                "foreign-list"
            ]
        );
        let by = |n: &str| sets.iter().find(|s| s.name == n).unwrap();
        assert_eq!(by("weir-t").references, 0);
        assert_eq!(by("weir-b").references, 1);
        assert_eq!(by("weir-c").references, 2);
        assert!(by("foreign-list").is_list_set());
        assert_eq!(by("foreign-list").member_sets, ["weir-b", "azure-npm-123"]);
        // Members of hash sets (with options like `comment "a b"`) are not set names.
        assert!(by("weir-t").member_sets.is_empty());
    }

    #[test]
    fn parses_a_captured_terse_listing() {
        let sets = parse(include_str!("testdata/ipset-list-terse.txt")).unwrap();
        assert_eq!(sets.len(), 4);
        assert!(sets.iter().all(|s| s.member_sets.is_empty()));
        assert_eq!(sets[2].name, "weir-c");
        assert_eq!(sets[2].references, 1);
    }

    #[test]
    fn reads_more_than_eleven_referenced_sets() {
        let text: String = (0..1000)
            .map(|i| {
                format!(
                    "Name: weir-{i}\nType: hash:net\nReferences: {}\nMembers:\n\n",
                    i % 3
                )
            })
            .collect();
        let sets = parse(&text).unwrap();
        assert_eq!(sets.len(), 1000);
        assert_eq!(sets.iter().filter(|s| s.references > 0).count(), 666);
    }

    #[test]
    fn rejects_malformed_listings_with_the_set_named() {
        assert_eq!(
            parse("Name: x\nType: hash:net\nReferences: many\n"),
            Err(ListParseError::BadReferences {
                line: 3,
                set: "x".into(),
                value: "many".into()
            })
        );
        assert_eq!(
            parse("Name: x\nType: hash:net\n"),
            Err(ListParseError::MissingField {
                set: "x".into(),
                field: "References"
            })
        );
        assert!(matches!(
            parse("References: 1\n"),
            Err(ListParseError::FieldOutsideSet { line: 1, .. })
        ));
        assert_eq!(parse(""), Ok(vec![]));
    }
}
