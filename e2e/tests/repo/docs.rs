//! The docs name only what exists: every repository path a doc puts in
//! backticks (`inject/src/patch.rs`, `operator/tests/`,
//! `inject/src/{patch,container}.rs`, `charts/remora/values.yaml`) is there,
//! and every test it cites as `file::test` (`e2e/tests/envtest/chart.rs::name`,
//! `ca_rotation.rs::name`, `node_mtls::name`) is a `fn` of that file. Files
//! move between crates; this keeps README.md, SECURITY.md and the crates'
//! READMEs from pointing at where they used to be.
//!
//! What counts as a repository path: a token of an inline code span, or a
//! relative link, that starts with a top-level directory of the repository
//! (or, in a crate's README, with a directory of that crate), or that has a
//! `/` and a source file's extension (then it may be relative to anything:
//! it must be the end of some file's path). Absolute paths, URLs, `$VAR`s,
//! `~`, and placeholders (`<name>`, `*`, `...`) are not checked.
//!
//! The docs' tables of figures are what `bench/results/*.json` says: each
//! block between `<!-- generated: ... -->` markers is regenerated from its
//! files (`e2e::results_tables`) and must match the doc's text.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use e2e::results_tables;

/// Directories never walked: build output and VCS.
const SKIP_DIRS: &[&str] = &["target", ".git", "node_modules"];

/// Paths the docs name in other projects' trees, never in this one.
const FOREIGN: &[&str] = &[
    // Kubernetes' source tree (scripts/build-k8s.sh builds from it).
    "hack/",
];

/// Extensions that make a slash-separated token a file path wherever it is.
const SOURCE_EXTS: &[&str] = &[
    "rs", "toml", "yaml", "yml", "json", "sh", "md", "proto", "tpl", "txt", "c", "sed",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e is a workspace member")
        .to_path_buf()
}

/// The docs held to it: the top-level *.md, and each top-level directory's
/// README.md.
fn docs(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root).expect("reading the repository root") {
        let e = e.expect("a root entry");
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_file() && name.ends_with(".md") {
            out.push(p);
        } else if p.is_dir() && !SKIP_DIRS.contains(&name.as_str()) && !name.starts_with('.') {
            let readme = p.join("README.md");
            if readme.is_file() {
                out.push(readme);
            }
        }
    }
    out.sort();
    out
}

/// Every file and directory under `root`, as `/`-joined relative paths.
fn tree(root: &Path) -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if SKIP_DIRS.contains(&name.as_str()) {
                continue;
            }
            let Ok(rel) = p.strip_prefix(root) else {
                continue;
            };
            let rel = rel.to_string_lossy().replace('\\', "/");
            let is_dir = p.is_dir();
            out.insert(rel);
            if is_dir {
                walk(root, &p, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, root, &mut out);
    out
}

/// Inline code spans and relative link targets of a Markdown text, with
/// their line numbers; fenced code blocks are skipped (commands, output).
fn spans(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut parts = line.split('`');
        let mut outside = parts.next().map(str::to_owned).unwrap_or_default();
        let rest: Vec<&str> = parts.collect();
        // Odd pieces are inside backticks (an unclosed one is left alone).
        for (k, piece) in rest.iter().enumerate() {
            if k % 2 == 0 && k + 1 < rest.len() {
                out.push((i + 1, (*piece).to_owned()));
            } else if k % 2 == 1 {
                outside.push_str(piece);
            }
        }
        // ](target) of links, outside code.
        let mut s = outside.as_str();
        while let Some(at) = s.find("](") {
            s = &s[at + 2..];
            if let Some(end) = s.find(')') {
                let target = &s[..end];
                if !target.contains("://") && !target.starts_with('#') && !target.is_empty() {
                    out.push((
                        i + 1,
                        target.split('#').next().unwrap_or_default().to_owned(),
                    ));
                }
                s = &s[end..];
            }
        }
    }
    out
}

/// `a/{b,c}/d{e,f}` → every combination.
fn expand_braces(s: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (s.find('{'), s.find('}')) else {
        return vec![s.to_owned()];
    };
    if close < open {
        return vec![s.to_owned()];
    }
    let (head, alts, tail) = (&s[..open], &s[open + 1..close], &s[close + 1..]);
    alts.split(',')
        .flat_map(|a| expand_braces(&format!("{head}{a}{tail}")))
        .collect()
}

/// One token of a span, cleaned: (path, cited fn) or None when it is not
/// a path this test can judge.
fn clean(token: &str) -> Option<(String, Option<Vec<String>>)> {
    let t = token
        .trim_start_matches(['(', '[', '"', '\''])
        .trim_end_matches(['.', ',', ';', ':', ')', ']', '"', '\'']);
    if t.is_empty()
        || t.starts_with(['/', '$', '~', '-', '.'])
        || t.contains("://")
        || t.contains(['<', '>', '*', '=', '$', '…', '|'])
        || t.contains("...")
    {
        return None;
    }
    // `file::a::b`: the file, and the item path inside it; `module::item`
    // keeps the module as the path.
    let (path, item) = match t.split_once("::") {
        Some((p, item)) => {
            let segments: Vec<String> = item
                .trim_end_matches("()")
                .split("::")
                .map(str::to_owned)
                .collect();
            let idents = segments
                .iter()
                .all(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
            (p, idents.then_some(segments))
        }
        None => (t, None),
    };
    // path:line, path#anchor.
    let path = path.split('#').next().unwrap_or_default();
    let path = match path.rsplit_once(':') {
        Some((p, line)) if line.chars().all(|c| c.is_ascii_digit() || c == '-') => p,
        _ => path,
    };
    if path.contains(':')
        || FOREIGN.iter().any(|f| path.starts_with(f))
        || SKIP_DIRS.iter().any(|d| path.starts_with(&format!("{d}/")))
    {
        return None;
    }
    Some((path.to_owned(), item))
}

fn has_source_ext(path: &str) -> bool {
    path.rsplit_once('.')
        .is_some_and(|(_, ext)| SOURCE_EXTS.contains(&ext))
}

/// What is wrong with one token of `doc` (None: fine, or not a path).
fn judge(
    root: &Path,
    doc_dir: &str,
    top: &BTreeSet<String>,
    tree: &BTreeSet<String>,
    token: &str,
) -> Option<String> {
    let (raw, item) = clean(token)?;
    let mut problems = Vec::new();
    for path in expand_braces(&raw) {
        let path = path.trim_end_matches('/');
        let first = path.split('/').next().unwrap_or_default();
        let candidates: Vec<String> = if path.contains('/') && top.contains(first) {
            vec![path.to_owned()]
        } else if path.contains('/')
            && !doc_dir.is_empty()
            && tree.contains(&format!("{doc_dir}/{first}"))
        {
            vec![format!("{doc_dir}/{path}")]
        } else if path.contains('/') && has_source_ext(path) {
            // Relative to something: the end of some path.
            let suffix = format!("/{path}");
            tree.iter()
                .filter(|p| p.ends_with(&suffix))
                .cloned()
                .collect()
        } else if item.is_some()
            && !path.contains('/')
            && (path.ends_with(".rs") || !path.contains('.'))
        {
            // `file.rs::test`, or `module::sub::item`: the innermost module's
            // file (`.../sub.rs` or `.../sub/mod.rs`) somewhere.
            let segments = item.as_deref().unwrap_or_default();
            let module = if path.ends_with(".rs") || segments.len() < 2 {
                path.trim_end_matches(".rs")
            } else {
                segments[segments.len() - 2].as_str()
            };
            let hits: Vec<String> = tree
                .iter()
                .filter(|p| {
                    p.ends_with(&format!("/{module}.rs"))
                        || p.ends_with(&format!("/{module}/mod.rs"))
                })
                .cloned()
                .collect();
            if hits.is_empty() && !path.ends_with(".rs") {
                // A Rust path (`remora_contract::workload_ca::PORT`), not a file.
                continue;
            }
            hits
        } else {
            continue;
        };
        let existing: Vec<&String> = candidates.iter().filter(|c| tree.contains(*c)).collect();
        if existing.is_empty() {
            problems.push(format!("`{path}` does not exist"));
            continue;
        }
        if let Some(name) = item.as_ref().and_then(|i| i.last()) {
            let defined = existing.iter().any(|f| {
                // A module in a file of its own, beside or below.
                let dir = f.trim_end_matches("/mod.rs").trim_end_matches(".rs");
                tree.contains(&format!("{dir}/{name}.rs"))
                    || std::fs::read_to_string(root.join(f)).is_ok_and(|text| defines(&text, name))
            });
            if !defined {
                problems.push(format!("no item `{name}` in `{path}`"));
            }
        }
    }
    (!problems.is_empty()).then(|| problems.join("; "))
}

/// Whether `text` defines an item `name` (a fn, module, type, const...).
fn defines(text: &str, name: &str) -> bool {
    [
        "fn", "mod", "struct", "enum", "const", "static", "type", "trait",
    ]
    .iter()
    .any(|kind| {
        let needle = format!("{kind} {name}");
        text.match_indices(&needle).any(|(at, _)| {
            let before = text[..at].chars().next_back();
            let after = text[at + needle.len()..].chars().next();
            !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
                && !after.is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
    })
}

#[test]
fn every_path_the_docs_name_exists() {
    let root = root();
    let tree = tree(&root);
    let top: BTreeSet<String> = tree.iter().filter(|p| !p.contains('/')).cloned().collect();
    let docs = docs(&root);
    for want in [
        "README.md",
        "SECURITY.md",
        "operator/README.md",
        "e2e/README.md",
    ] {
        assert!(
            docs.contains(&root.join(want)),
            "{want} is not among the docs checked: {docs:?}"
        );
    }
    let mut wrong = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let rel = doc
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let doc_dir = rel.rsplit_once('/').map_or("", |(d, _)| d);
        let text = std::fs::read_to_string(doc).unwrap();
        for (line, span) in spans(&text) {
            for token in span.split_whitespace() {
                checked += 1;
                if let Some(problem) = judge(&root, doc_dir, &top, &tree, token) {
                    wrong.push(format!("{rel}:{line}: {problem}"));
                }
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} tokens seen: is the parser broken?"
    );
    assert!(
        wrong.is_empty(),
        "the docs name {} path(s) or test(s) that do not exist:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

/// The checker itself: what it takes for a path, and what it leaves alone.
#[test]
fn the_checker_reads_paths_and_tests_out_of_markdown() {
    let text = "see `inject/src/{patch,offline}.rs` and `e2e/tests/envtest/chart.rs::a_test`,\n\
                ```\nnot/checked.rs\n```\n[link](operator/README.md#x), `$REMORA_CACHE/helm`, \
                `remora.dev/inject`, `/etc/remora/tls`, `kubectl get pods`";
    let spans: Vec<String> = spans(text).into_iter().map(|(_, s)| s).collect();
    assert_eq!(
        spans,
        [
            "inject/src/{patch,offline}.rs",
            "e2e/tests/envtest/chart.rs::a_test",
            "$REMORA_CACHE/helm",
            "remora.dev/inject",
            "/etc/remora/tls",
            "kubectl get pods",
            "operator/README.md",
        ]
    );
    assert_eq!(
        expand_braces("a/{b,c}/d.{rs,md}"),
        ["a/b/d.rs", "a/b/d.md", "a/c/d.rs", "a/c/d.md"]
    );
    assert_eq!(
        clean("(operator/src/flags.rs:120)."),
        Some(("operator/src/flags.rs".into(), None))
    );
    assert_eq!(
        clean("node_mtls::the_ca_refuses_bad_input_and_says_why"),
        Some((
            "node_mtls".into(),
            Some(vec!["the_ca_refuses_bad_input_and_says_why".into()])
        ))
    );
    assert_eq!(clean("$REMORA_CACHE/helm"), None);
    assert_eq!(clean("/etc/remora/tls"), None);
    assert_eq!(clean("target/ci-phases.json"), None);
    assert_eq!(clean("hack/lib/version.sh"), None);

    let root = root();
    let tree = tree(&root);
    let top: BTreeSet<String> = tree.iter().filter(|p| !p.contains('/')).cloned().collect();
    let judge = |dir: &str, t: &str| judge(&root, dir, &top, &tree, t);
    assert_eq!(judge("", "e2e/tests/repo/docs.rs"), None);
    assert_eq!(
        judge(
            "",
            "e2e/tests/repo/docs.rs::every_path_the_docs_name_exists"
        ),
        None
    );
    assert_eq!(
        judge(
            "",
            "docs.rs::the_checker_reads_paths_and_tests_out_of_markdown"
        ),
        None
    );
    assert_eq!(judge("e2e", "tests/repo/docs.rs"), None);
    assert!(judge("", "e2e/tests/nowhere.rs").is_some());
    assert!(judge("", "e2e/tests/repo/docs.rs::no_such_test").is_some());
    assert!(
        judge("", "injector/src/mutate.rs").is_some(),
        "a moved file"
    );
    assert!(
        judge("", "src/mutate.rs").is_some(),
        "a moved file, relative"
    );
    assert_eq!(judge("", "remora_contract::workload_ca::PORT"), None);
    assert_eq!(
        judge("", "node::workloads"),
        None,
        "a module in its own file"
    );
    assert!(judge("", "node::no_such_module").is_some());
    assert_eq!(judge("", "remora.dev/inject"), None);
}

/// Every generated table is what its results files render now; a figure
/// edited by hand, or a results file rerun without `--write`, fails here.
#[test]
fn every_generated_table_agrees_with_its_results_file() {
    let drifts = results_tables::check(&root()).expect("reading the docs and their results files");
    assert!(
        drifts.is_empty(),
        "{} table(s) disagree with their JSON; `cargo run -p e2e --bin results-tables -- --write` \
         rewrites them:\n{}",
        drifts.len(),
        drifts.iter().map(ToString::to_string).collect::<String>()
    );
}

/// Every table the generator knows is shown, once: none lost from the docs.
#[test]
fn every_table_is_in_a_doc_once() {
    let shown = results_tables::tables_shown(&root()).expect("reading the docs");
    for t in results_tables::TABLES {
        let n = shown.iter().filter(|s| **s == t.name).count();
        assert_eq!(n, 1, "results_tables::{} is shown {n} times", t.name);
    }
}

/// A block whose figure differs from its JSON is reported with the doc,
/// line, table and file, line by line; regenerating fixes it and leaves
/// the prose around it alone.
#[test]
fn a_table_that_disagrees_is_named_and_regenerating_fixes_it() {
    let real = root();
    let dir = tempfile::tempdir().unwrap();
    let results = dir.path().join("bench/results");
    std::fs::create_dir_all(&results).unwrap();
    std::fs::copy(
        real.join("bench/results/eds-convergence.json"),
        results.join("eds-convergence.json"),
    )
    .unwrap();
    let table = results_tables::table("eds_convergence").unwrap();
    let good = results_tables::render(dir.path(), table).unwrap();
    // One figure of the first row changed by hand.
    let row = good.lines().find(|l| l.starts_with("| 1 |")).unwrap();
    let cells: Vec<&str> = row.split(" | ").collect();
    let bad_row = row.replacen(cells[1], "1 ms", 1);
    let bad = good.replacen(row, &bad_row, 1);
    let doc = format!(
        "prose before\n{}\n{bad}<!-- end generated -->\nprose after\n",
        results_tables::marker(table)
    );
    std::fs::write(dir.path().join("README.md"), &doc).unwrap();

    let (fixed, drifts) = results_tables::regenerate(dir.path(), "README.md").unwrap();
    assert_eq!(drifts.len(), 1);
    let report = drifts[0].to_string();
    assert!(report.starts_with("README.md:2: table results_tables::eds_convergence disagrees with bench/results/eds-convergence.json"), "{report}");
    assert!(
        report.contains(&format!("  - {bad_row}\n  + {row}\n")),
        "{report}"
    );
    assert_eq!(report.lines().count(), 3, "only the changed row: {report}");
    assert!(
        fixed.starts_with("prose before\n")
            && fixed.ends_with("<!-- end generated -->\nprose after\n")
    );
    std::fs::write(dir.path().join("README.md"), &fixed).unwrap();
    let (again, drifts) = results_tables::regenerate(dir.path(), "README.md").unwrap();
    assert!(drifts.is_empty(), "{drifts:?}");
    assert_eq!(again, fixed);

    // The JSON changes (a rerun): the same block now disagrees.
    let path = results.join("eds-convergence.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v["sizes"][0]["to_every_client"]["p50_ms"] = serde_json::json!(1234.4);
    std::fs::write(&path, v.to_string()).unwrap();
    let (_, drifts) = results_tables::regenerate(dir.path(), "README.md").unwrap();
    assert_eq!(drifts.len(), 1);
    assert!(
        drifts[0].to_string().contains("| 1 | 1,234 ms |"),
        "{}",
        drifts[0]
    );
}

/// Bad markers and bad results files are errors that say where and what,
/// never a panic or a silently skipped table.
#[test]
fn bad_markers_and_results_files_are_errors_naming_them() {
    let t = results_tables::table("eds_convergence").unwrap();
    let m = results_tables::marker(t);
    let err = |text: &str| {
        results_tables::blocks("X.md", text)
            .unwrap_err()
            .to_string()
    };
    assert!(
        err("<!-- generated: a.json (results_tables::nope) -->\n<!-- end generated -->\n")
            .contains("X.md:1: no table results_tables::nope")
    );
    assert!(err("<!-- generated: bench/results/other.json (results_tables::eds_convergence) -->\n")
        .contains("reads bench/results/eds-convergence.json, the marker names bench/results/other.json"));
    assert!(err(&format!("x\n{m}\n| a |\n")).contains("X.md:2: a block never ends"));
    assert!(err(&format!("{m}\n{m}\n")).contains("X.md:2: a block opens inside"));
    assert!(err("<!-- end generated -->\n").contains("X.md:1: an end marker without a block"));

    let dir = tempfile::tempdir().unwrap();
    let results = dir.path().join("bench/results");
    std::fs::create_dir_all(&results).unwrap();
    let render = |json: &str| {
        std::fs::write(results.join("eds-convergence.json"), json).unwrap();
        results_tables::render(dir.path(), t)
            .unwrap_err()
            .to_string()
    };
    let missing = render(r#"{"sizes": [{"clients": 1}]}"#);
    assert!(
        missing.contains("results_tables::eds_convergence from bench/results/eds-convergence.json")
            && missing.contains("no `to_every_client.n`"),
        "{missing}"
    );
    assert!(
        render("{not json").contains("parsing"),
        "a file that is not JSON"
    );
    assert!(render(r#"{"sizes": "x"}"#).contains("`sizes` is not a array"));
}

/// Tables read data keys only: the stamp (commit, command, date, machine),
/// which the results files gain and change shape in, reaches the caption
/// and nothing else.
#[test]
fn tables_render_the_same_without_the_stamp() {
    const STAMP: &[&str] = &[
        "commit",
        "command",
        "date",
        "dirty",
        "machine",
        "machine_before",
        "machine_after",
    ];
    let root = root();
    for t in results_tables::TABLES {
        let values: Vec<serde_json::Value> = t
            .files
            .iter()
            .map(|f| serde_json::from_str(&std::fs::read_to_string(root.join(f)).unwrap()).unwrap())
            .collect();
        let bare: Vec<serde_json::Value> = values
            .iter()
            .cloned()
            .map(|mut v| {
                let map = v.as_object_mut().unwrap();
                for k in STAMP {
                    map.remove(*k);
                }
                v
            })
            .collect();
        assert_eq!(
            (t.render)(&values).unwrap(),
            (t.render)(&bare).unwrap(),
            "results_tables::{} reads its stamp",
            t.name
        );
    }
}
