//! `mutate`: selection, the pod the patch gives, warnings, idempotency.

use std::collections::BTreeMap;

use remora_contract::annotations::LIFECYCLE as LIFECYCLE_ANNOTATION;
use remora_contract::lifecycle::LifecycleAnnotation;
use remora_contract::traffic::MAX_LISTENERS;
use remora_crds::SidecarMode;
use remora_inject::patch::{
    MutateError, Outcome, STATUS_ANNOTATION, Selection, SkipReason, Target, drain_deadline, mutate,
};
use remora_inject::resolve::{ChartDefaults, EffectiveConfig};
use remora_inject::traffic::PlumbingError;
use serde_json::{Value, json};
use std::time::Duration;

fn cfg(mode: SidecarMode) -> EffectiveConfig {
    let mut c = EffectiveConfig::from_defaults(&ChartDefaults::default());
    c.mode = mode;
    c
}

fn enabled() -> BTreeMap<String, String> {
    BTreeMap::from([("remora.dev/inject".to_string(), "enabled".to_string())])
}

fn target<'a>(ns: &'a str, labels: &'a BTreeMap<String, String>, native: bool) -> Target<'a> {
    Target {
        namespace: ns,
        namespace_labels: labels,
        native_sidecars: native,
        selection: Selection::Webhook,
    }
}

fn pod() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "labels": {"app": "web"}},
        "spec": {
            "initContainers": [{"name": "migrate", "image": "m"}],
            "containers": [{"name": "app", "image": "a", "ports": [{"containerPort": 8080}]}]
        }
    })
}

fn apply(pod: &Value, t: &Target<'_>, c: &EffectiveConfig) -> (Value, Outcome, Vec<String>) {
    let m = mutate(pod, t, c).expect("mutate");
    let mut out = pod.clone();
    json_patch::patch(&mut out, &m.patch).expect("the patch applies cleanly");
    (out, m.outcome, m.warnings)
}

#[test]
fn legacy_patch_gives_the_expected_pod() {
    let ns = enabled();
    let (out, outcome, warnings) = apply(
        &pod(),
        &target("shop", &ns, true),
        &cfg(SidecarMode::Legacy),
    );
    assert_eq!(outcome, Outcome::Injected(SidecarMode::Legacy));
    assert!(warnings.is_empty(), "{warnings:?}");
    let c = &out["spec"]["containers"];
    assert_eq!(c[0]["name"], "remora-proxy");
    assert_eq!(c[1]["name"], "app");
    assert_eq!(
        out["spec"]["initContainers"].as_array().map(Vec::len),
        Some(1)
    );
    assert_eq!(
        c[0]["lifecycle"]["postStart"]["exec"]["command"],
        json!(["remora-agent", "wait", "--timeout", "1m"])
    );
    assert_eq!(
        c[0]["lifecycle"]["preStop"]["exec"]["command"],
        json!(["remora-agent", "drain", "--timeout", "25s"])
    );
    assert_eq!(
        c[0]["readinessProbe"]["httpGet"],
        json!({"path": "/healthz/ready", "port": 15021})
    );
    let sc = &c[0]["securityContext"];
    assert_eq!(sc["runAsUser"], 1337);
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    let env: BTreeMap<&str, &Value> = c[0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| Some((e["name"].as_str()?, e)))
        .collect();
    for (name, path) in [
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
        ("INSTANCE_IP", "status.podIP"),
        ("SERVICE_ACCOUNT", "spec.serviceAccountName"),
    ] {
        assert_eq!(env[name]["valueFrom"]["fieldRef"]["fieldPath"], path);
    }
    assert_eq!(env["REMORA_DRAIN_DEADLINE"]["value"], "25s");
    let vols = &out["spec"]["volumes"];
    assert_eq!(vols[0]["name"], "remora-run");
    assert_eq!(
        vols[1]["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"],
        "metadata.annotations"
    );
    let mounts = &c[0]["volumeMounts"];
    assert_eq!(mounts[1]["mountPath"], "/etc/remora/podinfo");
    assert_eq!(mounts[0]["mountPath"], "/var/run/remora");
    // The lifecycle annotation is the agent's own wire type.
    let ann = out["metadata"]["annotations"][LIFECYCLE_ANNOTATION]
        .as_str()
        .expect("lifecycle");
    let l: LifecycleAnnotation = serde_json::from_str(ann).expect("agent parses it");
    assert_eq!(l.mode.as_deref(), Some("Legacy"));
    assert_eq!(l.drain_deadline.as_deref(), Some("25s"));
    let status: Value = serde_json::from_str(
        out["metadata"]["annotations"][STATUS_ANNOTATION]
            .as_str()
            .expect("status"),
    )
    .expect("json");
    assert_eq!(status["mode"], "Legacy");
    assert!(
        status["configHash"]
            .as_str()
            .is_some_and(|h| h.starts_with("sha256:"))
    );
}

#[test]
fn native_goes_first_among_init_containers_with_a_startup_probe() {
    let ns = enabled();
    let mut c = cfg(SidecarMode::Auto);
    c.startup_timeout = Duration::from_secs(90);
    let (out, outcome, _) = apply(&pod(), &target("shop", &ns, true), &c);
    assert_eq!(outcome, Outcome::Injected(SidecarMode::Native));
    let init = &out["spec"]["initContainers"];
    assert_eq!(init[0]["name"], "remora-proxy");
    assert_eq!(init[0]["restartPolicy"], "Always");
    assert_eq!(init[1]["name"], "migrate");
    let probe = &init[0]["startupProbe"];
    assert_eq!(probe["httpGet"]["port"], 15021);
    let budget = probe["periodSeconds"].as_i64().unwrap_or(0)
        * probe["failureThreshold"].as_i64().unwrap_or(0);
    assert_eq!(budget, 90);
    assert!(init[0]["lifecycle"].is_null());
    assert_eq!(out["spec"]["containers"][0]["name"], "app");
}

#[test]
fn auto_without_native_support_is_legacy_and_native_falls_back_with_a_warning() {
    let ns = enabled();
    let (_, outcome, _) = apply(&pod(), &target("shop", &ns, false), &cfg(SidecarMode::Auto));
    assert_eq!(outcome, Outcome::Injected(SidecarMode::Legacy));
    let (_, outcome, warnings) = apply(
        &pod(),
        &target("shop", &ns, false),
        &cfg(SidecarMode::Native),
    );
    assert_eq!(outcome, Outcome::Injected(SidecarMode::Legacy));
    assert!(
        warnings.iter().any(|w| w.contains("Native")),
        "{warnings:?}"
    );
}

#[test]
fn pod_without_annotations_volumes_or_init_containers() {
    let ns = enabled();
    let bare = json!({"spec": {"containers": [{"name": "app"}]}});
    for mode in [SidecarMode::Legacy, SidecarMode::Native] {
        let (out, outcome, _) = apply(&bare, &target("shop", &ns, true), &cfg(mode));
        assert_eq!(outcome, Outcome::Injected(mode));
        assert!(out["metadata"]["annotations"][STATUS_ANNOTATION].is_string());
        // The run dir, the downward API and the app hook's volume.
        assert_eq!(out["spec"]["volumes"].as_array().map(Vec::len), Some(3));
    }
}

#[test]
fn selection_rules() {
    let none = BTreeMap::new();
    let on = enabled();
    let with_label = |v: &str| {
        let mut p = pod();
        p["metadata"]["labels"]["remora.dev/inject"] = json!(v);
        p
    };
    let host_net = {
        let mut p = pod();
        p["spec"]["hostNetwork"] = json!(true);
        p
    };
    let named_proxy = {
        let mut p = pod();
        p["spec"]["containers"][0]["name"] = json!("remora-proxy");
        p
    };
    let injected = {
        let mut p = pod();
        p["metadata"]["annotations"] = json!({STATUS_ANNOTATION: "{}"});
        p
    };
    type Row<'a> = (
        &'a str,
        Value,
        &'a str,
        &'a BTreeMap<String, String>,
        Option<SkipReason>,
    );
    let rows: Vec<Row<'_>> = vec![
        ("namespace enabled", pod(), "shop", &on, None),
        ("pod label true", with_label("true"), "shop", &none, None),
        (
            "neither",
            pod(),
            "shop",
            &none,
            Some(SkipReason::NotSelected),
        ),
        (
            "pod false beats namespace",
            with_label("false"),
            "shop",
            &on,
            Some(SkipReason::OptedOut),
        ),
        (
            "kube-system",
            with_label("true"),
            "kube-system",
            &on,
            Some(SkipReason::SystemNamespace),
        ),
        (
            "kube-public",
            pod(),
            "kube-public",
            &on,
            Some(SkipReason::SystemNamespace),
        ),
        (
            "kube-node-lease",
            pod(),
            "kube-node-lease",
            &on,
            Some(SkipReason::SystemNamespace),
        ),
        (
            "hostNetwork",
            host_net,
            "shop",
            &on,
            Some(SkipReason::HostNetwork),
        ),
        (
            "already injected",
            injected,
            "shop",
            &on,
            Some(SkipReason::AlreadyInjected),
        ),
        (
            "user container named remora-proxy",
            named_proxy,
            "shop",
            &on,
            Some(SkipReason::NameConflict),
        ),
    ];
    for (what, p, ns, labels, want) in rows {
        let m = mutate(&p, &target(ns, labels, true), &cfg(SidecarMode::Legacy)).expect(what);
        match want {
            None => assert!(
                matches!(m.outcome, Outcome::Injected(_)),
                "{what}: {:?}",
                m.outcome
            ),
            Some(r) => {
                assert_eq!(m.outcome, Outcome::Skipped(r), "{what}");
                assert!(m.patch.0.is_empty(), "{what}: a skipped pod gets no patch");
            }
        }
    }
}

#[test]
fn inject_twice_equals_once() {
    let ns = enabled();
    for mode in [SidecarMode::Legacy, SidecarMode::Native] {
        let (once, _, _) = apply(&pod(), &target("shop", &ns, true), &cfg(mode));
        let m = mutate(&once, &target("shop", &ns, true), &cfg(mode)).expect("mutate");
        assert_eq!(m.outcome, Outcome::Skipped(SkipReason::AlreadyInjected));
        assert!(m.patch.0.is_empty());
    }
}

#[test]
fn warnings_for_grace_period_and_ports() {
    let ns = enabled();
    let mut p = pod();
    p["spec"]["terminationGracePeriodSeconds"] = json!(5);
    p["spec"]["containers"][0]["ports"] =
        json!([{"containerPort": 15021}, {"containerPort": 15090}]);
    let (_, outcome, warnings) = apply(&p, &target("shop", &ns, true), &cfg(SidecarMode::Legacy));
    assert!(matches!(outcome, Outcome::Injected(_)));
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("terminationDrainDuration") && w.contains("5")),
        "{warnings:?}"
    );
    assert!(warnings.iter().any(|w| w.contains("15021")), "{warnings:?}");
    assert!(warnings.iter().any(|w| w.contains("15090")), "{warnings:?}");

    let mut c = cfg(SidecarMode::Legacy);
    c.exit_on_zero_active_connections = true;
    c.minimum_drain_duration = Duration::from_secs(40);
    let (_, _, warnings) = apply(&pod(), &target("shop", &ns, true), &c);
    assert!(
        warnings.iter().any(|w| w.contains("minimumDrainDuration")),
        "{warnings:?}"
    );
}

#[test]
fn a_stop_annotation_at_creation_is_warned_about() {
    let ns = enabled();
    let mut p = pod();
    p["metadata"]["annotations"] = json!({"remora.dev/stop": "{}"});
    let (_, outcome, warnings) = apply(&p, &target("shop", &ns, true), &cfg(SidecarMode::Legacy));
    assert!(matches!(outcome, Outcome::Injected(_)));
    assert!(
        warnings.iter().any(|w| w.contains("remora.dev/stop")),
        "{warnings:?}"
    );
    let (_, _, warnings) = apply(
        &pod(),
        &target("shop", &ns, true),
        &cfg(SidecarMode::Legacy),
    );
    assert!(!warnings.iter().any(|w| w.contains("remora.dev/stop")));
}

#[test]
fn drain_deadline_keeps_a_margin() {
    assert_eq!(drain_deadline(30), Duration::from_secs(25));
    assert_eq!(drain_deadline(120), Duration::from_secs(115));
    assert_eq!(drain_deadline(6), Duration::from_secs(5));
    assert_eq!(drain_deadline(1), Duration::ZERO);
    assert_eq!(drain_deadline(0), Duration::ZERO);
    assert_eq!(drain_deadline(-5), Duration::ZERO);
}

#[test]
fn strange_but_valid_pods() {
    let ns = enabled();
    let existing_hooks = json!({"spec": {"containers": [{"name": "app", "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}}}],
        "ephemeralContainers": [{"name": "debug", "image": "busybox"}]}});
    let (out, outcome, _) = apply(
        &existing_hooks,
        &target("shop", &ns, true),
        &cfg(SidecarMode::Legacy),
    );
    assert!(matches!(outcome, Outcome::Injected(_)));
    assert_eq!(
        out["spec"]["containers"][1]["lifecycle"]["preStop"]["exec"]["command"],
        json!(["sleep", "5"])
    );
    assert_eq!(out["spec"]["ephemeralContainers"][0]["name"], "debug");
    // Shapes that cannot be injected are errors, never panics.
    for bad in [
        json!(null),
        json!([]),
        json!({"spec": {"containers": []}}),
        json!({"spec": {"containers": "x"}}),
        json!({"spec": {"containers": [{}], "volumes": 3}}),
        json!({"metadata": 1, "spec": {"containers": [{}]}}),
        json!({"metadata": {"annotations": []}, "spec": {"containers": [{}]}}),
    ] {
        assert!(
            mutate(&bad, &target("shop", &ns, true), &cfg(SidecarMode::Legacy)).is_err(),
            "{bad}"
        );
    }
}

#[test]
fn legacy_job_pods_get_a_completion_warning() {
    let ns = enabled();
    let mut p = pod();
    p["spec"]["restartPolicy"] = json!("Never");
    let (_, _, warnings) = apply(&p, &target("shop", &ns, false), &cfg(SidecarMode::Auto));
    assert!(
        warnings.iter().any(|w| w.contains("restartPolicy Never")),
        "{warnings:?}"
    );
    let (_, _, warnings) = apply(&p, &target("shop", &ns, true), &cfg(SidecarMode::Auto));
    assert!(
        !warnings.iter().any(|w| w.contains("restartPolicy")),
        "Native is fine: {warnings:?}"
    );
}

fn proxy_env(out: &Value) -> BTreeMap<String, String> {
    out["spec"]["containers"][0]["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_string(),
                e["value"].as_str()?.to_string(),
            ))
        })
        .collect()
}

#[test]
fn traffic_defaults_to_the_first_app_port_on_15006() {
    let ns = enabled();
    let (out, _, warnings) = apply(
        &pod(),
        &target("shop", &ns, false),
        &cfg(SidecarMode::Legacy),
    );
    assert!(warnings.is_empty(), "{warnings:?}");
    let env = proxy_env(&out);
    assert_eq!(
        env.get("REMORA_INBOUND").map(String::as_str),
        Some("15006:8080")
    );
    assert!(!env.contains_key("REMORA_OUTBOUND"));
    let ports = &out["spec"]["containers"][0]["ports"];
    assert!(
        ports
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == "remora-inbound" && p["containerPort"] == 15006),
        "{ports}"
    );

    // No app port: no inbound listener.
    let mut bare = pod();
    bare["spec"]["containers"][0]
        .as_object_mut()
        .expect("container")
        .remove("ports");
    let (out, _, _) = apply(
        &bare,
        &target("shop", &ns, false),
        &cfg(SidecarMode::Legacy),
    );
    assert!(!proxy_env(&out).contains_key("REMORA_INBOUND"));
}

#[test]
fn traffic_annotations_are_validated_entry_by_entry() {
    let ns = enabled();
    let mut p = pod();
    p["metadata"]["annotations"] = json!({
        "remora.dev/inbound": "15006:8080, 15007:9090, nonsense",
        "remora.dev/outbound": "15001:api.internal:443,15002:noport"
    });
    let (out, _, warnings) = apply(&p, &target("shop", &ns, false), &cfg(SidecarMode::Legacy));
    let env = proxy_env(&out);
    assert_eq!(env["REMORA_INBOUND"], "15006:8080,15007:9090");
    assert_eq!(env["REMORA_OUTBOUND"], "15001:api.internal:443");
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings.iter().any(|w| w.contains("nonsense")));
    assert!(warnings.iter().any(|w| w.contains("15002:noport")));
    let names: Vec<&str> = out["spec"]["containers"][0]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert!(
        names.contains(&"remora-inbound") && names.contains(&"remora-in-1"),
        "{names:?}"
    );
}

/// The pod with these traffic annotations (`None`: absent).
fn with_traffic(inbound: Option<&str>, outbound: Option<&str>) -> Value {
    let mut p = pod();
    let mut ann = serde_json::Map::new();
    if let Some(i) = inbound {
        ann.insert("remora.dev/inbound".into(), json!(i));
    }
    if let Some(o) = outbound {
        ann.insert("remora.dev/outbound".into(), json!(o));
    }
    p["metadata"]["annotations"] = Value::Object(ann);
    p
}

#[test]
fn plumbing_onto_the_sidecars_own_ports_or_twice_is_refused() {
    let ns = enabled();
    let t = target("shop", &ns, true);
    let c = cfg(SidecarMode::Legacy);
    // (inbound, outbound, what the refusal must name)
    let refused: [(Option<&str>, Option<&str>, &[&str]); 12] = [
        // The case: Envoy's admin API published on 0.0.0.0:15006.
        (
            Some("15006:15000"),
            None,
            &[
                "remora.dev/inbound",
                "\"15006:15000\"",
                "target port 15000",
                "Envoy admin",
            ],
        ),
        (
            Some("15006:15020"),
            None,
            &["remora.dev/inbound", "target port 15020"],
        ),
        (
            Some("15006:15021"),
            None,
            &["remora.dev/inbound", "target port 15021"],
        ),
        (
            Some("15006:15090"),
            None,
            &["remora.dev/inbound", "target port 15090"],
        ),
        // Forwarding the inbound listener to itself.
        (
            Some("15006:15006"),
            None,
            &["remora.dev/inbound", "target port 15006"],
        ),
        (
            Some("15000:8080"),
            None,
            &[
                "remora.dev/inbound",
                "\"15000:8080\"",
                "listener port 15000",
            ],
        ),
        (
            None,
            Some("15021:api.internal:443"),
            &["remora.dev/outbound", "listener port 15021"],
        ),
        (
            None,
            Some("15001:127.0.0.1:15000"),
            &[
                "remora.dev/outbound",
                "\"15001:127.0.0.1:15000\"",
                "target port 15000",
            ],
        ),
        (
            None,
            Some("15001:localhost:15020"),
            &["remora.dev/outbound", "target port 15020"],
        ),
        // Duplicates: in one annotation, across both, and with the default inbound.
        (
            Some("8080,9090"),
            None,
            &[
                "remora.dev/inbound",
                "\"9090\"",
                "listener port 15006",
                "\"8080\"",
            ],
        ),
        (
            Some("15007:8080"),
            Some("15007:api.internal:443"),
            &[
                "remora.dev/outbound",
                "listener port 15007",
                "\"15007:8080\"",
            ],
        ),
        (
            None,
            Some("15006:api.internal:443"),
            &[
                "remora.dev/outbound",
                "listener port 15006",
                "\"15006:8080\"",
            ],
        ),
    ];
    for (inbound, outbound, names) in refused {
        let p = with_traffic(inbound, outbound);
        let err = match mutate(&p, &t, &c) {
            Err(MutateError::Refused(e)) => e.to_string(),
            other => panic!("{inbound:?} {outbound:?}: not refused: {other:?}"),
        };
        for n in names {
            assert!(
                err.contains(n),
                "{inbound:?} {outbound:?}: {err:?} does not name {n}"
            );
        }
    }
    // An inbound forwarding to an outbound listener of the pod loops too.
    let p = with_traffic(Some("15006:15001"), Some("15001:api.internal:443"));
    assert!(matches!(
        mutate(&p, &t, &c),
        Err(MutateError::Refused(PlumbingError::ReservedTarget {
            port: 15001,
            ..
        }))
    ));
    // An outbound (loopback) listener onto the health port, served on every
    // address anyway: allowed, an app may wait on its sidecar through it.
    let p = with_traffic(Some("15006:8080"), Some("15001:127.0.0.1:15021"));
    let (_, outcome, _) = apply(&p, &t, &c);
    assert_eq!(outcome, Outcome::Injected(SidecarMode::Legacy));
    // A remote upstream on such a port number is another pod's business.
    let p = with_traffic(Some("15006:8080"), Some("15001:api.internal:15000"));
    let (out, outcome, _) = apply(&p, &t, &c);
    assert_eq!(outcome, Outcome::Injected(SidecarMode::Legacy));
    assert_eq!(
        proxy_env(&out).get("REMORA_OUTBOUND").map(String::as_str),
        Some("15001:api.internal:15000")
    );
}

#[test]
fn the_default_inbound_never_targets_a_sidecar_port() {
    let ns = enabled();
    let mut p = pod();
    p["spec"]["containers"][0]["ports"] =
        json!([{"containerPort": 15000}, {"containerPort": 8080}]);
    let (out, _, warnings) = apply(&p, &target("shop", &ns, true), &cfg(SidecarMode::Legacy));
    assert_eq!(
        proxy_env(&out).get("REMORA_INBOUND").map(String::as_str),
        Some("15006:8080")
    );
    assert!(warnings.iter().any(|w| w.contains("15000")), "{warnings:?}");
}

#[test]
fn traffic_annotations_are_capped_at_max_listeners() {
    let ns = enabled();
    let t = target("shop", &ns, true);
    let c = cfg(SidecarMode::Legacy);
    let list = |n: usize, f: &dyn Fn(usize) -> String| (0..n).map(f).collect::<Vec<_>>().join(",");
    let inbound = |i: usize| format!("{}:{}", 20000 + i, 8000 + i);
    let outbound = |i: usize| format!("{}:api.internal:443", 30000 + i);
    let p = with_traffic(Some(&list(MAX_LISTENERS, &inbound)), None);
    assert!(mutate(&p, &t, &c).is_ok());
    for (i, o) in [
        (Some(list(MAX_LISTENERS + 1, &inbound)), None),
        (None, Some(list(MAX_LISTENERS + 1, &outbound))),
        // Empty items are not entries; the cap counts real ones only.
    ] {
        let p = with_traffic(i.as_deref(), o.as_deref());
        match mutate(&p, &t, &c) {
            Err(MutateError::Refused(e @ PlumbingError::TooMany { .. })) => {
                let msg = e.to_string();
                assert!(msg.contains(&format!("{}", MAX_LISTENERS + 1)), "{msg}");
                assert!(msg.contains(&format!("at most {MAX_LISTENERS}")), "{msg}");
            }
            other => panic!("not refused: {other:?}"),
        }
    }
    let p = with_traffic(
        Some(&format!("{},,,, ,", list(MAX_LISTENERS, &inbound))),
        None,
    );
    assert!(mutate(&p, &t, &c).is_ok());
}

/// Every string in a JSON value, with its path.
fn strings<'v>(v: &'v Value, path: String, out: &mut Vec<(String, &'v str)>) {
    match v {
        Value::String(s) => out.push((path, s)),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, x)| strings(x, format!("{path}/{i}"), out)),
        Value::Object(o) => o
            .iter()
            .for_each(|(k, x)| strings(x, format!("{path}/{k}"), out)),
        _ => {}
    }
}

#[test]
fn app_containers_exec_the_hook_helper_and_the_spec_holds_no_drain_secret() {
    let ns = enabled();
    let mut p = pod();
    p["spec"]["restartPolicy"] = json!("OnFailure");
    p["spec"]["containers"] = json!([
        {"name": "app", "image": "a", "lifecycle": {"postStart": {"exec": {"command": ["x"]}}},
         "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
        {"name": "worker", "image": "w"},
        {"name": "own", "image": "o", "lifecycle": {"preStop": {"sleep": {"seconds": 5}}}},
        {"name": "clash", "image": "c",
         "volumeMounts": [{"name": "mine", "mountPath": "/var/run/remora-hook/"}]},
    ]);
    p["spec"]["volumes"] =
        json!([{"name": "data", "emptyDir": {}}, {"name": "mine", "emptyDir": {}}]);
    let hook_dir = remora_contract::pod::HOOK_DIR;
    let hook_volume = remora_contract::pod::HOOK_VOLUME;
    for (mode, native) in [(SidecarMode::Legacy, false), (SidecarMode::Native, true)] {
        let (out, _, warnings) = apply(&p, &target("shop", &ns, native), &cfg(mode));
        let sidecar = if native {
            &out["spec"]["initContainers"][0]
        } else {
            &out["spec"]["containers"][0]
        };
        let app = |name: &str| {
            out["spec"]["containers"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["name"] == name))
                .cloned()
                .unwrap_or_default()
        };
        for name in ["app", "worker"] {
            let c = app(name);
            assert_eq!(
                c["lifecycle"]["preStop"],
                json!({"exec": {"command": [remora_contract::pod::HOOK_HELPER_PATH]}}),
                "{name}"
            );
            let mounts = c["volumeMounts"].as_array().cloned().unwrap_or_default();
            assert!(
                mounts.contains(
                    &json!({"name": hook_volume, "mountPath": hook_dir, "readOnly": true})
                ),
                "{name}: {mounts:?}"
            );
        }
        assert_eq!(
            app("app")["volumeMounts"][0]["name"],
            "data",
            "the app's mounts stay"
        );
        assert!(
            !app("app")["lifecycle"]["postStart"].is_null(),
            "the app's own hooks stay"
        );
        assert_eq!(
            app("own")["lifecycle"]["preStop"],
            json!({"sleep": {"seconds": 5}}),
            "an app's own preStop is kept"
        );
        assert!(app("own")["volumeMounts"].is_null(), "no hook, no mount");
        assert!(app("clash")["lifecycle"].is_null(), "{}", app("clash"));
        for (who, what) in [("own", "preStop"), ("clash", hook_dir)] {
            assert!(
                warnings.iter().any(|w| w.contains(who) && w.contains(what)),
                "{who}: {warnings:?}"
            );
        }
        // The sidecar fills the volume (read-write) and is told where it is.
        let env = |name: &str| {
            sidecar["env"]
                .as_array()
                .and_then(|e| e.iter().find(|v| v["name"] == name))
                .map(|v| v["value"].clone())
        };
        assert_eq!(env(remora_contract::env::HOOK_DIR), Some(json!(hook_dir)));
        assert_eq!(
            env(remora_contract::env::POD_RESTART_POLICY),
            Some(json!("OnFailure"))
        );
        assert!(
            sidecar["volumeMounts"]
                .as_array()
                .is_some_and(|m| m.contains(&json!({"name": hook_volume, "mountPath": hook_dir}))),
            "{sidecar}"
        );
        assert!(
            out["spec"]["volumes"]
                .as_array()
                .is_some_and(|v| v.contains(&json!({"name": hook_volume, "emptyDir": {}}))),
            "{}",
            out["spec"]["volumes"]
        );
        // Nothing that could drain the pod is readable from the spec: no
        // token header, no token variable, no HTTP hook, no long random value.
        let mut all = Vec::new();
        strings(&out, String::new(), &mut all);
        for (path, value) in &all {
            let lower = value.to_ascii_lowercase();
            assert!(
                !lower.contains("drain-token") && !lower.contains("drain_token"),
                "{path}: {value}"
            );
            let hex_run = value
                .split(|c: char| !c.is_ascii_hexdigit())
                .map(str::len)
                .max()
                .unwrap_or(0);
            assert!(hex_run < 32, "a secret-like value at {path}: {value}");
        }
        for c in out["spec"]["containers"].as_array().into_iter().flatten() {
            assert!(c["lifecycle"]["preStop"]["httpGet"].is_null(), "{c}");
        }
    }
    // Injecting twice gives the same pod: nothing random is in it.
    let once = apply(&p, &target("shop", &ns, true), &cfg(SidecarMode::Native)).0;
    let twice = apply(&p, &target("shop", &ns, true), &cfg(SidecarMode::Native)).0;
    assert_eq!(once, twice);
}

#[test]
fn the_sidecar_learns_whether_the_pod_can_complete() {
    let ns = enabled();
    for (policy, want) in [
        (None, "Always"),
        (Some("Always"), "Always"),
        (Some("Never"), "Never"),
        (Some("OnFailure"), "OnFailure"),
        (Some("Sometimes"), "Always"),
    ] {
        let mut p = pod();
        if let Some(policy) = policy {
            p["spec"]["restartPolicy"] = json!(policy);
        }
        let (out, _, _) = apply(&p, &target("shop", &ns, false), &cfg(SidecarMode::Legacy));
        let got = out["spec"]["containers"][0]["env"]
            .as_array()
            .and_then(|e| {
                e.iter()
                    .find(|v| v["name"] == remora_contract::env::POD_RESTART_POLICY)
            })
            .map(|v| v["value"].clone());
        assert_eq!(got, Some(json!(want)), "{policy:?}");
    }
}
