//! `cargo xtask structure`: the layering the crates promise, checked.
//!
//! - weir-policy is pure: its normal dependency closure (`cargo tree`) has no kernel,
//!   Kubernetes client, async runtime or HTTP crate.
//! - The agent (weir) does not depend on the lab (weir-lab), in any kind of dependency:
//!   the lab drives the agent's binary and uses its library, never the other way, so
//!   none of it reaches the binary that ships.
//! - Within each crate, no cycle between top-level modules (`src/<name>.rs` or
//!   `src/<name>/`). A module uses another by `crate::<name>` (grouped imports included),
//!   or by `super::<name>` in a top-level module's own file, where `super` is the crate
//!   root. The check reads the source text rather than the compiler's resolution; it is
//!   the paths this project writes, and a miss errs towards a cycle going unreported,
//!   never towards a false one.
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::cmd::{cargo, workspace_root};

/// Crates weir-policy must not reach, directly or not: each one is I/O, the kernel, or a
/// runtime.
const IMPURE: &[&str] = &[
    "aya",
    "aya-obj",
    "aya-log",
    "kube",
    "kube-client",
    "kube-runtime",
    "tokio",
    "hyper",
    "hyper-util",
    "mio",
    "libc",
    "socket2",
    "reqwest",
];

/// The crates whose top-level modules must not form a cycle, by source directory.
const CRATES: &[&str] = &[
    "agent/src",
    "lab/src",
    "bench/src",
    "policy/src",
    "xtask/src",
];

pub fn run() -> Result<()> {
    let impure = impure_dependencies()?;
    if !impure.is_empty() {
        bail!(
            "weir-policy must stay pure, but its dependencies reach {}: see `cargo tree -p \
             weir-policy -e normal -i <crate>` for the path",
            impure.join(", ")
        );
    }
    println!("weir-policy: no kernel, client, runtime or HTTP crate among its dependencies");
    if agent_reaches_lab()? {
        bail!(
            "weir (the agent) must not depend on weir-lab: see `cargo tree -p weir -i weir-lab` \
             for the path"
        );
    }
    println!("weir: weir-lab is not among its dependencies");
    let mut failures = Vec::new();
    for dir in CRATES {
        let graph = module_graph(&workspace_root().join(dir))?;
        let edges: usize = graph.values().map(BTreeSet::len).sum();
        match find_cycle(&graph) {
            None => println!(
                "{dir}: {} top-level modules, {edges} uses, no cycle",
                graph.len()
            ),
            Some(cycle) => failures.push(format!("{dir}: {}", cycle.join(" → "))),
        }
    }
    if !failures.is_empty() {
        bail!(
            "top-level modules use each other in a cycle (move what both need into one \
             module that both import):\n  {}",
            failures.join("\n  ")
        );
    }
    Ok(())
}

fn impure_dependencies() -> Result<Vec<String>> {
    let output = cargo()
        .args(["tree", "--package", "weir-policy", "--edges", "normal"])
        .args(["--prefix", "none", "--locked"])
        .current_dir(workspace_root())
        .output()
        .context("running cargo tree")?;
    if !output.status.success() {
        bail!(
            "cargo tree -p weir-policy failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let names: BTreeSet<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect();
    if !names.contains("weir-policy") {
        bail!("cargo tree -p weir-policy listed no weir-policy: the check would prove nothing");
    }
    Ok(IMPURE
        .iter()
        .filter(|c| names.contains(**c))
        .map(|c| c.to_string())
        .collect())
}

/// Whether weir-lab is among weir's dependencies of any kind (normal, build, dev).
fn agent_reaches_lab() -> Result<bool> {
    let output = cargo()
        .args(["tree", "--package", "weir", "--edges", "all"])
        .args(["--prefix", "none", "--locked"])
        .current_dir(workspace_root())
        .output()
        .context("running cargo tree")?;
    if !output.status.success() {
        bail!(
            "cargo tree -p weir failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let names: BTreeSet<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect();
    if !names.contains("weir") {
        bail!("cargo tree -p weir listed no weir: the check would prove nothing");
    }
    Ok(names.contains("weir-lab"))
}

/// Top-level module → the top-level modules it uses.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn module_graph(src: &Path) -> Result<Graph> {
    let mut modules: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
        let path = entry?.path();
        let name = path
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        if path.is_dir() {
            modules.entry(name).or_default().extend(rust_files(&path)?);
        } else if path.extension().is_some_and(|e| e == "rs") && name != "lib" && name != "main" {
            modules.entry(name).or_default().push(path);
        }
    }
    if modules.is_empty() {
        bail!("{}: no modules found", src.display());
    }
    let names: BTreeSet<String> = modules.keys().cloned().collect();
    let mut graph = Graph::new();
    for (module, files) in &modules {
        let mut uses = BTreeSet::new();
        for file in files {
            let text =
                fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
            // `super::` is the crate root only in a top-level module's own file.
            let top_file = file.parent() == Some(src) || file.ends_with(format!("{module}/mod.rs"));
            uses.extend(used_modules(&text, top_file));
        }
        uses.retain(|m| names.contains(m) && m != module);
        graph.insert(module.clone(), uses);
    }
    Ok(graph)
}

fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(rust_files(&path)?);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    Ok(files)
}

/// The first path segment after each `crate::` (and `super::` when `super_is_root`),
/// including every item of a grouped `crate::{a, b::c}`. Comments are skipped.
fn used_modules(text: &str, super_is_root: bool) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut prefixes = vec!["crate::"];
    if super_is_root {
        prefixes.push("super::");
    }
    for prefix in prefixes {
        for (at, _) in code.match_indices(prefix) {
            // Not the tail of a longer path (`foo::crate::`) or identifier (`supercrate::`).
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let rest = &code[at + prefix.len()..];
            if let Some(group) = rest.strip_prefix('{') {
                found.extend(group_heads(group));
            } else {
                found.insert(identifier(rest));
            }
        }
    }
    found.retain(|m| !m.is_empty());
    found
}

/// The first segment of each item in a `{…}` group whose opening brace is already consumed.
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut item_start = true;
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => item_start = true,
            c if item_start && depth == 0 && !c.is_whitespace() => {
                heads.push(identifier(&group[i..]));
                item_start = false;
            }
            _ => {}
        }
    }
    heads
}

fn identifier(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// One cycle, as the modules along it with the first repeated at the end, if any.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit<'a>(
        node: &'a str,
        graph: &'a Graph,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| *n == node) {
            let mut cycle: Vec<String> = path[at..].iter().map(|n| n.to_string()).collect();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node);
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node);
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(edges: &[(&str, &[&str])]) -> Graph {
        edges
            .iter()
            .map(|(m, uses)| (m.to_string(), uses.iter().map(|u| u.to_string()).collect()))
            .collect()
    }

    #[test]
    fn a_cycle_is_found_and_named_and_a_dag_passes() {
        let dag = graph(&[("a", &["b", "c"]), ("b", &["c"]), ("c", &[])]);
        assert_eq!(find_cycle(&dag), None);
        let cyclic = graph(&[("a", &["b"]), ("b", &["c"]), ("c", &["a"]), ("d", &["a"])]);
        assert_eq!(find_cycle(&cyclic).unwrap(), ["a", "b", "c", "a"]);
    }

    #[test]
    fn uses_are_read_from_paths_groups_and_root_super() {
        let text = "use crate::model::Object;\nuse crate::{source::event, daemon};\n\
                    use crate::{a::{b, c}, d};\n// crate::commented\nfn f() { x::crate::no; \
                    super::desired::X; }";
        let uses = used_modules(text, false);
        assert_eq!(
            uses.into_iter().collect::<Vec<_>>(),
            ["a", "d", "daemon", "model", "source"]
        );
        assert!(used_modules(text, true).contains("desired"));
    }
}
