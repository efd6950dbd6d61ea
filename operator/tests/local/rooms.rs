//! The operator's modules are rooms: one may use another only if that one
//! does not, through any chain, use it back. A cycle would mean two rooms
//! that cannot be read, tested or changed apart. And the command line stays
//! at the door: only `app` (which turns flags into settings) and the binary
//! read `flags`.
//!
//! Read from the sources with syn: every path written `crate::`, `super::`,
//! `self::` or (from the binary) `remora_operator::`, in code, `use` items
//! and macro bodies, points at the module it names. References between a
//! module and its ancestors or descendants are a room and its parts, not
//! rooms using each other; test code (`#[cfg(test)]`) may reach anywhere.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

use syn::visit::{self, Visit};

/// A module's path from the library's root (empty for the root itself);
/// the binary is `main`.
type ModPath = Vec<String>;

/// Who uses whom: from module, to module, one reference that says so.
type Graph = BTreeMap<String, BTreeMap<String, String>>;

fn name(path: &[String]) -> String {
    if path.is_empty() {
        "crate".into()
    } else {
        path.join("::")
    }
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        let syn::Meta::List(list) = &a.meta else {
            return false;
        };
        let tokens = list.tokens.to_string();
        let words: Vec<&str> = tokens
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .collect();
        a.path().is_ident("cfg") && words.contains(&"test") && !words.contains(&"not")
    })
}

struct Module {
    path: ModPath,
    /// Whether this is the binary, whose `crate` is not the library.
    bin: bool,
    items: Vec<syn::Item>,
}

/// The module at `path`, whose items are `items` and whose `mod x;`
/// children are in `dir`, and all its non-test descendants.
fn load(path: ModPath, bin: bool, mut items: Vec<syn::Item>, dir: &Path, out: &mut Vec<Module>) {
    for item in &mut items {
        let syn::Item::Mod(m) = item else { continue };
        if is_cfg_test(&m.attrs) {
            continue;
        }
        assert!(
            !m.attrs.iter().any(|a| a.path().is_ident("path")),
            "#[path] on mod {} is not followed by this test",
            m.ident
        );
        let child_dir = dir.join(m.ident.to_string());
        // An inline module's items move to its own node.
        let child_items = match m.content.take() {
            Some((_, inline)) => inline,
            None => {
                let flat = dir.join(format!("{}.rs", m.ident));
                let file = if flat.exists() {
                    flat
                } else {
                    child_dir.join("mod.rs")
                };
                parse(&file)
            }
        };
        let mut child = path.clone();
        child.push(m.ident.to_string());
        load(child, bin, child_items, &child_dir, out);
    }
    out.push(Module { path, bin, items });
}

fn parse(file: &Path) -> Vec<syn::Item> {
    let text =
        std::fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    syn::parse_file(&text)
        .unwrap_or_else(|e| panic!("parsing {}: {e}", file.display()))
        .items
}

/// The library rooted at `src/lib.rs` and the binary at `src/main.rs`.
fn modules(src: &Path) -> Vec<Module> {
    let mut out = Vec::new();
    load(Vec::new(), false, parse(&src.join("lib.rs")), src, &mut out);
    let main = src.join("main.rs");
    if main.exists() {
        load(vec!["main".into()], true, parse(&main), src, &mut out);
    }
    out
}

/// Every path one module writes, made absolute where it names this crate.
struct References<'m> {
    module: &'m Module,
    /// Absolute path, and the path as written.
    found: Vec<(ModPath, String)>,
}

impl References<'_> {
    fn note(&mut self, segments: &[String]) {
        let Some(first) = segments.first() else {
            return;
        };
        let written = segments.join("::");
        let mut rest = &segments[1..];
        let mut base = match first.as_str() {
            "crate" if self.module.bin => return,
            "crate" | "remora_operator" => Vec::new(),
            "self" => self.module.path.clone(),
            "super" => {
                let mut p = self.module.path.clone();
                p.pop();
                while rest.first().map(String::as_str) == Some("super") {
                    p.pop();
                    rest = &rest[1..];
                }
                p
            }
            // An outside crate, a local name, or a child module (a room's
            // own part): none is an edge.
            _ => return,
        };
        base.extend(rest.iter().cloned());
        self.found.push((base, written));
    }
}

fn flatten_use(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            flatten_use(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let mut p = prefix.clone();
            if n.ident != "self" {
                p.push(n.ident.to_string());
            }
            out.push(p);
        }
        syn::UseTree::Rename(r) => {
            let mut p = prefix.clone();
            if r.ident != "self" {
                p.push(r.ident.to_string());
            }
            out.push(p);
        }
        syn::UseTree::Glob(_) => out.push(prefix.clone()),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                flatten_use(t, prefix, out);
            }
        }
    }
}

impl<'ast> Visit<'ast> for References<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs: &[syn::Attribute] = match item {
            // A child module is a node of its own.
            syn::Item::Mod(_) => return,
            syn::Item::Const(i) => &i.attrs,
            syn::Item::Enum(i) => &i.attrs,
            syn::Item::Fn(i) => &i.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Macro(i) => &i.attrs,
            syn::Item::Static(i) => &i.attrs,
            syn::Item::Struct(i) => &i.attrs,
            syn::Item::Trait(i) => &i.attrs,
            syn::Item::Type(i) => &i.attrs,
            syn::Item::Use(i) => &i.attrs,
            _ => &[],
        };
        if !is_cfg_test(attrs) {
            visit::visit_item(self, item);
        }
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        let attrs: &[syn::Attribute] = match item {
            syn::ImplItem::Const(i) => &i.attrs,
            syn::ImplItem::Fn(i) => &i.attrs,
            syn::ImplItem::Type(i) => &i.attrs,
            _ => &[],
        };
        if !is_cfg_test(attrs) {
            visit::visit_impl_item(self, item);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let mut paths = Vec::new();
        flatten_use(&item.tree, &mut Vec::new(), &mut paths);
        for p in paths {
            self.note(&p);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        self.note(&segments);
        visit::visit_path(self, path);
    }

    /// Macro bodies are tokens, not syntax: their paths are read from the
    /// text (`crate :: a :: b`).
    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        let text = mac.tokens.to_string();
        let tokens: Vec<&str> = text.split_whitespace().collect();
        let mut i = 0;
        while i < tokens.len() {
            if matches!(tokens[i], "crate" | "self" | "super" | "remora_operator")
                && tokens.get(i + 1) == Some(&"::")
            {
                let mut segments = vec![tokens[i].to_string()];
                let mut j = i + 1;
                while tokens.get(j) == Some(&"::")
                    && let Some(next) = tokens.get(j + 1)
                    && next.chars().all(|c| c.is_alphanumeric() || c == '_')
                {
                    segments.push((*next).to_string());
                    j += 2;
                }
                self.note(&segments);
                i = j;
            } else {
                i += 1;
            }
        }
        visit::visit_macro(self, mac);
    }
}

/// The module graph of the crate whose sources are in `src`.
fn graph(src: &Path) -> Graph {
    let modules = modules(src);
    let known: BTreeSet<&ModPath> = modules.iter().filter(|m| !m.bin).map(|m| &m.path).collect();
    let mut graph = Graph::new();
    for m in &modules {
        let mut refs = References {
            module: m,
            found: Vec::new(),
        };
        for item in &m.items {
            refs.visit_item(item);
        }
        for (path, written) in refs.found {
            // The module it names: the longest known prefix.
            let Some(target) = (0..=path.len())
                .rev()
                .map(|n| path[..n].to_vec())
                .find(|p| known.contains(p))
            else {
                continue;
            };
            let related = m.path.starts_with(&target) || target.starts_with(&m.path);
            if m.bin || !related {
                graph
                    .entry(name(&m.path))
                    .or_default()
                    .entry(name(&target))
                    .or_insert(written);
            }
        }
    }
    graph
}

/// The cycles of `graph`, one per strongly connected component, each as
/// the modules along it and the reference that makes each step.
fn cycles(graph: &Graph) -> Vec<String> {
    // Tarjan's strongly connected components.
    struct Tarjan<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        components: Vec<Vec<&'g str>>,
    }
    impl<'g> Tarjan<'g> {
        fn visit(&mut self, v: &'g str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flat_map(|e| e.keys()) {
                if !self.index.contains_key(w.as_str()) {
                    self.visit(w);
                    let lw = self.low[w.as_str()];
                    self.low.entry(v).and_modify(|l| *l = (*l).min(lw));
                } else if self.on_stack.contains(w.as_str()) {
                    let iw = self.index[w.as_str()];
                    self.low.entry(v).and_modify(|l| *l = (*l).min(iw));
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    self.components.push(component);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.components
        .iter()
        .map(|component| {
            let inside: BTreeSet<&str> = component.iter().copied().collect();
            let start = *inside.first().expect("a component has members");
            // The shortest way back to `start`, within the component.
            let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
            let mut queue = VecDeque::from([start]);
            'search: while let Some(v) = queue.pop_front() {
                for w in graph[v].keys().map(String::as_str) {
                    if !inside.contains(w) || came_from.contains_key(w) {
                        continue;
                    }
                    came_from.insert(w, v);
                    if w == start {
                        break 'search;
                    }
                    queue.push_back(w);
                }
            }
            let mut steps = Vec::new();
            let mut at = start;
            loop {
                let from = came_from[at];
                steps.push(format!("  {from} -> {at} ({})", graph[from][at]));
                at = from;
                if at == start {
                    break;
                }
            }
            steps.reverse();
            format!(
                "{} modules: {}\n{}",
                component.len(),
                inside.iter().copied().collect::<Vec<_>>().join(", "),
                steps.join("\n")
            )
        })
        .collect()
}

fn operator_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn the_operators_modules_form_no_cycle() {
    let graph = graph(&operator_src());
    assert!(
        graph.len() > 10,
        "the graph is suspiciously small: {graph:#?}"
    );
    let found = cycles(&graph);
    assert!(
        found.is_empty(),
        "module cycles in operator/src:\n{}",
        found.join("\n")
    );
}

#[test]
fn only_app_and_the_binary_read_the_flags() {
    let graph = graph(&operator_src());
    let readers: BTreeSet<&str> = graph
        .iter()
        .filter(|(_, to)| to.contains_key("flags"))
        .map(|(from, _)| from.as_str())
        .collect();
    assert_eq!(readers, BTreeSet::from(["app", "main"]));
}

/// The checker itself: a cycle through `super::`, a `use` group and a
/// macro body is found; the same back edge in test code is not one.
#[test]
fn a_cycle_is_found_and_test_code_is_left_out() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let write = |file: &str, text: &str| {
        let path = dir.path().join(file);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    };
    write("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n");
    write("a/mod.rs", "pub mod inner;\nuse crate::{b::B, c};\n");
    write("a/inner.rs", "pub fn f() { super::super::c::g(); }\n");
    write(
        "b.rs",
        "pub struct B;\n#[cfg(test)]\nmod tests { use crate::a::inner::f; }\n",
    );
    write(
        "c.rs",
        "pub fn g() { println!(\"{:?}\", crate::a::inner::f()); }\n",
    );
    let graph = graph(dir.path());
    let found = cycles(&graph);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("2 modules: a::inner, c\n") && found[0].contains("crate::a::inner::f"),
        "{}",
        found[0]
    );
    assert!(!graph.contains_key("b"), "{graph:?}");
}
