//! Every file under `bench/results/`, in one table: the command that
//! regenerates it, what that command needs, about how long it takes, and the
//! code it measures. `scripts/bench.sh` (the `bench-all` bin) runs from it and
//! `e2e/tests/repo/results.rs` checks from it that each file is no older than that
//! code.
//!
//! A file is fresh when its stamp (`remora_test_support::results::stamp`)
//! names a clean commit that is an ancestor of `HEAD` and no commit since
//! touched its measured paths. Files that cannot be regenerated in the
//! session that changed their code are listed stale with the reason; the test
//! fails when such a file is in fact fresh, so the list only shrinks.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// What a command needs beyond a checkout and a Rust toolchain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The real node: `scripts/cluster.sh up` and `scripts/images.sh`, as root.
    Node,
    /// Istio's binaries, the peers compared with (`scripts/build-pilot-agent.sh`,
    /// `scripts/build-pilot-discovery.sh`, `scripts/images.sh istio-proxy`).
    IstioPeers,
    /// A release build (figures from a debug build are not comparable).
    Release,
}

impl Need {
    pub fn label(self) -> &'static str {
        match self {
            Need::Node => "node",
            Need::IstioPeers => "istio",
            Need::Release => "release",
        }
    }
}

/// One results file (and what its command writes beside it).
#[derive(Debug)]
pub struct Entry {
    /// Under `bench/results/`; the first is the stamped JSON.
    pub files: &'static [&'static str],
    /// A shell command run from the repository's root.
    pub command: &'static str,
    pub needs: &'static [Need],
    /// Roughly, on this project's 2-core machine.
    pub minutes: u32,
    /// Repository paths of the product code it exercises and of the bench's
    /// own source (not the shared harness).
    pub measures: &'static [&'static str],
    /// Why the committed file may be older than its code; `None`: it must be fresh.
    pub stale: Option<&'static str>,
}

impl Entry {
    /// The stamped JSON file's name, e.g. `agent.json`.
    pub fn file(&self) -> &'static str {
        self.files[0]
    }

    /// The name `--only` takes: the file's stem.
    pub fn name(&self) -> &'static str {
        self.file().trim_end_matches(".json")
    }
}

const AGENT: &str = "agent/src";
/// The agent binary's link options.
const AGENT_BUILD: &str = "agent/build.rs";
const CONTRACT: &str = "contract/src";
const SERVE: &str = "serve/src";
const INJECT: &str = "inject/src";
const CRDS: &str = "crds/src";
const PROTO: &str = "proto";
const OPERATOR: &str = "operator/src";
const DISCOVERY: &str = "operator/src/discovery";
const CHART: &str = "charts/remora";
/// The paths of several lists as one, for entries that measure a shared
/// core and files of their own: `paths!(NODE_CODE, &["e2e/src/x.rs"])`.
macro_rules! paths {
    ($($group:expr),+ $(,)?) => {{
        const LEN: usize = 0 $(+ $group.len())+;
        const ALL: [&str; LEN] = concat_paths([$($group),+]);
        &ALL
    }};
}

const fn concat_paths<const N: usize, const G: usize>(
    groups: [&[&'static str]; G],
) -> [&'static str; N] {
    let mut out = [""; N];
    let (mut g, mut n) = (0, 0);
    while g < G {
        let mut i = 0;
        while i < groups[g].len() {
            out[n] = groups[g][i];
            n += 1;
            i += 1;
        }
        g += 1;
    }
    out
}

/// What the simulated-proxy benches drive: the discovery server and their
/// shared fleet.
const PUSH_CODE: &[&str] = &[
    DISCOVERY,
    PROTO,
    "operator/benches/support",
    "test-support/src/ads_requests.rs",
];
const PUSH_BENCH: &[&str] = paths!(PUSH_CODE, &["operator/benches/discovery_push.rs"]);
const DISCOVERY_BENCH: &[&str] = &[
    DISCOVERY,
    PROTO,
    "test-support/src/ads_requests.rs",
    "e2e/src/discovery_bench",
    "e2e/src/bin/discovery-bench.rs",
];
/// What a pod on the node runs: the images' code and the chart.
const NODE_CODE: &[&str] = &[AGENT, AGENT_BUILD, CONTRACT, OPERATOR, INJECT, CHART];
const NODE_BENCH: &[&str] = paths!(
    NODE_CODE,
    &["e2e/src/eds_convergence.rs", "e2e/src/bin/node-bench.rs"]
);
/// A CI run's phases: the scripts it runs and the dependencies it builds.
const CI: &[&str] = &["scripts", "Cargo.lock"];
const QUIET_STALE: &str = "stale: the 5 s quiet-period default and the held startup check came after; not regenerated this session";
const ISTIOD_STALE: &str = "stale: a side-by-side with Istio's pilot-discovery kept as a README history row, not regenerated this session";

const RELEASE: &[Need] = &[Need::Release];
const NODE: &[Need] = &[Need::Node, Need::Release];
const NODE_ISTIO: &[Need] = &[Need::Node, Need::IstioPeers, Need::Release];
/// Istio's binaries on a local control plane of the bench's own.
const ISTIO: &[Need] = &[Need::IstioPeers, Need::Release];

/// Every file under `bench/results/`.
pub const ENTRIES: &[Entry] = &[
    Entry {
        files: &["agent.json"],
        command: "cargo bench -p remora-agent --bench agent",
        needs: RELEASE,
        minutes: 2,
        measures: &[AGENT, CONTRACT, SERVE, "agent/benches/agent.rs"],
        stale: None,
    },
    Entry {
        files: &["sds.json"],
        command: "cargo bench -p remora-agent --bench sds",
        needs: RELEASE,
        minutes: 2,
        measures: &["agent/src/certs", "agent/src/sds", "agent/benches/sds.rs"],
        stale: None,
    },
    Entry {
        files: &["injector.json"],
        command: "cargo bench -p remora-operator --bench injector",
        needs: RELEASE,
        minutes: 2,
        measures: &[
            "operator/src/webhook",
            INJECT,
            CRDS,
            CONTRACT,
            SERVE,
            "operator/benches/injector.rs",
        ],
        stale: None,
    },
    Entry {
        files: &["pod-store.json"],
        command: "cargo bench -p remora-operator --bench pod_store",
        needs: RELEASE,
        minutes: 1,
        measures: &[
            "operator/src/cluster/live_pod.rs",
            "operator/src/controllers/lifecycle/status.rs",
            "operator/benches/pod_store.rs",
        ],
        stale: None,
    },
    Entry {
        files: &["discovery-heap.json"],
        command: "cargo bench -p remora-operator --bench discovery_heap -- --proxies 1000 --protocol delta",
        needs: RELEASE,
        minutes: 5,
        measures: paths!(PUSH_CODE, &["operator/benches/discovery_heap.rs"]),
        stale: None,
    },
    Entry {
        files: &["discovery-push.json"],
        command: "cargo bench -p remora-operator --bench discovery_push -- --proxies 1000 --services 100",
        needs: RELEASE,
        minutes: 5,
        measures: PUSH_BENCH,
        stale: None,
    },
    Entry {
        files: &["discovery-debounce.json"],
        command: "cargo bench -p remora-operator --bench discovery_push -- --proxies 1000 --services 100 \
                  --debounce-quiet-ms 0,25,50,100,250 --rollout-step-ms 10,100 \
                  --out \"$PWD/bench/results/discovery-debounce.json\"",
        needs: RELEASE,
        minutes: 7,
        measures: PUSH_BENCH,
        stale: None,
    },
    Entry {
        files: &["discovery-push-throttle.json"],
        command: "cargo bench -p remora-operator --bench discovery_push -- --proxies 1000 --services 100 \
                  --push-throttle 1,10,100,100000 \
                  --out \"$PWD/bench/results/discovery-push-throttle.json\"",
        needs: RELEASE,
        minutes: 6,
        measures: PUSH_BENCH,
        stale: None,
    },
    Entry {
        files: &["discovery-push-9500.json"],
        command: "cargo bench -p remora-operator --bench discovery_push -- --proxies 9500 --services 1000 \
                  --changes 10 --out \"$PWD/bench/results/discovery-push-9500.json\"",
        needs: RELEASE,
        minutes: 25,
        measures: PUSH_BENCH,
        stale: Some("stale: 9,500-proxy run, about 25 min, not regenerated this session"),
    },
    Entry {
        files: &["discovery-istiod.json"],
        command: "scripts/build-pilot-discovery.sh && \
                  KUBECONFIG=/var/tmp/remora-cluster/admin.kubeconfig \
                  cargo run --release -p e2e --bin discovery-bench -- --proxies 100,1000 --services 100",
        needs: NODE_ISTIO,
        minutes: 20,
        measures: DISCOVERY_BENCH,
        stale: Some(
            "stale: needs the node and Istio's pilot-discovery; not regenerated this session",
        ),
    },
    Entry {
        files: &["discovery-istiod-eds-debounce-off.json"],
        command: "scripts/build-pilot-discovery.sh && \
                  KUBECONFIG=/var/tmp/remora-cluster/admin.kubeconfig \
                  cargo run --release -p e2e --bin discovery-bench -- --proxies 1000 --services 100 \
                  --cycles 2 --contenders istiod-sidecars --istiod-env PILOT_ENABLE_EDS_DEBOUNCE=false \
                  --out \"$PWD/bench/results/discovery-istiod-eds-debounce-off.json\"",
        needs: NODE_ISTIO,
        minutes: 10,
        measures: DISCOVERY_BENCH,
        stale: Some(ISTIOD_STALE),
    },
    Entry {
        files: &["discovery-istiod-10000.json"],
        command: "KUBECONFIG=/var/tmp/remora-cluster/admin.kubeconfig \
                  cargo run --release -p e2e --bin discovery-bench -- --proxies 1000,10000 --services 100 \
                  --contenders remora --cycles 1 --changes 3 --protocol delta \
                  --namespace discovery-bench-push10k \
                  --out \"$PWD/bench/results/discovery-istiod-10000.json\"",
        needs: NODE,
        minutes: 25,
        measures: DISCOVERY_BENCH,
        stale: Some(
            "stale: needs the node, 10,000-proxy run, about 25 min; not regenerated this session",
        ),
    },
    Entry {
        files: &["discovery-istiod-sidecars-10000.json"],
        command: "scripts/build-pilot-discovery.sh && \
                  KUBECONFIG=/var/tmp/remora-cluster/admin.kubeconfig \
                  cargo run --release -p e2e --bin discovery-bench -- --proxies 10000 --services 100 \
                  --contenders istiod-sidecars --cycles 1 --changes 3 --protocol delta \
                  --namespace discovery-bench-push10k \
                  --out \"$PWD/bench/results/discovery-istiod-sidecars-10000.json\"",
        needs: NODE_ISTIO,
        minutes: 25,
        measures: DISCOVERY_BENCH,
        stale: Some(ISTIOD_STALE),
    },
    Entry {
        files: &["withdrawal-convergence.json"],
        command: "scripts/build-pilot-discovery.sh && \
                  env -u KUBECONFIG cargo run --release -p e2e --bin discovery-bench -- --only withdrawal \
                  --proxies 10,100,1000 --services 100 --rollouts 3",
        needs: ISTIO,
        minutes: 15,
        measures: DISCOVERY_BENCH,
        stale: None,
    },
    Entry {
        files: &["agent-microbench.json"],
        command: "scripts/build-pilot-agent.sh && cargo build --release -p remora-agent && \
                  cargo run --release -p e2e --bin agent-microbench",
        needs: &[Need::IstioPeers, Need::Release],
        minutes: 10,
        measures: &[
            AGENT,
            AGENT_BUILD,
            CONTRACT,
            SERVE,
            "e2e/src/agentbench",
            "e2e/src/bin/agent-microbench.rs",
        ],
        stale: None,
    },
    Entry {
        files: &["hostile.json"],
        command: "cargo build --release -p remora-agent -p remora-operator && \
                  cargo run --release -p e2e --bin hostile-bench",
        needs: RELEASE,
        minutes: 3,
        measures: &[
            AGENT,
            AGENT_BUILD,
            SERVE,
            "operator/src/webhook",
            "e2e/src/hostile.rs",
            "e2e/src/bin/hostile-bench.rs",
        ],
        stale: None,
    },
    Entry {
        files: &["scale.json"],
        command: "cargo build --release -p remora-operator && \
                  cargo run --release -p e2e --bin scale-bench",
        needs: RELEASE,
        minutes: 25,
        measures: &[
            OPERATOR,
            INJECT,
            CRDS,
            CONTRACT,
            SERVE,
            "e2e/src/scale.rs",
            "e2e/src/scale_run",
            "e2e/src/bin/scale-bench.rs",
        ],
        stale: Some(QUIET_STALE),
    },
    Entry {
        files: &["workload-ca.json"],
        command: "cargo run --release -p e2e --bin ca-bench",
        needs: NODE,
        minutes: 5,
        measures: &[
            "operator/src/pki",
            "operator/src/identity.rs",
            "operator/src/grpc_server.rs",
            CHART,
            "e2e/src/bin/ca-bench.rs",
        ],
        stale: None,
    },
    Entry {
        files: &["node.json"],
        command: "scripts/images.sh istio-proxy && cargo run --release -p e2e --bin node-bench -- \
                  --only startup,jobs,retune",
        needs: NODE_ISTIO,
        minutes: 30,
        measures: paths!(
            NODE_CODE,
            &["e2e/src/bin/node-bench.rs", "e2e/src/node/istio.rs"]
        ),
        stale: Some(
            "stale: 7615876 changed only a test's literal in operator/src; the rerun at 0533cb2 \
             used images built beside uncommitted doc edits (dirty), so it was not kept",
        ),
    },
    Entry {
        files: &["eds-convergence.json"],
        command: "cargo run --release -p e2e --bin node-bench -- --only convergence --installs on \
                  --clients 1,10,50 --deletions 10",
        needs: NODE,
        minutes: 10,
        measures: NODE_BENCH,
        stale: Some(QUIET_STALE),
    },
    Entry {
        files: &["withdrawal-node.json"],
        command: "cargo run --release -p e2e --bin node-bench -- --only withdrawal --installs on \
                  --rollouts 3",
        needs: NODE,
        minutes: 5,
        measures: paths!(NODE_BENCH, &["e2e/src/withdrawal_rollout.rs"]),
        stale: Some(QUIET_STALE),
    },
    Entry {
        files: &["lifecycle-node.json"],
        command: "scripts/images.sh istio-proxy && cargo run --release -p e2e --bin lifecycle-bench -- \
                  --only plain-envoy,remora-legacy-defaults,remora-native-defaults,istio-defaults,\
                  istio-native-hold,istio-legacy-defaults,istio-tuned-for-lag,rolling-update \
                  --lag 0s,5s,10s --cycles 2",
        needs: NODE_ISTIO,
        minutes: 45,
        measures: paths!(NODE_CODE, &["e2e/src/bin/lifecycle-bench.rs"]),
        stale: Some(QUIET_STALE),
    },
    // A cold CI run: a new clone and target, REMORA_CACHE, CARGO_HOME,
    // GOCACHE and GOMODCACHE all new (pip's Envoy and Debian's packages
    // stay installed).
    Entry {
        files: &["ci-phases.json"],
        command: "scripts/test.sh && cp target/ci-phases.json bench/results/ci-phases.json",
        needs: &[Need::Node, Need::IstioPeers],
        minutes: 57,
        measures: CI,
        stale: Some(
            "stale: scripts/lib/controlplane.sh came after the last cold run; a cold run needs every cache emptied",
        ),
    },
    // A CI run as this machine gives it: a new clone and target, the caches
    // (REMORA_CACHE, CARGO_HOME, Go's) kept from earlier runs.
    Entry {
        files: &["ci-phases-warm.json"],
        command: "scripts/test.sh && cp target/ci-phases.json bench/results/ci-phases-warm.json",
        needs: &[Need::Node, Need::IstioPeers],
        minutes: 40,
        measures: CI,
        stale: None,
    },
];

/// The entry for `name` (a file's stem or its name).
pub fn find(name: &str) -> Option<&'static Entry> {
    ENTRIES
        .iter()
        .find(|e| e.name() == name || e.files.contains(&name))
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("git {args}: {reason}")]
    Git { args: String, reason: String },
    #[error("the clone is shallow: freshness needs the whole history (`git fetch --unshallow`)")]
    Shallow,
    #[error("unreadable: {reason}")]
    Unreadable { file: String, reason: String },
    #[error("no {key:?}: not stamped by remora_test_support::results")]
    Unstamped { file: String, key: &'static str },
}

/// How a results file stands against the code it measures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Freshness {
    Fresh,
    /// Why not, in a line.
    Stale(String),
}

/// Runs `git` in `root`; its trimmed stdout.
fn git(root: &Path, args: &[&str]) -> Result<(bool, String), Error> {
    let out = Command::new("git")
        .current_dir(root)
        .args(args)
        .output()
        .map_err(|e| Error::Git {
            args: args.join(" "),
            reason: e.to_string(),
        })?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
    ))
}

/// Fails unless `root` is a git checkout with its whole history.
pub fn check_history(root: &Path) -> Result<(), Error> {
    match git(root, &["rev-parse", "--is-shallow-repository"])? {
        (true, s) if s == "false" => Ok(()),
        (true, _) => Err(Error::Shallow),
        (false, _) => Err(Error::Git {
            args: "rev-parse".into(),
            reason: format!("{} is not a git checkout", root.display()),
        }),
    }
}

/// Whether `entry`'s file under `root/bench/results` is as new as its code.
/// An error: the file cannot be judged (unreadable, unstamped, git failing).
pub fn freshness(root: &Path, entry: &Entry) -> Result<Freshness, Error> {
    let file = entry.file();
    let path = root.join("bench/results").join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Unreadable {
        file: file.into(),
        reason: e.to_string(),
    })?;
    let doc: Value = serde_json::from_str(&text).map_err(|e| Error::Unreadable {
        file: file.into(),
        reason: format!("not JSON: {e}"),
    })?;
    judge(root, file, &doc, entry.measures)
}

/// [`freshness`] of a results document `doc` (named `file`) that measures
/// `measures`, against the history of the checkout at `root`: stale when
/// a commit since the measured one touched those paths and left them
/// different.
pub fn judge(root: &Path, file: &str, doc: &Value, measures: &[&str]) -> Result<Freshness, Error> {
    for key in ["command", "commit", "date", "machine_before"] {
        if doc.get(key).is_none_or(Value::is_null) {
            return Err(Error::Unstamped {
                file: file.into(),
                key,
            });
        }
    }
    let commit = doc["commit"].as_str().unwrap_or_default();
    if commit.len() != 40 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Ok(Freshness::Stale(format!(
            "commit {commit:?} is not a commit id"
        )));
    }
    if doc["dirty"] != Value::Bool(false) {
        return Ok(Freshness::Stale(format!(
            "measured {commit} with uncommitted changes (dirty)"
        )));
    }
    let (ancestor, _) = git(root, &["merge-base", "--is-ancestor", commit, "HEAD"])?;
    if !ancestor {
        return Ok(Freshness::Stale(format!(
            "commit {commit} is not an ancestor of HEAD"
        )));
    }
    let range = format!("{commit}..HEAD");
    let mut args = vec!["log", "--format=%h %s", range.as_str(), "--"];
    args.extend(measures);
    let (ok, log) = git(root, &args)?;
    if !ok {
        return Err(Error::Git {
            args: args.join(" "),
            reason: "failed".into(),
        });
    }
    if log.is_empty() {
        return Ok(Freshness::Fresh);
    }
    // Commits that touched the paths and left them as measured (a change
    // and its revert) change nothing the file measured.
    let mut diff = vec!["diff", "--quiet", commit, "HEAD", "--"];
    diff.extend(measures);
    if let (true, _) = git(root, &diff)? {
        return Ok(Freshness::Fresh);
    }
    let lines: Vec<&str> = log.lines().collect();
    Ok(Freshness::Stale(format!(
        "{} commit(s) since {} touched {}; newest: {}",
        lines.len(),
        &commit[..10],
        measures.join(" "),
        lines[0]
    )))
}

/// The table as `bench-all --list` prints it (and the README quotes it).
pub fn table() -> String {
    let mut out = String::from("| file | needs | ~min | command |\n|---|---|---|---|\n");
    for e in ENTRIES {
        let needs: Vec<&str> = e.needs.iter().map(|n| n.label()).collect();
        let command = e.command.split_whitespace().collect::<Vec<_>>().join(" ");
        out.push_str(&format!(
            "| {} | {} | {} | `{}` |\n",
            e.files.join(", "),
            if needs.is_empty() {
                "-".into()
            } else {
                needs.join(", ")
            },
            e.minutes,
            command
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_found() {
        let mut seen = std::collections::BTreeSet::new();
        for e in ENTRIES {
            assert!(seen.insert(e.name()), "{} twice", e.name());
            assert_eq!(find(e.name()).expect("found").file(), e.file());
            assert!(!e.measures.is_empty(), "{} measures nothing", e.name());
            let paths: std::collections::BTreeSet<_> = e.measures.iter().collect();
            assert_eq!(
                paths.len(),
                e.measures.len(),
                "{} lists a path twice",
                e.name()
            );
            assert!(!paths.contains(&""), "{} lists an empty path", e.name());
        }
        assert!(find("nothing").is_none());
    }
}
