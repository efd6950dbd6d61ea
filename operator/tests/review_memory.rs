//! What one big review costs in memory: the pod is read once from the body,
//! and what the operator never reads (a big annotation) is not copied.
//! Measured as the peak RSS (VmHWM) of a child process answering one review,
//! so nothing else of the test harness counts.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;

use remora_inject::resolve::ChartDefaults;
use remora_inject::review::encode;
use remora_operator::webhook::handler::{AdmissionOutcome, Injector};
use remora_operator::webhook::view::StaticView;
use serde_json::json;

const CHILD: &str = "REMORA_REVIEW_MEMORY_CHILD";
const BODY_BYTES: usize = 4 << 20;

fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// Run in the child: answer one 4 MiB review, print the growth of the peak.
#[test]
#[ignore = "run by a_4_mib_review_costs_at_most_twice_its_size in a child process"]
fn child_answers_one_big_review() {
    let inj = Injector {
        chart: ChartDefaults::default(),
        operator_namespace: "remora-system".into(),
        view: Arc::new(StaticView {
            lifecycles: vec![],
            namespaces: BTreeMap::new(),
            native_sidecars: true,
        }),
    };
    // A pod as big as a review gets, its bulk in one annotation or in many
    // small env entries (a large tree once parsed), written straight into
    // the body (no JSON tree to build it).
    let (annotation, env) = match std::env::var(CHILD).as_deref() {
        Ok("env") => {
            let entry = r#"{"name":"E","value":"v"},"#;
            let n = BODY_BYTES / entry.len();
            (
                String::new(),
                format!("[{}{}]", entry.repeat(n), r#"{"name":"L"}"#),
            )
        }
        _ => ("x".repeat(BODY_BYTES), "[]".to_string()),
    };
    let mut body = Vec::with_capacity(BODY_BYTES + 1024);
    body.extend_from_slice(
        json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "big", "operation": "CREATE", "userInfo": {"username": "t"},
                "object": {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "big", "labels": {"remora.dev/inject": "true"},
                                 "annotations": {"example.com/pad": "PAD"}},
                    "spec": {"containers": [{"name": "app", "image": "a", "env": "ENV"}]}},
            }
        })
        .to_string()
        .replace("PAD", &annotation)
        .replace("\"ENV\"", &env)
        .as_bytes(),
    );
    drop((annotation, env));
    // Reset the peak to what is resident now (the body included).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = vm_hwm_kib();
    let (rev, outcome) = futures::executor::block_on(inj.review(&body));
    let answer = encode(rev).unwrap_or_default();
    let grew = vm_hwm_kib().saturating_sub(before);
    assert_eq!(outcome, AdmissionOutcome::Injected);
    assert!(!answer.is_empty());
    println!("\nreview-peak-kib={grew}");
}

/// The growth of the peak RSS while the child answers a review of `shape`.
fn child_peak_kib(shape: &str) -> anyhow::Result<u64> {
    let out = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "child_answers_one_big_review",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, shape)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        // The harness may print it on its "test ... " line.
        .lines()
        .find_map(|l| l.split("review-peak-kib=").nth(1))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no measure in {stdout}"))
}

#[test]
fn a_4_mib_review_costs_at_most_twice_its_size() -> anyhow::Result<()> {
    if std::env::var_os(CHILD).is_some() {
        return Ok(());
    }
    // A second tree or copies of the annotation are 8 MiB more or beyond; a
    // tree of the whole pod of small env entries about 100 MiB.
    let limit = 2 * BODY_BYTES as u64 / 1024;
    for shape in ["annotation", "env"] {
        let kib = child_peak_kib(shape)?;
        assert!(
            kib <= limit,
            "one 4 MiB review ({shape}) raised the peak RSS by {kib} KiB (limit {limit} KiB)"
        );
    }
    Ok(())
}
