//! Property tests: `mutate` and the review decoding never panic, and what
//! they produce is always usable.

use std::collections::BTreeMap;

use proptest::prelude::*;
use remora_crds::SidecarMode;
use remora_inject::patch::{Outcome, Selection, SkipReason, Target, mutate};
use remora_inject::resolve::{ChartDefaults, EffectiveConfig};
use remora_inject::review::StaticView;
use serde_json::{Value, json};

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        "[a-z0-9./-]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z]{1,8}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Pod-like values: the right skeleton with random contents in every slot.
fn pod_like() -> impl Strategy<Value = Value> {
    let container = || {
        let name = prop_oneof![Just(json!("app")), Just(json!("remora-proxy")), any_json()];
        (name, any_json(), prop::option::of(any::<i64>())).prop_map(|(n, extra, port)| {
            let mut c = json!({"name": n, "extra": extra});
            if let Some(p) = port {
                c["ports"] = json!([{"containerPort": p}]);
            }
            c
        })
    };
    (
        prop::collection::vec(container(), 0..4),
        prop::option::of(prop::collection::vec(container(), 0..3)),
        prop::option::of(any_json()),
        prop::option::of(any::<i64>()),
        prop::option::of(any::<bool>()),
        prop::collection::btree_map(
            prop_oneof![
                Just("remora.dev/inject".to_string()),
                Just("remora.dev/sidecar-mode".to_string()),
                Just("remora.dev/drain-duration".to_string()),
                "[a-z]{1,6}"
            ],
            "[a-zA-Z0-9]{0,6}",
            0..4,
        ),
    )
        .prop_map(|(containers, init, volumes, grace, host, labels)| {
            let mut spec = json!({"containers": containers});
            if let Some(i) = init {
                spec["initContainers"] = json!(i);
            }
            if let Some(v) = volumes {
                spec["volumes"] = v;
            }
            if let Some(g) = grace {
                spec["terminationGracePeriodSeconds"] = json!(g);
            }
            if let Some(h) = host {
                spec["hostNetwork"] = json!(h);
            }
            json!({"metadata": {"labels": labels.clone(), "annotations": labels}, "spec": spec})
        })
}

fn cfg() -> EffectiveConfig {
    EffectiveConfig::from_defaults(&ChartDefaults::default())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn mutate_never_panics_on_anything(v in any_json()) {
        let labels = BTreeMap::new();
        let t = Target { namespace: "x", namespace_labels: &labels, native_sidecars: true, selection: Selection::Offline };
        let _ = mutate(&v, &t, &cfg());
    }

    #[test]
    fn injected_patches_apply_and_are_idempotent(pod in pod_like(), native in any::<bool>(), mode in 0u8..3) {
        let labels = BTreeMap::from([("remora.dev/inject".to_string(), "enabled".to_string())]);
        let t = Target { namespace: "shop", namespace_labels: &labels, native_sidecars: native, selection: Selection::Webhook };
        let mut c = cfg();
        c.mode = [SidecarMode::Auto, SidecarMode::Legacy, SidecarMode::Native][usize::from(mode)];
        if let Ok(m) = mutate(&pod, &t, &c) {
            let mut out = pod.clone();
            prop_assert!(json_patch::patch(&mut out, &m.patch).is_ok(), "patch does not apply: {:?}", m.patch);
            if let Outcome::Injected(_) = m.outcome {
                let again = mutate(&out, &t, &c);
                prop_assert!(matches!(again, Ok(ref m2) if m2.outcome == Outcome::Skipped(SkipReason::AlreadyInjected) && m2.patch.0.is_empty()), "{again:?}");
            } else {
                prop_assert!(m.patch.0.is_empty());
            }
        }
    }

    #[test]
    fn review_decoding_always_answers(body in prop::collection::vec(any::<u8>(), 0..256), obj in any_json(), kind in prop_oneof![Just("Pod".to_string()), Just("Deployment".to_string()), "[A-Z][a-z]{0,6}"]) {
        let (view, chart) = (StaticView::default(), ChartDefaults::default());
        for b in [body, serde_json::to_vec(&json!({"request": {"uid": "u", "kind": {"group": "", "version": "v1", "kind": kind}, "resource": {"group": "", "version": "v1", "resource": "pods"}, "operation": "CREATE", "userInfo": {}, "object": obj}})).unwrap_or_default()] {
            let (rev, _) = view.review(&b, &chart, "remora-system");
            let v = serde_json::to_value(&rev).map_err(|e| TestCaseError::fail(e.to_string()))?;
            // Allowed, unless refused with the reason (a pod asking for
            // listeners on the sidecar's own ports).
            let refused = v["response"]["status"]["message"].as_str().is_some_and(|m| m.starts_with("remora: refused: "));
            prop_assert!(v["response"]["allowed"] == json!(true) || refused, "{}", v);
        }
    }
}
