//! The pod runner restarts containers like the kubelet: by the pod's
//! restartPolicy for regular containers, always for native sidecars, with
//! a backoff (unit-tested in `podrunner::restart_delay`).

use std::time::Duration;

use e2e::podrunner::{ContainerStatus, Pod, PodSpec, RunnerOptions};
use remora_test_support::assert_eventually;
use remora_test_support::wait::Check;

fn options(base: &std::path::Path) -> RunnerOptions {
    RunnerOptions {
        agent_bin: "remora-agent".into(),
        envoy_bin: "envoy".into(),
        // `sh` stands for the image of every container here.
        images: vec![("sh".into(), "/bin/sh".into())],
        inbound: Vec::new(),
        outbound_upstream: None,
        max_probe_period: Duration::from_millis(100),
        base_dir: base.to_path_buf(),
        secrets: Default::default(),
        restart_backoff: Duration::from_millis(50),
        max_restart_backoff: Duration::from_millis(200),
    }
}

/// Wait (deadline 20 s) until `container`'s status satisfies `f`.
async fn wait_status(
    pod: &Pod,
    container: &str,
    f: impl Fn(&ContainerStatus) -> bool,
) -> ContainerStatus {
    assert_eventually!(
        Duration::from_secs(20),
        every: Duration::from_millis(10),
        || {
            let s = pod.status(container);
            std::future::ready(if f(&s) {
                Check::Done(s)
            } else {
                Check::NotYet(format!("{s:?}"))
            })
        },
        "{container}'s status"
    )
}

/// A container that exits 1 on its first `fails` runs, then stays up;
/// each run appends a line to `<name>.runs` in the pod directory.
fn flaky(name: &str, fails: u32) -> String {
    format!(
        r#"    - name: {name}
      image: sh
      command: [sh, -c, 'echo run >> {name}.runs; test "$$(wc -l < {name}.runs)" -gt {fails} && exec sleep 600; exit 1']
"#
    )
}

fn runs(pod: &Pod, name: &str) -> usize {
    std::fs::read_to_string(pod.dir.join(format!("{name}.runs")))
        .unwrap_or_default()
        .lines()
        .count()
}

/// Waits until `name` has started `n` times: its status counts a restart
/// when the process is spawned, a moment before the script records the run.
async fn wait_runs(pod: &Pod, name: &str, n: usize) {
    assert_eventually!(
        Duration::from_secs(20),
        every: Duration::from_millis(10),
        || {
            let r = runs(pod, name);
            std::future::ready(if r >= n {
                Check::Done(())
            } else {
                Check::NotYet(format!("{r} runs"))
            })
        },
        "{name} to run {n} times"
    );
    // No more than that: a restart too many would show here.
    assert_eq!(runs(pod, name), n);
}

#[tokio::test]
async fn always_restarts_a_crashing_container_with_backoff_until_it_stays_up() {
    let tmp = tempfile::tempdir().expect("tmp");
    let yaml = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: always}}\nspec:\n  containers:\n{}",
        flaky("crasher", 3)
    );
    let pod = Pod::start(
        PodSpec::from_yaml(&yaml).expect("spec"),
        &options(tmp.path()),
    )
    .await
    .expect("start");
    let s = wait_status(&pod, "crasher", |s| {
        s.restart_count == 3 && s.backoff.is_none()
    })
    .await;
    assert_eq!(s.last_exit.as_deref(), Some("exit 1"));
    assert!(!s.terminated);
    // Running now: the fourth run stays up.
    let mut serving = pod.serving();
    tokio::time::timeout(Duration::from_secs(20), serving.wait_for(|s| *s))
        .await
        .expect("ready again in time")
        .expect("pod alive");
    wait_runs(&pod, "crasher", 4).await;
    let report = pod.stop().await;
    assert_eq!(report.exits[0].1, "signal 15", "{report:?}");
    assert_eq!(
        pod.status("crasher").restart_count,
        3,
        "no restart after stop"
    );
}

#[tokio::test]
async fn never_and_on_failure_follow_the_policy_and_sidecars_always_restart() {
    let tmp = tempfile::tempdir().expect("tmp");
    // Never: the app stays down after exit 1; the native sidecar restarts.
    let yaml = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: never}}\nspec:\n  restartPolicy: Never\n  initContainers:\n{}      restartPolicy: Always\n  containers:\n{}",
        flaky("side", 1),
        flaky("app", 5)
    );
    let pod = Pod::start(
        PodSpec::from_yaml(&yaml).expect("spec"),
        &options(tmp.path()),
    )
    .await
    .expect("start");
    let app = wait_status(&pod, "app", |s| s.terminated).await;
    assert_eq!(
        (app.restart_count, app.last_exit.as_deref()),
        (0, Some("exit 1"))
    );
    wait_status(&pod, "side", |s| {
        s.restart_count == 1 && s.backoff.is_none()
    })
    .await;
    assert!(!*pod.serving().borrow(), "an exited app is not ready");
    pod.stop().await;

    // OnFailure: exit 0 is final, exit 1 is restarted.
    let yaml = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: onfailure}}\nspec:\n  restartPolicy: OnFailure\n  containers:\n    - {{name: done, image: sh, command: [sh, -c, 'exit 0']}}\n{}",
        flaky("retry", 1)
    );
    let pod = Pod::start(
        PodSpec::from_yaml(&yaml).expect("spec"),
        &options(tmp.path()),
    )
    .await
    .expect("start");
    let done = wait_status(&pod, "done", |s| s.terminated).await;
    assert_eq!(
        (done.restart_count, done.last_exit.as_deref()),
        (0, Some("exit 0"))
    );
    wait_status(&pod, "retry", |s| {
        s.restart_count == 1 && s.backoff.is_none()
    })
    .await;
    wait_runs(&pod, "retry", 2).await;
    pod.stop().await;
}
