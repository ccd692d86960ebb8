//! No import circles between the modules of `kv-core` and `gguf` (issue 34): a module names
//! another through `crate::NAME` (in a `use` or a path); the graph of those names, unit tests
//! and comments left out, must have no cycle. A cycle found is printed module by module.
//! Reads the checkout's sources (milliseconds), so it needs no build of anything else.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// `module → modules it names`, for the `.rs` files directly in `src` (`lib.rs` left out: it
/// declares and re-exports the others).
fn edges(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let files: BTreeMap<String, String> = std::fs::read_dir(src)
        .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .map(|p| {
            let module = p.file_stem().unwrap().to_string_lossy().into_owned();
            (module, std::fs::read_to_string(&p).unwrap())
        })
        .filter(|(m, _)| m != "lib")
        .collect();
    let modules: BTreeSet<&String> = files.keys().collect();
    files
        .iter()
        .map(|(module, text)| {
            let text = text.split("#[cfg(test)]\nmod ").next().unwrap_or_default();
            let code: String = text
                .lines()
                .map(|l| l.split("//").next().unwrap_or_default())
                .collect::<Vec<_>>()
                .join("\n");
            let mut named = BTreeSet::new();
            // `crate::x` anywhere, and `x` inside `use crate::{x, y::z}`.
            for (i, _) in code.match_indices("crate::") {
                let rest = &code[i + "crate::".len()..];
                let groups: Vec<&str> = match rest.strip_prefix('{') {
                    Some(group) => group.split('}').next().unwrap_or_default().split(',').collect(),
                    None => vec![rest],
                };
                for g in groups {
                    let word: String = g
                        .trim_start()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if modules.contains(&word) && word != *module {
                        named.insert(word);
                    }
                }
            }
            (module.clone(), named)
        })
        .collect()
}

/// A cycle of `graph`, if it has one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_string());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

fn assert_acyclic(crate_dir: &str) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(crate_dir)
        .join("src");
    let graph = edges(&src);
    assert!(graph.len() > 5, "{}: too few modules read: {graph:?}", src.display());
    if let Some(found) = cycle(&graph) {
        panic!("{crate_dir}: import cycle {}", found.join(" -> "));
    }
}

#[test]
fn kv_core_modules_import_no_cycle() {
    assert_acyclic("kv-core");
}

#[test]
fn gguf_modules_import_no_cycle() {
    assert_acyclic("gguf");
}

/// The check finds a cycle where there is one (the two this issue removed, as they were).
#[test]
fn a_cycle_is_found() {
    let graph = |pairs: &[(&str, &[&str])]| -> BTreeMap<String, BTreeSet<String>> {
        pairs
            .iter()
            .map(|(m, to)| (m.to_string(), to.iter().map(|t| t.to_string()).collect()))
            .collect()
    };
    let before = graph(&[
        ("manifest", &["quant", "spec"]),
        ("quant", &["manifest", "params"]),
        ("params", &["quant"]),
        ("spec", &[]),
    ]);
    let found = cycle(&before).expect("the manifest/quant/params cycle");
    assert_eq!(found.first(), found.last());
    assert!(found.contains(&"quant".to_string()), "{found:?}");
    let gguf = graph(&[
        ("error", &["file"]),
        ("file", &["error", "quant"]),
        ("quant", &["file"]),
    ]);
    assert!(cycle(&gguf).is_some());
    assert_eq!(cycle(&graph(&[("a", &["b"]), ("b", &[])])), None);
}
