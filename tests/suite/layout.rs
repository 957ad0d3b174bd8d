//! The source tree's shape: no module imports, directly or through others, a module that
//! imports it back. Checked on the text of src/: each file's `crate::<module>` paths (and a
//! child's `super::<sibling>`) are its imports.

use crate::common::root;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path of a file under src/: "commands::start" for src/commands/start.rs.
fn module_of(path: &Path, src: &Path) -> Vec<String> {
    let relative = path.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// Each file's module and the text of its code, comments left out.
fn files(dir: &Path, src: &Path, out: &mut Vec<(Vec<String>, String)>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files(&path, src, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            let code: Vec<&str> = text
                .lines()
                .map(|l| l.split("//").next().unwrap_or(""))
                .collect();
            out.push((module_of(&path, src), code.join("\n")));
        }
    }
}

/// The identifier at the start of `text`, if any.
fn ident(text: &str) -> Option<&str> {
    let end = text
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    (end > 0).then(|| &text[..end])
}

/// The first two segments of each path after `prefix` in `code` ("crate::a::b",
/// "crate::a::{b, c}", "crate::{a, b}"); a brace's items each give a path.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices(prefix) {
        if code[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[i + prefix.len()..];
        let items = |text: &str| -> Vec<String> {
            let Some(inner) = text.strip_prefix('{') else {
                return ident(text).map(String::from).into_iter().collect();
            };
            let inner = &inner[..inner.find('}').unwrap_or(inner.len())];
            inner
                .split(',')
                .filter_map(|item| ident(item.trim()).map(String::from))
                .collect()
        };
        for first in items(rest) {
            let after = if rest.starts_with('{') {
                ""
            } else {
                &rest[first.len()..]
            };
            match after.strip_prefix("::") {
                Some(more) if !more.starts_with('{') || more.len() > 1 => {
                    let seconds = items(more);
                    if seconds.is_empty() {
                        out.push(vec![first.clone()]);
                    }
                    for second in seconds {
                        out.push(vec![first.clone(), second]);
                    }
                }
                _ => out.push(vec![first.clone()]),
            }
        }
    }
    out
}

/// Edges between modules `depth` levels deep (1: the top-level modules; 2: their children,
/// each only towards a sibling under the same parent).
fn imports(depth: usize) -> BTreeMap<String, BTreeSet<String>> {
    let src = root().join("src");
    let mut all = Vec::new();
    files(&src, &src, &mut all);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, code) in &all {
        if module.len() < depth || module[0] == "main" || module[0] == "lib" {
            continue;
        }
        let from = module[..depth].join("::");
        let mut targets = paths_after(code, "crate::");
        // Inside a::x, super::b is a::b.
        if module.len() >= 2 {
            let parent = &module[..module.len() - 1];
            targets.extend(paths_after(code, "super::").into_iter().map(|path| {
                let mut t = parent.to_vec();
                t.extend(path);
                t
            }));
        }
        for target in targets {
            if target.len() < depth || target[..depth - 1] != module[..depth - 1] {
                continue;
            }
            let to = target[..depth].join("::");
            if to != from {
                edges.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    edges
}

/// A cycle in `edges`, if any: the modules along it.
fn cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_string());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, edges, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|start| visit(start, edges, &mut Vec::new(), &mut done))
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    for depth in [1, 2] {
        let edges = imports(depth);
        assert!(edges.len() > 5, "too few modules found: {edges:?}");
        if let Some(found) = cycle(&edges) {
            panic!("an import cycle: {}", found.join(" -> "));
        }
    }
}

/// The check finds a cycle where there is one.
#[test]
fn a_cycle_is_found() {
    let edges: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(cycle(&edges).unwrap(), ["a", "b", "c", "a"]);
}
