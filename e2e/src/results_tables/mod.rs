//! The READMEs' tables of figures, generated from `bench/results/*.json`.
//!
//! Each table is a block between marker comments in a README:
//!
//! ```text
//! <!-- generated: bench/results/eds-convergence.json (results_tables::eds_convergence) -->
//! ...caption and table...
//! <!-- end generated -->
//! ```
//!
//! The marker names the files and the function in [`TABLES`] that renders
//! them; prose stays outside. `results-tables --write` rewrites every block,
//! `--check` (and `e2e/tests/repo/docs.rs`) fails when a block disagrees with its
//! JSON. Tables read the files' data keys; only the caption reads the stamp
//! (`commit`, `date`, `dirty`, `machine_before`/`machine_after`), and
//! renders without it.

pub mod format;
mod readme;
mod readme_e2e;

use std::path::{Path, PathBuf};

use serde_json::Value;

pub use readme::*;
pub use readme_e2e::*;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("no `{key}`")]
    Missing { key: String },
    #[error("`{key}` is not a {kind}")]
    NotA { key: String, kind: &'static str },
    #[error("{what}")]
    Shape { what: String },
    #[error("table results_tables::{table} from {files}: {source}")]
    Render {
        table: &'static str,
        files: String,
        source: Box<Error>,
    },
    #[error("{doc}:{line}: {what}")]
    Marker {
        doc: String,
        line: usize,
        what: String,
    },
}

/// A renderer: the table's files, parsed, in the order [`Table::files`]
/// names them → the block's Markdown (without the caption).
pub type Render = fn(&[Value]) -> Result<String, Error>;

/// One generated table: its name in the marker, the results files it reads
/// (relative to the repository root) and its renderer.
#[derive(Debug)]
pub struct Table {
    pub name: &'static str,
    pub files: &'static [&'static str],
    pub render: Render,
}

/// The docs that hold generated tables, relative to the repository root.
pub const DOCS: &[&str] = &["README.md", "e2e/README.md"];

/// Every table a marker may name.
pub const TABLES: &[Table] = &[
    Table {
        name: "eds_convergence",
        files: &["bench/results/eds-convergence.json"],
        render: eds_convergence,
    },
    Table {
        name: "discovery_push",
        files: &[
            "bench/results/discovery-push.json",
            "bench/results/discovery-push-9500.json",
        ],
        render: discovery_push,
    },
    Table {
        name: "discovery_heap",
        files: &["bench/results/discovery-heap.json"],
        render: discovery_heap,
    },
    Table {
        name: "discovery_debounce",
        files: &["bench/results/discovery-debounce.json"],
        render: discovery_debounce,
    },
    Table {
        name: "discovery_push_throttle",
        files: &["bench/results/discovery-push-throttle.json"],
        render: discovery_push_throttle,
    },
    Table {
        name: "hostile",
        files: &["bench/results/hostile.json"],
        render: hostile,
    },
    Table {
        name: "node_startup",
        files: &["bench/results/node.json"],
        render: node_startup,
    },
    Table {
        name: "node_jobs_retune",
        files: &["bench/results/node.json"],
        render: node_jobs_retune,
    },
    Table {
        name: "lifecycle_node",
        files: &["bench/results/lifecycle-node.json"],
        render: lifecycle_node,
    },
    Table {
        name: "scale",
        files: &["bench/results/scale.json"],
        render: scale,
    },
    Table {
        name: "discovery_istiod",
        files: &["bench/results/discovery-istiod.json"],
        render: discovery_istiod,
    },
    Table {
        name: "discovery_istiod_eds_debounce_off",
        files: &["bench/results/discovery-istiod-eds-debounce-off.json"],
        render: discovery_istiod,
    },
    Table {
        name: "discovery_istiod_10000",
        files: &[
            "bench/results/discovery-istiod-10000.json",
            "bench/results/discovery-istiod-sidecars-10000.json",
        ],
        render: discovery_istiod_10000,
    },
    Table {
        name: "agent_microbench",
        files: &["bench/results/agent-microbench.json"],
        render: agent_microbench,
    },
];

const OPEN: &str = "<!-- generated: ";
const CLOSE: &str = "<!-- end generated -->";
const NAME_PREFIX: &str = " (results_tables::";

pub fn table(name: &str) -> Option<&'static Table> {
    TABLES.iter().find(|t| t.name == name)
}

/// The marker line that opens a table's block.
pub fn marker(t: &Table) -> String {
    format!("{OPEN}{}{NAME_PREFIX}{}) -->", t.files.join(", "), t.name)
}

/// One generated block in a doc: which table, and the lines between its
/// markers (0-based line numbers of the markers).
#[derive(Debug)]
pub struct Block {
    pub table: &'static Table,
    pub open_line: usize,
    pub close_line: usize,
}

/// The blocks of a doc, in order. A marker naming an unknown table, files
/// other than the table's, or a block left open is an error.
pub fn blocks(doc: &str, text: &str) -> Result<Vec<Block>, Error> {
    let err = |line: usize, what: String| Error::Marker {
        doc: doc.to_string(),
        line: line + 1,
        what,
    };
    let mut out = Vec::new();
    let mut open: Option<(usize, &'static Table)> = None;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_end();
        if let Some(rest) = line.strip_prefix(OPEN) {
            if let Some((at, _)) = open {
                return Err(err(
                    i,
                    format!("a block opens inside the one opened at line {}", at + 1),
                ));
            }
            let inner = rest
                .strip_suffix(") -->")
                .ok_or_else(|| err(i, format!("a marker must end with `) -->`: {line}")))?;
            let (files, name) = inner.split_once(NAME_PREFIX).ok_or_else(|| {
                err(
                    i,
                    format!("a marker must name `results_tables::NAME`: {line}"),
                )
            })?;
            let t =
                table(name).ok_or_else(|| err(i, format!("no table results_tables::{name}")))?;
            let named: Vec<&str> = files.split(", ").collect();
            if named != t.files {
                return Err(err(
                    i,
                    format!(
                        "results_tables::{name} reads {}, the marker names {files}",
                        t.files.join(", ")
                    ),
                ));
            }
            open = Some((i, t));
        } else if line == CLOSE {
            let (open_line, table) = open
                .take()
                .ok_or_else(|| err(i, "an end marker without a block".to_string()))?;
            out.push(Block {
                table,
                open_line,
                close_line: i,
            });
        }
    }
    match open {
        Some((at, _)) => Err(err(at, "a block never ends".to_string())),
        None => Ok(out),
    }
}

fn read_json(root: &Path, file: &str) -> Result<Value, Error> {
    let path = root.join(file);
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Read {
        path: path.clone(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| Error::Json { path, source })
}

/// A table's block body: caption, blank line, table, between blank lines.
pub fn render(root: &Path, t: &'static Table) -> Result<String, Error> {
    let wrap = |source: Error| Error::Render {
        table: t.name,
        files: t.files.join(", "),
        source: Box::new(source),
    };
    let values = t
        .files
        .iter()
        .map(|f| read_json(root, f))
        .collect::<Result<Vec<_>, _>>()
        .map_err(wrap)?;
    let body = (t.render)(&values).map_err(wrap)?;
    Ok(format!(
        "\n{}\n\n{}\n",
        format::caption(t.files, &values),
        body.trim_end()
    ))
}

/// A block whose text disagrees with what its JSON renders.
#[derive(Debug)]
pub struct Drift {
    pub doc: String,
    pub table: &'static str,
    pub files: String,
    /// 1-based line of the block's opening marker.
    pub line: usize,
    pub old: String,
    pub new: String,
}

impl std::fmt::Display for Drift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{}:{}: table results_tables::{} disagrees with {} (- README, + JSON):",
            self.doc, self.line, self.table, self.files
        )?;
        let old: Vec<&str> = self.old.lines().collect();
        let new: Vec<&str> = self.new.lines().collect();
        for i in 0..old.len().max(new.len()) {
            match (old.get(i), new.get(i)) {
                (Some(o), Some(n)) if o == n => {}
                (o, n) => {
                    if let Some(o) = o {
                        writeln!(f, "  - {o}")?;
                    }
                    if let Some(n) = n {
                        writeln!(f, "  + {n}")?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// A doc with every block regenerated, and the blocks that changed.
pub fn regenerate(root: &Path, doc: &str) -> Result<(String, Vec<Drift>), Error> {
    let path = root.join(doc);
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Read { path, source })?;
    let lines: Vec<&str> = text.lines().collect();
    let mut out: Vec<String> = Vec::new();
    let mut drifts = Vec::new();
    let mut next = 0;
    for b in blocks(doc, &text)? {
        out.extend(lines[next..=b.open_line].iter().map(|l| l.to_string()));
        let old = lines[b.open_line + 1..b.close_line].join("\n");
        let new = render(root, b.table)?;
        // The marker carries the table's files as the registry names them.
        out.pop();
        out.push(marker(b.table));
        out.extend(new.split('\n').map(str::to_string));
        if old != new {
            drifts.push(Drift {
                doc: doc.to_string(),
                table: b.table.name,
                files: b.table.files.join(", "),
                line: b.open_line + 1,
                old,
                new,
            });
        }
        next = b.close_line;
    }
    out.extend(lines[next..].iter().map(|l| l.to_string()));
    let mut joined = out.join("\n");
    if text.ends_with('\n') {
        joined.push('\n');
    }
    Ok((joined, drifts))
}

/// Every block of every doc that disagrees with its JSON.
pub fn check(root: &Path) -> Result<Vec<Drift>, Error> {
    let mut all = Vec::new();
    for doc in DOCS {
        all.extend(regenerate(root, doc)?.1);
    }
    Ok(all)
}

/// Rewrites every doc whose blocks disagree; returns the blocks rewritten.
pub fn write(root: &Path) -> Result<Vec<Drift>, Error> {
    let mut all = Vec::new();
    for doc in DOCS {
        let (text, drifts) = regenerate(root, doc)?;
        if !drifts.is_empty() {
            let path = root.join(doc);
            std::fs::write(&path, text).map_err(|source| Error::Write { path, source })?;
        }
        all.extend(drifts);
    }
    Ok(all)
}

/// Every table named by some doc's marker, once: a table no doc shows is
/// dead code or a lost block.
pub fn tables_shown(root: &Path) -> Result<Vec<&'static str>, Error> {
    let mut shown = Vec::new();
    for doc in DOCS {
        let path = root.join(doc);
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Read { path, source })?;
        shown.extend(blocks(doc, &text)?.into_iter().map(|b| b.table.name));
    }
    Ok(shown)
}
