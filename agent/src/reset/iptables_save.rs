//! Line-based parser for `iptables-save` output: tables, their chains, and each rule's
//! chain, jump target and verbatim text (so a rule can be deleted with `-D` exactly as
//! it was saved).

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    pub name: String,
    pub chains: Vec<String>,
    pub rules: Vec<SavedRule>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedRule {
    pub chain: String,
    /// The `-j`/`-g` target, if any.
    pub target: Option<String>,
    /// Everything after `-A <chain>`, verbatim.
    pub spec: String,
    /// ipsets the rule references (`--match-set`, `--add-set`, ...): each holds one
    /// kernel reference on the set.
    pub sets: Vec<String>,
    /// The `-m comment --comment` text, unquoted.
    pub comment: Option<String>,
    /// Packets that matched, from `iptables-save -c` (`[packets:bytes] -A ...`).
    pub packets: Option<u64>,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SaveParseError {
    #[error("iptables-save output line {line}: `{text}` outside of a `*table` block")]
    OutsideTable { line: usize, text: String },
    #[error("iptables-save output line {line}: unterminated quote in rule")]
    UnterminatedQuote { line: usize },
}

/// Options of the `set` match and `SET` target that name a set.
const SET_OPTIONS: [&str; 4] = ["--match-set", "--add-set", "--del-set", "--map-set"];

pub fn parse(text: &str) -> Result<Vec<SavedTable>, SaveParseError> {
    let mut tables = Vec::new();
    let mut current: Option<SavedTable> = None;
    for (index, line) in text.lines().enumerate() {
        let line_no = index + 1;
        let line = line.trim_end();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('*') {
            tables.extend(current.take());
            current = Some(SavedTable {
                name: name.to_string(),
                ..Default::default()
            });
            continue;
        }
        if line == "COMMIT" {
            tables.extend(current.take());
            continue;
        }
        let Some(table) = current.as_mut() else {
            return Err(SaveParseError::OutsideTable {
                line: line_no,
                text: line.chars().take(60).collect(),
            });
        };
        if let Some(decl) = line.strip_prefix(':') {
            if let Some(chain) = decl.split_whitespace().next() {
                table.chains.push(chain.to_string());
            }
        } else if let Some((packets, rule)) = counted(line) {
            let (tokens, chain_end) =
                tokens(rule).ok_or(SaveParseError::UnterminatedQuote { line: line_no })?;
            let Some(chain) = tokens.first() else {
                continue;
            };
            let target = tokens
                .windows(2)
                .find(|w| matches!(w[0].as_str(), "-j" | "--jump" | "-g" | "--goto"))
                .map(|w| w[1].clone());
            let sets = tokens
                .windows(2)
                .filter(|w| SET_OPTIONS.contains(&w[0].as_str()))
                .map(|w| w[1].clone())
                .collect();
            let comment = tokens
                .windows(2)
                .find(|w| w[0] == "--comment")
                .map(|w| w[1].clone());
            // The chain's raw text may be longer than its token (quotes, escapes).
            let spec = rule[chain_end..].trim().to_string();
            table.rules.push(SavedRule {
                chain: chain.clone(),
                target,
                spec,
                sets,
                comment,
                packets,
            });
        }
    }
    tables.extend(current);
    Ok(tables)
}

/// A rule line, with `iptables-save -c`'s `[packets:bytes] ` before it or not: the packet
/// count (if given) and the text after `-A `. `None` for any other line.
fn counted(line: &str) -> Option<(Option<u64>, &str)> {
    if let Some(rule) = line.strip_prefix("-A ") {
        return Some((None, rule));
    }
    let (counters, rest) = line.strip_prefix('[')?.split_once("] ")?;
    let packets = counters.split_once(':')?.0.parse().ok()?;
    Some((Some(packets), rest.strip_prefix("-A ")?))
}

/// Splits a rule into words the way iptables-save quotes them: double quotes group,
/// backslash escapes the next character. Also gives the byte offset in `rule` where the
/// first word ends. `None` for an unterminated quote.
fn tokens(rule: &str) -> Option<(Vec<String>, usize)> {
    let mut out = Vec::new();
    let mut first_end = rule.len();
    let mut word = String::new();
    let mut in_word = false;
    let mut quoted = false;
    let mut chars = rule.char_indices();
    while let Some((at, c)) = chars.next() {
        match c {
            '\\' => {
                word.extend(chars.next().map(|(_, escaped)| escaped));
                in_word = true;
            }
            '"' => {
                quoted = !quoted;
                in_word = true;
            }
            c if c.is_whitespace() && !quoted => {
                if in_word {
                    if out.is_empty() {
                        first_end = at;
                    }
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if quoted {
        return None;
    }
    if in_word {
        out.push(word);
    }
    Some((out, first_end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_captured_nft_save_with_npm_chains() {
        let tables = parse(include_str!("testdata/iptables-nft-save.txt")).unwrap();
        let filter = tables.iter().find(|t| t.name == "filter").unwrap();
        assert!(filter.chains.contains(&"AZURE-NPM-INGRESS".to_string()));
        let forward = filter.rules.iter().find(|r| r.chain == "FORWARD").unwrap();
        assert_eq!(forward.chain, "FORWARD");
        assert_eq!(forward.target.as_deref(), Some("AZURE-NPM"));
        assert_eq!(forward.spec, "-m conntrack --ctstate NEW -j AZURE-NPM");
        // A quoted comment that mentions `-j` is not the target.
        let commented = filter
            .rules
            .iter()
            .find(|r| r.spec.contains("not -j"))
            .unwrap();
        assert_eq!(commented.target.as_deref(), Some("DROP"));
        let matching = filter.rules.iter().find(|r| !r.sets.is_empty()).unwrap();
        assert_eq!(matching.sets, ["weir-c"]);
    }

    #[test]
    fn counters_and_comments_of_iptables_save_c() {
        let saved = "*mangle\n:WEIR-I-00ab - [0:0]\n\
            [7:420] -A WEIR-I-00ab -p tcp --dport 80 -m comment --comment \"x/allow rule 0\" -j RETURN\n\
            [12:720] -A WEIR-I-00ab -m comment --comment \"x/a Ingress default deny\" -j DROP\n\
            -A WEIR-I-00ab -j RETURN\nCOMMIT\n";
        let rules = &parse(saved).unwrap()[0].rules;
        assert_eq!(rules.len(), 3);
        assert_eq!(rules[0].chain, "WEIR-I-00ab");
        assert_eq!(rules[0].packets, Some(7));
        assert_eq!(rules[0].comment.as_deref(), Some("x/allow rule 0"));
        assert_eq!(rules[0].target.as_deref(), Some("RETURN"));
        assert_eq!(rules[1].packets, Some(12));
        assert_eq!(
            rules[1].comment.as_deref(),
            Some("x/a Ingress default deny")
        );
        assert_eq!(rules[2].packets, None);
        assert_eq!(rules[2].comment, None);
    }

    /// Found by the `reset_parsers` fuzz target: an escape made the chain's token shorter
    /// than its text, and the spec was cut inside a multi-byte character.
    #[test]
    fn an_escaped_chain_name_keeps_its_spec() {
        let tables = parse("*filter\n-A AZURE\\é -m set --match-set s src -j DROP\nCOMMIT\n")
            .expect("parses");
        let rule = &tables[0].rules[0];
        assert_eq!(rule.chain, "AZUREé");
        assert_eq!(rule.spec, "-m set --match-set s src -j DROP");
        assert_eq!(rule.sets, vec!["s".to_string()]);
    }

    #[test]
    fn rejects_rules_outside_tables_and_open_quotes() {
        assert!(matches!(
            parse("-A INPUT -j DROP\n"),
            Err(SaveParseError::OutsideTable { line: 1, .. })
        ));
        assert_eq!(
            parse("*filter\n-A INPUT -m comment --comment \"x -j DROP\n"),
            Err(SaveParseError::UnterminatedQuote { line: 2 })
        );
    }
}
