//! Every figure comes from the code it describes: each file under
//! `bench/results/` is in the table (`e2e::results_index`), stamped, and no
//! older than the code it measures, unless the table lists it stale with a
//! reason; a listed file that is in fact fresh fails too, so the list only
//! shrinks. Needs git and the whole history (CI has a full clone).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use e2e::results_index::{self, ENTRIES, Freshness};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

#[test]
fn every_results_file_is_in_the_table_and_every_listed_file_exists() {
    let dir = root().join("bench/results");
    let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("bench/results")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    let listed: BTreeSet<String> = ENTRIES
        .iter()
        .flat_map(|e| e.files.iter().map(|f| f.to_string()))
        .collect();
    let unlisted: Vec<_> = on_disk.difference(&listed).collect();
    let missing: Vec<_> = listed.difference(&on_disk).collect();
    assert!(
        unlisted.is_empty(),
        "not in e2e/src/results_index.rs: {unlisted:?}"
    );
    assert!(
        missing.is_empty(),
        "in the table, not in bench/results: {missing:?}"
    );
}

#[test]
fn every_results_file_is_as_new_as_the_code_it_measures() {
    let root = root();
    if let Err(e) = results_index::check_history(&root) {
        panic!("cannot judge the results files' age: {e}");
    }
    let mut wrong = Vec::new();
    for e in ENTRIES {
        let got = results_index::freshness(&root, e);
        match (e.stale, got) {
            (None, Ok(Freshness::Fresh)) => {}
            (None, Ok(Freshness::Stale(why))) => wrong.push(format!(
                "{}: stale: {why}; regenerate it: {}",
                e.file(),
                e.command
            )),
            (None, Err(err)) => wrong.push(format!("{}: {err}", e.file())),
            (Some(_), Ok(Freshness::Fresh)) => wrong.push(format!(
                "{}: fresh, yet listed stale in e2e/src/results_index.rs: remove its `stale`",
                e.file()
            )),
            (Some(_), Ok(Freshness::Stale(_)) | Err(_)) => {}
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn a_file_is_judged_by_its_stamp_and_the_history_of_its_paths() {
    let root = root();
    results_index::check_history(&root).expect("git history");
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .current_dir(&root)
            .args(args)
            .output()
            .expect("git");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let head = git(&["rev-parse", "HEAD"]);
    let first = git(&["rev-list", "--max-parents=0", "HEAD"]);
    let first = first.lines().next().expect("a root commit");
    let doc = |commit: &str, dirty: bool| {
        serde_json::json!({
            "command": "x", "commit": commit, "dirty": dirty,
            "date": "2026-01-01T00:00:00Z", "machine_before": {"cores": 2},
        })
    };
    let judge = |doc: &serde_json::Value, measures: &[&str]| {
        results_index::judge(&root, "x.json", doc, measures)
    };
    let paths: &[&str] = &["Cargo.toml"];
    assert_eq!(
        judge(&doc(&head, false), paths).expect("judged"),
        Freshness::Fresh
    );
    let stale = |d: &serde_json::Value, measures: &[&str], why: &str| match judge(d, measures)
        .expect("judged")
    {
        Freshness::Stale(got) => assert!(got.contains(why), "{got:?} lacks {why:?}"),
        Freshness::Fresh => panic!("fresh, expected stale: {why}"),
    };
    stale(&doc(&head, true), paths, "dirty");
    stale(&doc(first, false), paths, "touched Cargo.toml");
    stale(&doc(&"0".repeat(40), false), paths, "not an ancestor");
    stale(&doc("main", false), paths, "not a commit id");
    // A path nobody ever touched: as fresh at the first commit as at HEAD.
    assert_eq!(
        judge(&doc(first, false), &["no/such/path"]).expect("judged"),
        Freshness::Fresh
    );
    let unstamped = serde_json::json!({"commit": head, "runs": 3});
    assert!(matches!(
        judge(&unstamped, paths),
        Err(results_index::Error::Unstamped { key: "command", .. })
    ));
}

/// A change to measured code and its revert leave a file fresh; a change
/// that stays makes it stale (in a repository made here, so HEAD's own
/// history does not decide).
#[test]
fn a_change_and_its_revert_leave_a_file_fresh() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let git = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .current_dir(root)
            .args([
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "-c",
                "commit.gpgsign=false",
            ])
            .args(args)
            .output()
            .expect("git");
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let commit = |text: &str| {
        std::fs::write(root.join("code.rs"), text).expect("write");
        git(&["add", "code.rs"]);
        git(&["commit", "-q", "-m", text]);
        git(&["rev-parse", "HEAD"])
    };
    git(&["init", "-q"]);
    let measured = commit("one");
    let doc = serde_json::json!({
        "command": "x", "commit": measured, "dirty": false,
        "date": "2026-01-01T00:00:00Z", "machine_before": {"cores": 2},
    });
    let judge = || results_index::judge(root, "x.json", &doc, &["code.rs"]).expect("judged");
    commit("two");
    assert!(matches!(judge(), Freshness::Stale(why) if why.contains("touched code.rs")));
    commit("one");
    assert_eq!(judge(), Freshness::Fresh, "changed and changed back");
}

#[test]
fn the_readme_quotes_the_table_as_bench_all_lists_it() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    assert!(
        readme.contains(&results_index::table()),
        "README.md's benchmarks section differs from `scripts/bench.sh --list`; paste its output there"
    );
}
