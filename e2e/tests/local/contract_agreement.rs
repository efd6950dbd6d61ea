//! The operator and the agent read a pod's annotations the same way.
//!
//! For each annotation set (and, for the withdrawal timeout, a
//! SidecarLifecycle's `shutdown.withdrawalTimeout` under them), the
//! operator resolves the pod's effective config and injects it; the agent is then configured from the injected
//! container's env (as the kubelet starts it) and reads the pod's
//! annotations from a downward-API file (as the kubelet writes it). The drain
//! settings the agent uses must be the ones the operator resolved, field by
//! field, and a value one side refuses the other refuses too.
//!
//! Both sides parse and apply the overlay with the contract's
//! `Overlay::apply_drain`; what can still drift is the path around it: the
//! env the operator writes and the agent's flags parse, the
//! `remora.dev/lifecycle` JSON, the downward-API file and the drain deadline.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Parser;
use proptest::prelude::*;
use remora_agent::config::{Cli, Command};
use remora_agent::lifecycle::DrainSettings;
use remora_contract::{annotations as keys, downward, duration};
use remora_crds::{DurationString, ShutdownSpec, SidecarLifecycleSpec};
use remora_inject::patch::{Outcome, Selection, Target, mutate};
use remora_inject::resolve::{ChartDefaults, EffectiveConfig, LifecycleEntry, resolve};
use remora_test_support::maps::string_map as ann;
use serde_json::{Value, json};

/// What each side ended up with for one pod.
struct Sides {
    operator: EffectiveConfig,
    deadline: Duration,
    agent: DrainSettings,
    /// Annotation keys each side reported as bad.
    operator_refused: Vec<String>,
    agent_refused: Vec<String>,
}

/// Go's `strconv.Quote` closely enough for the parser: JSON string escaping
/// produces only escapes Go's `%q` also uses (`\"`, `\\`, `\n`, `\uXXXX`...).
fn downward_file(ann: &BTreeMap<String, String>) -> String {
    ann.iter()
        .map(|(k, v)| format!("{k}={}\n", Value::String(v.clone())))
        .collect()
}

/// The operator's namespace: a SidecarLifecycle there without a selector
/// is the cluster's default.
const OPERATOR_NS: &str = "remora-system";

/// A cluster-wide SidecarLifecycle setting `shutdown.withdrawalTimeout`.
fn cluster_withdrawal_timeout(raw: &str) -> LifecycleEntry {
    LifecycleEntry {
        namespace: OPERATOR_NS.into(),
        name: "default".into(),
        created: Some("2026-01-01T00:00:00Z".into()),
        spec: SidecarLifecycleSpec {
            shutdown: Some(ShutdownSpec {
                withdrawal_timeout: Some(DurationString(raw.into())),
                ..Default::default()
            }),
            ..Default::default()
        },
    }
}

/// What each side ends up with for a pod annotated `ann`, under the
/// SidecarLifecycle resources `entries`.
fn both_sides(
    entries: &[LifecycleEntry],
    ann: &BTreeMap<String, String>,
    grace: Option<i64>,
) -> Sides {
    let chart = ChartDefaults::default();
    let labels = BTreeMap::new();
    let operator = resolve(&chart, entries, OPERATOR_NS, "shop", &labels, ann);
    let mut pod = json!({
        "metadata": {"name": "p", "namespace": "shop", "annotations": ann},
        "spec": {"containers": [{"name": "app", "image": "app"}]},
    });
    if let Some(g) = grace {
        pod["spec"]["terminationGracePeriodSeconds"] = json!(g);
    }
    let ns_labels = BTreeMap::from([(keys::INJECT_LABEL.to_string(), "enabled".to_string())]);
    let target = Target {
        namespace: "shop",
        namespace_labels: &ns_labels,
        native_sidecars: true,
        selection: Selection::Webhook,
    };
    let m = mutate(&pod, &target, &operator).expect("mutate never fails on a pod");
    assert!(matches!(m.outcome, Outcome::Injected(_)), "{:?}", m.outcome);
    let mut injected = pod.clone();
    json_patch::patch(&mut injected, &m.patch).expect("the patch applies");

    // The agent as the kubelet starts it: the sidecar's env as flags.
    let sidecar = injected["spec"]["initContainers"]
        .as_array()
        .into_iter()
        .chain(injected["spec"]["containers"].as_array())
        .flatten()
        .find(|c| c["name"] == remora_contract::pod::PROXY_CONTAINER)
        .expect("a sidecar")
        .clone();
    let mut argv = vec!["remora-agent".to_string(), "run".to_string()];
    for e in sidecar["env"].as_array().into_iter().flatten() {
        let (Some(name), Some(value)) = (e["name"].as_str(), e["value"].as_str()) else {
            continue; // downward-API fields
        };
        let flag = name
            .trim_start_matches("REMORA_")
            .to_lowercase()
            .replace('_', "-");
        argv.push(format!("--{flag}={value}"));
    }
    let cli = Cli::try_parse_from(&argv)
        .unwrap_or_else(|e| panic!("the agent refuses the injected env {argv:?}: {e}"));
    let Command::Run(cfg) = cli.command else {
        unreachable!("run")
    };

    // The pod's annotations as the kubelet writes them for the agent.
    let final_ann: BTreeMap<String, String> =
        serde_json::from_value(injected["metadata"]["annotations"].clone()).expect("strings");
    let read = downward::parse_annotations(&downward_file(&final_ann))
        .expect("the agent parses the kubelet's file");
    assert_eq!(read, final_ann, "the downward-API file round-trips");
    let (agent, problems) = DrainSettings::from_config(&cfg).with_annotations(&read);

    let refused = |problems: &[String]| -> Vec<String> {
        let mut keys: Vec<String> = keys::PER_FIELD
            .iter()
            .filter(|k| problems.iter().any(|p| p.contains(&format!("{k}:"))))
            .map(|k| k.to_string())
            .collect();
        keys.sort();
        keys
    };
    Sides {
        operator_refused: refused(&operator.problems),
        agent_refused: refused(&problems),
        deadline: remora_contract::pod::drain_deadline(grace.unwrap_or(30)),
        operator,
        agent,
    }
}

fn assert_agree(ann: &BTreeMap<String, String>, grace: Option<i64>) -> Sides {
    assert_agree_under(&[], ann, grace)
}

fn assert_agree_under(
    entries: &[LifecycleEntry],
    ann: &BTreeMap<String, String>,
    grace: Option<i64>,
) -> Sides {
    let s = both_sides(entries, ann, grace);
    let i = &s.operator;
    let a = &s.agent;
    let what = format!("annotations {ann:?}");
    assert_eq!(a.drain_duration, i.drain_duration, "drainDuration, {what}");
    assert_eq!(
        a.termination_drain_duration, i.termination_drain_duration,
        "terminationDrainDuration, {what}"
    );
    assert_eq!(
        a.exit_on_zero_active_connections, i.exit_on_zero_active_connections,
        "exitOnZeroActiveConnections, {what}"
    );
    assert_eq!(
        a.minimum_drain_duration, i.minimum_drain_duration,
        "minimumDrainDuration, {what}"
    );
    assert_eq!(
        a.withdrawal_timeout, i.withdrawal_timeout,
        "withdrawalTimeout, {what}"
    );
    assert_eq!(a.drain_deadline, s.deadline, "drainDeadline, {what}");
    // Only the drain fields are live; the agent does not read the others.
    let live = |v: &Vec<String>| -> Vec<String> {
        v.iter()
            .filter(|k| {
                [
                    keys::DRAIN_DURATION,
                    keys::TERMINATION_DRAIN_DURATION,
                    keys::EXIT_ON_ZERO_ACTIVE_CONNECTIONS,
                    keys::MINIMUM_DRAIN_DURATION,
                    keys::WITHDRAWAL_TIMEOUT,
                ]
                .contains(&k.as_str())
            })
            .cloned()
            .collect()
    };
    assert_eq!(live(&s.agent_refused), live(&s.operator_refused), "{what}");
    s
}

#[test]
fn the_table() {
    let s = Duration::from_secs;
    // (annotations, expected drainDuration, keys refused)
    let table: Vec<(BTreeMap<String, String>, Duration, Vec<&str>)> = vec![
        (ann(&[]), s(45), vec![]),
        (ann(&[(keys::DRAIN_DURATION, "30s")]), s(30), vec![]),
        (ann(&[(keys::DRAIN_DURATION, " 1m30s\n")]), s(90), vec![]),
        // A bare number: refused by both (it was 30 s on one side, ignored on the other).
        (
            ann(&[(keys::DRAIN_DURATION, "30")]),
            s(45),
            vec![keys::DRAIN_DURATION],
        ),
        (
            ann(&[(keys::DRAIN_DURATION, "\"30s\"")]),
            s(45),
            vec![keys::DRAIN_DURATION],
        ),
        (
            ann(&[(keys::DRAIN_DURATION, "1.5s")]),
            s(45),
            vec![keys::DRAIN_DURATION],
        ),
        (
            ann(&[(keys::DRAIN_DURATION, "３０s")]),
            s(45),
            vec![keys::DRAIN_DURATION],
        ),
        (
            ann(&[(keys::DRAIN_DURATION, "30s😀")]),
            s(45),
            vec![keys::DRAIN_DURATION],
        ),
        (ann(&[(keys::DRAIN_DURATION, "24h")]), s(86_400), vec![]),
        (
            ann(&[(keys::DRAIN_DURATION, "24h1s")]),
            s(45),
            vec![keys::DRAIN_DURATION],
        ),
        (
            ann(&[(keys::DRAIN_DURATION, "2562047788015215h30m2s")]),
            s(45),
            vec![keys::DRAIN_DURATION],
        ),
        (
            ann(&[
                (keys::TERMINATION_DRAIN_DURATION, "7s"),
                (keys::EXIT_ON_ZERO_ACTIVE_CONNECTIONS, "TRUE"),
                (keys::MINIMUM_DRAIN_DURATION, "250ms"),
            ]),
            s(45),
            vec![],
        ),
        (
            ann(&[
                (keys::EXIT_ON_ZERO_ACTIVE_CONNECTIONS, "maybe"),
                (keys::TERMINATION_DRAIN_DURATION, "-1s"),
                (keys::MINIMUM_DRAIN_DURATION, ""),
            ]),
            s(45),
            vec![
                keys::EXIT_ON_ZERO_ACTIVE_CONNECTIONS,
                keys::MINIMUM_DRAIN_DURATION,
                keys::TERMINATION_DRAIN_DURATION,
            ],
        ),
        // A user's own lifecycle JSON is replaced by the operator's.
        (
            ann(&[(keys::LIFECYCLE, r#"{"drainDeadline":"9999999h"}"#)]),
            s(45),
            vec![],
        ),
        (ann(&[(keys::WITHDRAWAL_TIMEOUT, "2s")]), s(45), vec![]),
        (ann(&[(keys::WITHDRAWAL_TIMEOUT, "0s")]), s(45), vec![]),
        (
            ann(&[(keys::WITHDRAWAL_TIMEOUT, "5")]),
            s(45),
            vec![keys::WITHDRAWAL_TIMEOUT],
        ),
        (
            ann(&[(keys::WITHDRAWAL_TIMEOUT, "-1s")]),
            s(45),
            vec![keys::WITHDRAWAL_TIMEOUT],
        ),
        (
            ann(&[
                ("other.io/note", "é\n\"quoted\"\t\\"),
                (keys::DRAIN_DURATION, "5s"),
            ]),
            s(5),
            vec![],
        ),
    ];
    for (a, drain, refused) in table {
        let sides = assert_agree(&a, None);
        assert_eq!(sides.operator.drain_duration, drain, "{a:?}");
        assert_eq!(sides.operator_refused, refused, "{a:?}");
    }
}

/// The withdrawal timeout from each place it is set: the default, the
/// cluster's SidecarLifecycle, the pod's annotation over it (and a refused
/// annotation leaving the SidecarLifecycle's).
#[test]
fn the_withdrawal_timeout_agrees_from_the_crd_the_annotation_and_the_default() {
    let s = Duration::from_secs;
    let crd = [cluster_withdrawal_timeout("12s")];
    let cases: Vec<(&[LifecycleEntry], BTreeMap<String, String>, Duration)> = vec![
        (&[], ann(&[]), s(5)),
        (&crd, ann(&[]), s(12)),
        (&crd, ann(&[(keys::WITHDRAWAL_TIMEOUT, "3s")]), s(3)),
        (&crd, ann(&[(keys::WITHDRAWAL_TIMEOUT, "soon")]), s(12)),
        (&[], ann(&[(keys::WITHDRAWAL_TIMEOUT, "1m")]), s(60)),
    ];
    for (entries, a, want) in cases {
        let sides = assert_agree_under(entries, &a, None);
        assert_eq!(sides.operator.withdrawal_timeout, want, "{a:?}");
        assert_eq!(sides.agent.withdrawal_timeout, want, "{a:?}");
    }
}

#[test]
fn a_huge_grace_period_gives_a_deadline_the_agent_accepts() {
    for grace in [
        i64::MAX,
        9_223_372_036_854_775,
        86_401,
        86_400,
        30,
        1,
        0,
        -5,
    ] {
        let s = assert_agree(&BTreeMap::new(), Some(grace));
        assert!(s.agent.drain_deadline <= duration::MAX, "grace {grace}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_value_of_any_key_agrees(
        key in proptest::sample::select(keys::PER_FIELD.to_vec()),
        raw in any::<String>(),
    ) {
        assert_agree(&ann(&[(key, raw.as_str())]), None);
    }

    #[test]
    fn duration_like_values_agree(
        key in proptest::sample::select(vec![
            keys::DRAIN_DURATION, keys::TERMINATION_DRAIN_DURATION, keys::MINIMUM_DRAIN_DURATION,
            keys::WITHDRAWAL_TIMEOUT,
        ]),
        raw in "[ ]?[0-9]{0,20}(h|m|s|ms|us|d|\\.5s)?([0-9]{1,3}(m|s|ms))?[ ]?",
        grace in proptest::option::of(any::<i64>()),
    ) {
        assert_agree(&ann(&[(key, raw.as_str())]), grace);
    }
}
