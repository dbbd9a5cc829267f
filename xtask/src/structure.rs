//! `cargo xtask structure`: the layering the crates promise, checked.
//!
//! - weir-policy is pure: its normal dependency closure (`cargo tree`) has no kernel,
//!   Kubernetes client, async runtime or HTTP crate.
//! - The agent (weir) depends on none of the harnesses (the lab, the bench, their
//!   namespace helper, the tests), in any kind of dependency: they drive the agent's
//!   binary and use its library, never the other way, so none of them reaches the binary
//!   that ships.
//! - Within each crate, at every level, no cycle between the modules of one parent (the
//!   crate's top-level modules, the children of `dataplane`, ...). A module uses a sibling
//!   when any file inside it names the sibling by `crate::` (grouped imports included),
//!   `super::` (as often as it is repeated) or `self::`, resolved from the file's own
//!   module. The check reads the source text rather than the compiler's resolution (a
//!   file's `#[cfg(test)]` part is left out); it is the paths this project writes, and a
//!   miss errs towards a cycle going unreported, never towards a false one.
//! - Leaf modules use none of their siblings: the agent's `sys` (raw OS interfaces) is
//!   below everything else in the agent.
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
    "netns/src",
    "policy/src",
    "tests/src",
    "xtask/src",
];

/// Cycles that are known, each with why it is still there: (crate directory, parent
/// module, the modules that use each other in a cycle, why). The check passes over a group
/// of siblings in a cycle that is exactly one of these and says so; any other cycle fails,
/// and so does an entry here that is gone or has changed, so that this list stays exactly
/// what remains.
const KNOWN: &[(&str, &str, &[&str], &str)] = &[];

/// Modules that must use none of their siblings: (crate directory, parent module, module,
/// what it is).
const LEAVES: &[(&str, &str, &str, &str)] = &[(
    "agent/src",
    "crate",
    "sys",
    "raw OS interfaces, below everything else in the agent",
)];

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
    let harnesses = agent_reaches_harnesses()?;
    if let Some(harness) = harnesses.first() {
        bail!(
            "weir (the agent) must not depend on {}: see `cargo tree -p weir -i {harness}` \
             for the path",
            harnesses.join(", ")
        );
    }
    println!(
        "weir: none of {} among its dependencies",
        HARNESSES.join(", ")
    );
    let mut failures = Vec::new();
    for dir in CRATES {
        let graphs = sibling_graphs(&workspace_root().join(dir))?;
        let modules: usize = graphs.values().map(BTreeMap::len).sum();
        let edges: usize = graphs
            .values()
            .flat_map(BTreeMap::values)
            .map(BTreeSet::len)
            .sum();
        let mut known: Vec<_> = KNOWN.iter().filter(|k| k.0 == *dir).collect();
        let mut cycles = 0;
        for (parent, graph) in &graphs {
            let at = match parent.is_empty() {
                true => "crate".to_string(),
                false => parent.join("::"),
            };
            for group in cyclic_groups(graph) {
                cycles += 1;
                let names: Vec<&str> = group.iter().map(String::as_str).collect();
                let is_known = |k: &&(&str, &str, &[&str], &str)| k.1 == at && k.2 == names;
                match known.iter().position(is_known) {
                    Some(i) => {
                        println!(
                            "{dir}: in {at}: {} use each other, known: {}",
                            names.join(", "),
                            known[i].3
                        );
                        known.remove(i);
                    }
                    None => failures.push(format!(
                        "{dir}: in {at}: {} use each other, as in {}",
                        names.join(", "),
                        find_cycle(&restrict(graph, &group))
                            .unwrap_or_default()
                            .join(" → ")
                    )),
                }
            }
        }
        for (_, parent, leaf, what) in LEAVES.iter().filter(|l| l.0 == *dir) {
            let graph = graphs.iter().find(|(path, _)| match path.is_empty() {
                true => *parent == "crate",
                false => path.join("::") == *parent,
            });
            match graph.and_then(|(_, g)| g.get(*leaf)) {
                None => failures.push(format!(
                    "{dir}: in {parent}: no module {leaf}: update structure.rs's LEAVES"
                )),
                Some(uses) if !uses.is_empty() => failures.push(format!(
                    "{dir}: in {parent}: {leaf} ({what}) must use none of its siblings, but \
                     uses {}",
                    uses.iter().cloned().collect::<Vec<_>>().join(", ")
                )),
                Some(_) => println!("{dir}: in {parent}: {leaf} uses none of its siblings"),
            }
        }
        for k in known {
            failures.push(format!(
                "{dir}: in {}: the known cycle of {} is gone or changed: update structure.rs's \
                 KNOWN",
                k.1,
                k.2.join(", ")
            ));
        }
        println!(
            "{dir}: {modules} modules under {} parents, {edges} uses between siblings, {}",
            graphs.len(),
            match cycles {
                0 => "no cycle".to_string(),
                n => format!("{n} cycle(s)"),
            }
        );
    }
    if !failures.is_empty() {
        bail!(
            "modules use their siblings in a cycle (move what both need into one module \
             that both import) or a leaf uses a sibling (move the use out of it):\n  {}",
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

/// The crates that drive the agent and must never be part of it.
const HARNESSES: &[&str] = &["weir-lab", "weir-bench", "weir-netns", "weir-tests"];

/// The harnesses among weir's dependencies of any kind (normal, build, dev).
fn agent_reaches_harnesses() -> Result<Vec<String>> {
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
    Ok(HARNESSES
        .iter()
        .filter(|h| names.contains(**h))
        .map(|h| h.to_string())
        .collect())
}

/// Module → the modules it uses, all children of one parent module.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// A module's path from the crate root (`["dataplane", "ebpf"]`); the root is empty.
type ModPath = Vec<String>;

/// Every module of the crate in `src` and the files that make it (its own file, with
/// `mod.rs` for a directory); the crate root is the empty path.
fn modules(src: &Path) -> Result<BTreeMap<ModPath, Vec<PathBuf>>> {
    let mut found: BTreeMap<ModPath, Vec<PathBuf>> = BTreeMap::new();
    for file in rust_files(src)? {
        let relative = file.strip_prefix(src).unwrap_or(&file);
        let mut path: ModPath = relative
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        let last = path.pop().unwrap_or_default();
        let stem = last.trim_end_matches(".rs");
        let is_root_file = path.is_empty() && (stem == "lib" || stem == "main");
        // src/bin/* are crate roots of their own, not modules of this one.
        if path.first().is_some_and(|c| c == "bin") {
            continue;
        }
        if stem != "mod" && !is_root_file {
            path.push(stem.to_string());
        }
        found.entry(path).or_default().push(file);
    }
    if found.is_empty() {
        bail!("{}: no Rust files found", src.display());
    }
    Ok(found)
}

/// For each parent module with two or more children: which child uses which (a use from
/// anywhere inside a child counts as that child's). Keyed by the parent's path.
fn sibling_graphs(src: &Path) -> Result<BTreeMap<ModPath, Graph>> {
    let modules = modules(src)?;
    let mut graphs: BTreeMap<ModPath, Graph> = BTreeMap::new();
    for path in modules.keys() {
        if let Some((name, parent)) = path.split_last() {
            graphs
                .entry(parent.to_vec())
                .or_default()
                .entry(name.clone())
                .or_default();
        }
    }
    let mut texts = Vec::new();
    for (module, files) in &modules {
        for file in files {
            let text =
                fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
            texts.push((module, code_of(&text)));
        }
    }
    let reexports: BTreeMap<(ModPath, String), ModPath> = texts
        .iter()
        .flat_map(|(module, code)| reexported(code, module))
        .collect();
    for (module, code) in &texts {
        for target in used_paths(code, module) {
            let target = through_reexports(target, &modules, &reexports);
            // The first level where the two paths part: there, a child of their common
            // parent uses a sibling.
            let common = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            let (Some(from), Some(to)) = (module.get(common), target.get(common)) else {
                continue;
            };
            if let Some(graph) = graphs.get_mut(&module[..common]) {
                if graph.contains_key(to) {
                    graph.entry(from.clone()).or_default().insert(to.clone());
                }
            }
        }
    }
    graphs.retain(|_, g| g.len() > 1);
    Ok(graphs)
}

/// A file's code as the check reads it: comments dropped, and its `#[cfg(test)]` part,
/// from its first line on (its `super` is the file's own module, and tests may use
/// anything).
fn code_of(text: &str) -> String {
    text.lines()
        .take_while(|l| l.trim() != "#[cfg(test)]")
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The names module `module` re-exports (`pub use a::B;`, `pub use crate::a::{B, C}`),
/// with the paths they stand for; glob and renamed re-exports are not followed.
fn reexported(code: &str, module: &ModPath) -> Vec<((ModPath, String), ModPath)> {
    let mut found = Vec::new();
    for line in code.lines() {
        let Some(tree) = ["pub use ", "pub(crate) use ", "pub(super) use "]
            .iter()
            .find_map(|p| line.trim_start().strip_prefix(p))
        else {
            continue;
        };
        let paths: Vec<ModPath> = match ["crate::", "super::", "self::"]
            .iter()
            .any(|p| tree.starts_with(p))
        {
            true => used_paths(tree, module).into_iter().collect(),
            // A relative path starts from the module itself.
            false => use_tree(tree)
                .into_iter()
                .map(|tail| module.iter().cloned().chain(tail).collect())
                .collect(),
        };
        for path in paths {
            if let Some(name) = path.last() {
                found.push(((module.clone(), name.clone()), path.clone()));
            }
        }
    }
    found
}

/// `target` with a re-exported name replaced by the path it stands for, as often as that
/// leads to another re-export (a few times at most).
fn through_reexports(
    mut target: ModPath,
    modules: &BTreeMap<ModPath, Vec<PathBuf>>,
    reexports: &BTreeMap<(ModPath, String), ModPath>,
) -> ModPath {
    for _ in 0..8 {
        let next = (0..target.len()).find_map(|i| {
            let (prefix, name) = (&target[..i], &target[i]);
            let is_module = modules.contains_key(&target[..=i]);
            let real = reexports.get(&(prefix.to_vec(), name.clone()))?;
            (!is_module && real != &target[..=i]).then(|| {
                let mut path = real.clone();
                path.extend(target[i + 1..].iter().cloned());
                path
            })
        });
        match next {
            Some(path) => target = path,
            None => break,
        }
    }
    target
}

fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(rust_files(&path)?);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// The paths code of module `module` names through `crate::`, `super::` and `self::`
/// (every item of a grouped `crate::{a, b::{c, d}}` too), resolved from the crate root.
fn used_paths(code: &str, module: &[String]) -> BTreeSet<ModPath> {
    let mut found = BTreeSet::new();
    for prefix in ["crate::", "super::", "self::"] {
        for (at, _) in code.match_indices(prefix) {
            // Not the tail of a longer path (`foo::crate::`, `super::super::`) or
            // identifier (`supercrate::`).
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let mut base: ModPath = match prefix {
                "crate::" => Vec::new(),
                "self::" => module.to_vec(),
                _ => module[..module.len().saturating_sub(1)].to_vec(),
            };
            let mut rest = &code[at + prefix.len()..];
            if prefix == "super::" {
                while let Some(r) = rest.strip_prefix("super::") {
                    base.pop();
                    rest = r;
                }
            }
            for tail in use_tree(rest) {
                let mut path = base.clone();
                path.extend(tail);
                found.insert(path);
            }
        }
    }
    found.retain(|p| !p.is_empty());
    found
}

/// The paths of a use tree's text (`a::b::{c, d::e}` → a::b::c, a::b::d::e), read up to
/// where it ends; `*` and `self` end a path.
fn use_tree(text: &str) -> Vec<ModPath> {
    let mut head: ModPath = Vec::new();
    let mut rest = text;
    loop {
        if let Some(group) = rest.strip_prefix('{') {
            let mut paths = Vec::new();
            for item in group_items(group) {
                for tail in use_tree(item.trim_start()) {
                    let mut path = head.clone();
                    path.extend(tail);
                    paths.push(path);
                }
            }
            if paths.is_empty() {
                paths.push(head);
            }
            return paths;
        }
        let segment = identifier(rest);
        if segment.is_empty() || segment == "self" {
            return vec![head];
        }
        rest = &rest[segment.len()..];
        head.push(segment);
        match rest.strip_prefix("::") {
            Some(r) => rest = r,
            None => return vec![head],
        }
    }
}

/// The items of a `{…}` group whose opening brace is already consumed.
fn group_items(group: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&group[start..i]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.retain(|i| !i.trim().is_empty());
    items
}

fn identifier(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The groups of modules that use each other in a cycle (the strongly connected
/// components of more than one module), each sorted.
fn cyclic_groups(graph: &Graph) -> Vec<Vec<String>> {
    let reaches = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.to_string()];
        while let Some(node) = stack.pop() {
            for next in graph.get(&node).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let reach: BTreeMap<&str, BTreeSet<String>> =
        graph.keys().map(|m| (m.as_str(), reaches(m))).collect();
    let mut groups: Vec<Vec<String>> = Vec::new();
    for m in graph.keys() {
        if groups.iter().any(|g| g.contains(m)) {
            continue;
        }
        let group: Vec<String> = graph
            .keys()
            .filter(|n| {
                *n == m || (reach[m.as_str()].contains(*n) && reach[n.as_str()].contains(m))
            })
            .cloned()
            .collect();
        if group.len() > 1 {
            groups.push(group);
        }
    }
    groups
}

/// The graph among `group` only.
fn restrict(graph: &Graph, group: &[String]) -> Graph {
    group
        .iter()
        .map(|m| {
            let uses = graph[m]
                .iter()
                .filter(|u| group.contains(u))
                .cloned()
                .collect();
            (m.clone(), uses)
        })
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
        assert_eq!(cyclic_groups(&dag), Vec::<Vec<String>>::new());
        assert_eq!(cyclic_groups(&cyclic), [["a", "b", "c"]]);
    }

    fn paths(text: &str, module: &[&str]) -> Vec<String> {
        let module: ModPath = module.iter().map(|m| m.to_string()).collect();
        used_paths(&code_of(text), &module)
            .into_iter()
            .map(|p| p.join("::"))
            .collect()
    }

    #[test]
    fn uses_are_read_from_paths_groups_super_and_self() {
        let text = "use crate::model::Object;\nuse crate::{source::event, daemon};\n\
                    use crate::{a::{b, c::D}, d};\n// crate::commented\nfn f() { x::crate::no; \
                    super::desired::X; super::super::top::Y; self::own::Z; }\n\
                    #[cfg(test)]\nmod tests { use crate::only_in_tests; }";
        assert_eq!(
            paths(text, &["outer", "inner"]),
            [
                "a::b",
                "a::c::D",
                "d",
                "daemon",
                "model::Object",
                "outer::desired::X",
                "outer::inner::own::Z",
                "source::event",
                "top::Y",
            ]
        );
    }

    #[test]
    fn nested_siblings_are_checked_and_parents_and_children_are_not_siblings() {
        let dir = std::env::temp_dir().join(format!("xtask-structure-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let write = |file: &str, text: &str| {
            let path = dir.join(file);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        };
        write(
            "lib.rs",
            "mod a;\nmod b;\nmod c;\npub use c::Reexported;\nuse a::x;\n",
        );
        write("c.rs", "pub struct Reexported;");
        write(
            "a/mod.rs",
            "mod x; mod y; pub use x::X; fn f() { crate::b::g(); }",
        );
        write("a/x.rs", "use super::y::Y; use crate::a::f;");
        write("a/y.rs", "use crate::a::x::X;");
        write("b.rs", "use crate::a::x::X; use crate::Reexported;");
        let graphs = sibling_graphs(&dir).expect("read");
        let _ = fs::remove_dir_all(&dir);
        let root = &graphs[&Vec::<String>::new()];
        assert_eq!(root["a"], BTreeSet::from(["b".to_string()]));
        // A name the root re-exports counts as a use of the module it comes from.
        assert_eq!(
            root["b"],
            BTreeSet::from(["a".to_string(), "c".to_string()])
        );
        let a = &graphs[&vec!["a".to_string()]];
        assert_eq!(find_cycle(a).unwrap(), ["x", "y", "x"]);
    }
}
