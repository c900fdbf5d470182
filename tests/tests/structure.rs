//! The rooms of the code hold still (ARCHITECTURE.md, "Rooms"): in the library, the macro
//! and the command-line tool, no file is over 1 000 lines, no function over 120, and no
//! two modules import each other, directly or in a loop (a module and the modules inside
//! it excepted: a parent declares its children, and they read its items).
//!
//! The source is read with syn, as the compiler's parser reads it; a function's length is
//! from its signature's first line to its body's last, comments and blank lines included.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

const MAX_FILE_LINES: usize = 1_000;
const MAX_FN_LINES: usize = 120;

/// The crates checked, by their source directory.
const CRATES: [&str; 3] = ["idem-runtime/src", "idem-macros/src", "idem-cli/src"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// Every `.rs` file under `dir`, sorted.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("a source directory") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The module a file holds, as its path from the crate root (`""` for the root).
fn module_of(src: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_owned());
    }
    parts.join("::")
}

#[test]
fn no_file_is_over_a_thousand_lines() {
    let root = root();
    let mut over = Vec::new();
    for krate in CRATES {
        for file in sources(&root.join(krate)) {
            let lines = std::fs::read_to_string(&file)
                .expect("a source")
                .lines()
                .count();
            if lines > MAX_FILE_LINES {
                over.push(format!(
                    "{} ({lines} lines)",
                    file.strip_prefix(&root).unwrap().display()
                ));
            }
        }
    }
    assert!(
        over.is_empty(),
        "files over {MAX_FILE_LINES} lines: split them by what they hold:\n  {}",
        over.join("\n  ")
    );
}

/// Collects every function's line span.
struct Functions {
    found: Vec<(String, usize)>,
}

impl Functions {
    fn measure(&mut self, name: &syn::Ident, first: proc_macro2::Span, body: &syn::Block) {
        let start = first.start().line;
        let end = body.brace_token.span.close().end().line;
        self.found.push((name.to_string(), end + 1 - start));
    }
}

impl<'ast> Visit<'ast> for Functions {
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        self.measure(&f.sig.ident, f.sig.fn_token.span, &f.block);
        syn::visit::visit_item_fn(self, f);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        self.measure(&f.sig.ident, f.sig.fn_token.span, &f.block);
        syn::visit::visit_impl_item_fn(self, f);
    }

    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if let Some(body) = &f.default {
            self.measure(&f.sig.ident, f.sig.fn_token.span, body);
        }
        syn::visit::visit_trait_item_fn(self, f);
    }
}

#[test]
fn no_function_is_over_a_hundred_and_twenty_lines() {
    let root = root();
    let mut over = Vec::new();
    for krate in CRATES {
        for file in sources(&root.join(krate)) {
            let text = std::fs::read_to_string(&file).expect("a source");
            let parsed = syn::parse_file(&text)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", file.display()));
            let mut functions = Functions { found: Vec::new() };
            functions.visit_file(&parsed);
            for (name, lines) in functions.found {
                if lines > MAX_FN_LINES {
                    over.push(format!(
                        "{}: fn {name} ({lines} lines)",
                        file.strip_prefix(&root).unwrap().display()
                    ));
                }
            }
        }
    }
    assert!(
        over.is_empty(),
        "functions over {MAX_FN_LINES} lines: break them into named pieces:\n  {}",
        over.join("\n  ")
    );
}

/// Every path a file names: its `use` trees and the paths in its code.
struct Paths {
    found: Vec<Vec<String>>,
}

impl Paths {
    fn flatten(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                Self::flatten(&p.tree, prefix, out);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let mut path = prefix.clone();
                path.push(n.ident.to_string());
                out.push(path);
            }
            syn::UseTree::Rename(r) => {
                let mut path = prefix.clone();
                path.push(r.ident.to_string());
                out.push(path);
            }
            syn::UseTree::Glob(_) => out.push(prefix.clone()),
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    Self::flatten(tree, prefix, out);
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        Self::flatten(&u.tree, &mut Vec::new(), &mut self.found);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.found
            .push(p.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, p);
    }
}

/// The module `path`, named in `from`, refers to: the longest of `modules` it starts with.
fn resolve(path: &[String], from: &str, modules: &BTreeSet<String>) -> Option<String> {
    let mut absolute: Vec<String> = Vec::new();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => rest = &path[1..],
        Some("super") => {
            absolute = from
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            while rest.first().map(String::as_str) == Some("super") {
                absolute.pop();
                rest = &rest[1..];
            }
        }
        Some("self") => {
            absolute = from
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            rest = &path[1..];
        }
        Some(first) => {
            // A child module named bare, from its parent.
            let child = if from.is_empty() {
                first.to_owned()
            } else {
                format!("{from}::{first}")
            };
            if !modules.contains(&child) {
                return None;
            }
            absolute = from
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
        }
        None => return None,
    }
    absolute.extend(rest.iter().cloned());
    (1..=absolute.len())
        .rev()
        .map(|n| absolute[..n].join("::"))
        .find(|m| modules.contains(m))
}

/// Whether one of `a` and `b` is inside the other.
fn nested(a: &str, b: &str) -> bool {
    let inside =
        |child: &str, parent: &str| parent.is_empty() || child.starts_with(&format!("{parent}::"));
    a == b || inside(a, b) || inside(b, a)
}

#[test]
fn no_two_modules_import_each_other() {
    let root = root();
    let mut cycles = Vec::new();
    for krate in CRATES {
        let src = root.join(krate);
        let files = sources(&src);
        let modules: BTreeSet<String> = files.iter().map(|f| module_of(&src, f)).collect();
        let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in &files {
            let from = module_of(&src, file);
            let text = std::fs::read_to_string(file).expect("a source");
            let parsed = syn::parse_file(&text).expect("parses");
            let mut paths = Paths { found: Vec::new() };
            paths.visit_file(&parsed);
            for path in paths.found {
                if let Some(to) = resolve(&path, &from, &modules) {
                    if !nested(&from, &to) {
                        edges.entry(from.clone()).or_default().insert(to);
                    }
                }
            }
        }
        for component in strongly_connected(&modules, &edges) {
            if component.len() > 1 {
                cycles.push(format!("{krate}: {}", component.join(" <-> ")));
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "modules that import each other (directly or in a loop): move what they share below both:\n  {}",
        cycles.join("\n  ")
    );
}

/// Tarjan's strongly connected components of the import graph.
fn strongly_connected(
    nodes: &BTreeSet<String>,
    edges: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on_stack: BTreeSet<String>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit(s: &mut State<'_>, v: &str) {
        s.index.insert(v.to_owned(), s.next);
        s.low.insert(v.to_owned(), s.next);
        s.next += 1;
        s.stack.push(v.to_owned());
        s.on_stack.insert(v.to_owned());
        let targets: Vec<String> = s.edges.get(v).into_iter().flatten().cloned().collect();
        for w in targets {
            if !s.index.contains_key(&w) {
                visit(s, &w);
                let low = s.low[v].min(s.low[&w]);
                s.low.insert(v.to_owned(), low);
            } else if s.on_stack.contains(&w) {
                let low = s.low[v].min(s.index[&w]);
                s.low.insert(v.to_owned(), low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(&w);
                let done = w == v;
                component.push(w);
                if done {
                    break;
                }
            }
            component.sort();
            s.out.push(component);
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for node in nodes {
        if !state.index.contains_key(node) {
            visit(&mut state, node);
        }
    }
    state.out
}
