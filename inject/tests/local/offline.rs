//! Offline injection: golden files per workload kind and mode, idempotency,
//! pass-through, and errors. Regenerate goldens with
//! `REMORA_BLESS=1 cargo test -p remora-inject --test local offline::`.

use std::path::{Path, PathBuf};

use remora_crds::SidecarMode;
use remora_inject::offline::{OfflineError, OfflineOptions, inject_stream, parse_lifecycle};

const KINDS: [&str; 8] = [
    "pod",
    "deployment",
    "statefulset",
    "daemonset",
    "replicaset",
    "job",
    "cronjob",
    "list",
];

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests")
}

fn opts(mode: SidecarMode) -> OfflineOptions {
    OfflineOptions {
        mode: Some(mode),
        ..OfflineOptions::default()
    }
}

fn check_golden(path: &Path, got: &str) -> anyhow::Result<()> {
    if std::env::var_os("REMORA_BLESS").is_some() {
        std::fs::write(path, got)?;
        return Ok(());
    }
    let want = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("{}: {e} (REMORA_BLESS=1 creates it)", path.display()))?;
    assert!(
        want == got,
        "{} differs from the output; rerun with REMORA_BLESS=1 if the change is intended\n--- got ---\n{got}",
        path.display()
    );
    Ok(())
}

#[test]
fn golden_per_kind_and_mode() -> anyhow::Result<()> {
    for kind in KINDS {
        let input = std::fs::read_to_string(dir().join("data").join(format!("{kind}.yaml")))?;
        for (mode, name) in [
            (SidecarMode::Legacy, "legacy"),
            (SidecarMode::Native, "native"),
        ] {
            let (out, report) = inject_stream(&input, &opts(mode))?;
            assert!(report.injected >= 1, "{kind}/{name}: nothing injected");
            check_golden(
                &dir().join("golden").join(format!("{kind}.{name}.yaml")),
                &out,
            )?;
        }
    }
    Ok(())
}

#[test]
fn injecting_twice_is_injecting_once() -> anyhow::Result<()> {
    for kind in KINDS {
        let input = std::fs::read_to_string(dir().join("data").join(format!("{kind}.yaml")))?;
        for mode in [SidecarMode::Legacy, SidecarMode::Native, SidecarMode::Auto] {
            let (once, _) = inject_stream(&input, &opts(mode))?;
            let (twice, report) = inject_stream(&once, &opts(mode))?;
            assert_eq!(report.injected, 0, "{kind}: injected again");
            assert_eq!(once, twice, "{kind}: second pass changed the output");
        }
    }
    Ok(())
}

#[test]
fn non_workloads_pass_through_byte_for_byte() -> anyhow::Result<()> {
    let input = "# leading comment\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a   # keep me\ndata:\n  k: v\n---\napiVersion: v1\nkind: Service\nmetadata: {name: s}\n";
    let (out, report) = inject_stream(input, &OfflineOptions::default())?;
    assert_eq!(report.injected, 0);
    assert_eq!(out, format!("---\n{input}"));
    assert!(out.contains("# keep me"));
    Ok(())
}

#[test]
fn opted_out_and_host_network_pods_are_left_alone() -> anyhow::Result<()> {
    let input = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\n  labels: {remora.dev/inject: \"false\"}\nspec:\n  containers: [{name: c, image: i}]\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: b}\nspec:\n  hostNetwork: true\n  containers: [{name: c, image: i}]\n";
    let (out, report) = inject_stream(input, &OfflineOptions::default())?;
    assert_eq!(report.injected, 0);
    assert!(!out.contains("remora-proxy"));
    Ok(())
}

#[test]
fn invalid_yaml_names_the_document() {
    let input =
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: ok}\n---\nkind: Pod\nspec: [unclosed\n";
    match inject_stream(input, &OfflineOptions::default()) {
        Err(OfflineError::Yaml { index, reason }) => {
            assert_eq!(index, 1);
            assert!(!reason.is_empty());
        }
        other => panic!("expected a YAML error, got {other:?}"),
    }
}

#[test]
fn workload_without_containers_is_an_error_with_its_index() {
    let input = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {}\n";
    match inject_stream(input, &OfflineOptions::default()) {
        Err(OfflineError::Workload { index, reason }) => {
            assert_eq!(index, 0);
            assert!(reason.contains("Pod/p"), "{reason}");
        }
        other => panic!("expected a workload error, got {other:?}"),
    }
}

#[test]
fn config_file_applies_and_annotations_still_win() -> anyhow::Result<()> {
    let slc = parse_lifecycle(
        "apiVersion: remora.dev/v1alpha1\nkind: SidecarLifecycle\nmetadata: {name: tuned}\nspec:\n  mode: Legacy\n  shutdown:\n    terminationDrainDuration: 7s\n    drainDuration: 30s\n  proxy: {concurrency: 4}\n",
    )?;
    let opts = OfflineOptions {
        lifecycle: Some(slc),
        ..OfflineOptions::default()
    };
    let input = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  annotations: {remora.dev/drain-duration: 20s}\nspec:\n  containers: [{name: c, image: i}]\n";
    let (out, _) = inject_stream(input, &opts)?;
    let pod: serde_json::Value = serde_saphyr::from_str(out.trim_start_matches("---\n"))?;
    let proxy = &pod["spec"]["containers"][0];
    assert_eq!(proxy["name"], "remora-proxy", "Legacy from the config file");
    let env = |name: &str| {
        proxy["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].clone())
    };
    assert_eq!(env("REMORA_TERMINATION_DRAIN_DURATION"), Some("7s".into()));
    assert_eq!(
        env("REMORA_DRAIN_DURATION"),
        Some("20s".into()),
        "annotation wins"
    );
    assert_eq!(env("REMORA_CONCURRENCY"), Some("4".into()));
    assert!(parse_lifecycle("kind: ConfigMap\n").is_err());
    assert!(parse_lifecycle(": : :").is_err());
    Ok(())
}
