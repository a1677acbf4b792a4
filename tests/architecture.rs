//! The module structure docs/architecture.md states, checked against the sources: no two
//! top-level modules of `src/` depend on each other, directly or round about, and the
//! protocol core imports only the leaf modules the page names. An import is a
//! `crate::<module>` path in code (comments and `#[cfg(test)]` modules left out).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// The code of `text` that is built into the binary: up to its test module, comments out.
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let end = text.find("#[cfg(test)]\nmod ").unwrap_or(text.len());
    text[..end]
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
}

/// The modules a line names after `crate::`, including each of `crate::{a, b::c}`.
fn named(line: &str) -> Vec<String> {
    let mut out = vec![];
    for (i, _) in line.match_indices("crate::") {
        let rest = &line[i + "crate::".len()..];
        let mut push = |s: &str| {
            let name: String = s
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push(name);
            }
        };
        match rest.strip_prefix('{') {
            Some(group) => group
                .split('}')
                .next()
                .unwrap_or("")
                .split(',')
                .for_each(&mut push),
            None => push(rest),
        }
    }
    out
}

/// For each top-level module, the modules it imports, each with one place that does.
fn graph(src: &Path) -> Graph {
    let mut g = Graph::new();
    for entry in walkdir::WalkDir::new(src) {
        let entry = entry.unwrap();
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let rel = path.strip_prefix(src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_str()
            .unwrap()
            .trim_end_matches(".rs")
            .to_string();
        let text = std::fs::read_to_string(path).unwrap();
        for (n, line) in code_lines(&text) {
            for m in named(line) {
                // Macros (`crate::errln!`) and items of lib.rs are no modules.
                let module = src.join(format!("{m}.rs")).is_file() || src.join(&m).is_dir();
                if module && m != top {
                    g.entry(top.clone())
                        .or_default()
                        .entry(m)
                        .or_insert_with(|| format!("{}:{}", rel.display(), n + 1));
                }
            }
        }
    }
    g
}

/// A cycle of `g`, as the modules along it with the first repeated at the end.
fn cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(
        g: &Graph,
        v: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == v) {
            let mut c = path[at..].to_vec();
            c.push(v.to_string());
            return Some(c);
        }
        if done.contains(v) {
            return None;
        }
        path.push(v.to_string());
        for w in g.get(v).into_iter().flat_map(|e| e.keys()) {
            if let Some(c) = visit(g, w, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(v.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys()
        .find_map(|v| visit(g, v, &mut Vec::new(), &mut done))
}

fn src() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn no_two_modules_depend_on_each_other() {
    let g = graph(&src());
    // The check sees the imports that are there.
    assert!(g["node"].contains_key("protocol"), "{g:?}");
    assert!(g["node"].contains_key("store"), "{g:?}");
    if let Some(c) = cycle(&g) {
        let steps: Vec<String> = c
            .windows(2)
            .map(|w| format!("{} -> {} ({})", w[0], w[1], g[&w[0]][&w[1]]))
            .collect();
        panic!("a module cycle:\n{}", steps.join("\n"));
    }
}

#[test]
fn the_protocol_core_imports_only_leaf_modules() {
    let g = graph(&src());
    let imports: BTreeSet<&str> = g["protocol"].keys().map(String::as_str).collect();
    let leaves: BTreeSet<&str> = ["exercised", "exit", "holder", "json"].into();
    assert!(
        imports.is_subset(&leaves),
        "protocol imports {:?}",
        g["protocol"]
            .iter()
            .filter(|(m, _)| !leaves.contains(m.as_str()))
            .collect::<Vec<_>>()
    );
}

#[test]
fn a_cycle_is_found_and_named() {
    // The finder itself, on a graph with one: a -> b -> c -> a beside a cycle-free d.
    let mut g = Graph::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")] {
        g.entry(a.into())
            .or_default()
            .insert(b.into(), "x.rs:1".into());
    }
    let c = cycle(&g).unwrap();
    assert_eq!(c.first(), c.last());
    assert_eq!(c.len(), 4, "{c:?}");
    g.get_mut("c").unwrap().clear();
    assert_eq!(cycle(&g), None);
    assert_eq!(
        named("use crate::{clock::Clock, store::SharedDir}; crate::exit::FAILED"),
        ["clock", "store", "exit"]
    );
}

/// The functions of `text` longer than `limit` lines, outside its test module: (name,
/// first line, lines). Relies on rustfmt's layout: a body ends at the first line that is
/// the `}` at the indentation of its `fn`.
fn long_functions(text: &str, limit: usize) -> Vec<(String, usize, usize)> {
    let end = text.find("#[cfg(test)]\nmod ").unwrap_or(text.len());
    let lines: Vec<&str> = text[..end].lines().collect();
    let mut out = vec![];
    for (i, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let indent = line.len() - code.len();
        let Some(at) = code.find("fn ") else { continue };
        let head = &code[..at];
        let is_fn = head
            .split_whitespace()
            .all(|w| w.starts_with("pub") || ["const", "unsafe", "async", "extern"].contains(&w));
        if !is_fn || code.starts_with("//") {
            continue;
        }
        let name: String = code[at + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let close = format!("{}}}", " ".repeat(indent));
        // A declaration without a body (in a trait) ends with `;` before any `{`.
        let Some(open) = lines[i..]
            .iter()
            .position(|l| l.contains('{') || l.ends_with(';'))
        else {
            continue;
        };
        if !lines[i + open].contains('{') || lines[i + open].trim_end().ends_with('}') {
            continue;
        }
        if let Some(n) = lines[i + 1..].iter().position(|l| *l == close) {
            if n + 2 > limit {
                out.push((name, i + 1, n + 2));
            }
        }
    }
    out
}

#[test]
fn no_function_is_over_150_lines() {
    let mut found = vec![];
    for entry in walkdir::WalkDir::new(src()) {
        let entry = entry.unwrap();
        if entry.path().extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).unwrap();
        for (name, line, n) in long_functions(&text, 150) {
            found.push(format!(
                "{}:{line}: fn {name}: {n} lines",
                entry.path().display()
            ));
        }
    }
    assert!(
        found.is_empty(),
        "functions over 150 lines:\n{}",
        found.join("\n")
    );
}

#[test]
fn a_long_function_is_measured_from_its_fn_to_its_brace() {
    let body = "        x();\n".repeat(160);
    let text = format!(
        "impl A {{\n    pub(crate) fn long(&self) {{\n{body}    }}\n\n    fn short() {{\n        y();\n    }}\n    fn declared(&self);\n}}\n"
    );
    assert_eq!(long_functions(&text, 150), [("long".to_string(), 2, 162)]);
    assert!(long_functions(&text, 162).is_empty());
}
