//! The workload CA and static-mode mTLS in the injected pod: the CA's
//! address, token and trust bundle when the chart enables it (and the pod
//! does not opt out), the `remora.dev/inbound-tls`/`outbound-tls`
//! annotations, refusals, idempotency, and offline injection.

use std::collections::BTreeMap;
use std::time::Duration;

use remora_contract::lifecycle::SidecarStatus;
use remora_contract::workload_ca as ca;
use remora_crds::SidecarMode;
use remora_injector::mutate::{
    MutateError, Outcome, PlumbingError, STATUS_ANNOTATION, Selection, SkipReason, Target, mutate,
};
use remora_injector::offline::{OfflineOptions, inject_stream};
use remora_injector::sidecar_config::{ChartDefaults, WorkloadCaWiring, resolve};
use serde_json::{Value, json};

fn wiring() -> WorkloadCaWiring {
    WorkloadCaWiring {
        address: "remora-injector.remora-system.svc:15012".into(),
        server_name: None,
        trust_domain: "mesh.example".into(),
        cert_ttl: Duration::from_secs(12 * 3600),
    }
}

fn chart(with_ca: bool) -> ChartDefaults {
    ChartDefaults {
        workload_ca: with_ca.then(wiring),
        ..ChartDefaults::default()
    }
}

fn pod(annotations: &[(&str, &str)]) -> Value {
    let ann: serde_json::Map<String, Value> = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web", "annotations": ann},
        "spec": {
            "automountServiceAccountToken": false,
            "containers": [{"name": "app", "image": "a", "ports": [{"containerPort": 8080}]}]
        }
    })
}

/// The webhook's path: resolve the pod's config from the chart, then mutate.
fn mutate_with(p: &Value, with_ca: bool) -> Result<(Value, Vec<String>), MutateError> {
    mutate_chart(p, &chart(with_ca))
}

fn mutate_chart(p: &Value, chart: &ChartDefaults) -> Result<(Value, Vec<String>), MutateError> {
    let ns = BTreeMap::from([("remora.dev/inject".to_string(), "enabled".to_string())]);
    let t = Target {
        namespace: "shop",
        namespace_labels: &ns,
        native_sidecars: false,
        selection: Selection::Webhook,
    };
    let (labels, annotations) = remora_injector::mutate::pod_meta(p);
    let cfg = resolve(chart, &[], "remora-system", "shop", &labels, &annotations);
    let m = mutate(p, &t, &cfg)?;
    assert_eq!(m.outcome, Outcome::Injected(SidecarMode::Legacy));
    let mut out = p.clone();
    json_patch::patch(&mut out, &m.patch).expect("the patch applies");
    // Injecting the result again changes nothing.
    let again = mutate(&out, &t, &cfg).expect("second mutate");
    assert_eq!(again.outcome, Outcome::Skipped(SkipReason::AlreadyInjected));
    assert!(again.patch.0.is_empty());
    Ok((out, m.warnings))
}

fn injected(p: &Value, with_ca: bool) -> (Value, Vec<String>) {
    mutate_with(p, with_ca).expect("injected")
}

fn refusal(p: &Value, with_ca: bool) -> PlumbingError {
    match mutate_with(p, with_ca) {
        Err(MutateError::Refused(e)) => e,
        other => panic!("not refused: {other:?}"),
    }
}

fn env(out: &Value) -> BTreeMap<String, Value> {
    out["spec"]["containers"][0]["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap_or_default().to_string(),
                e.get("value")
                    .cloned()
                    .unwrap_or_else(|| e["valueFrom"].clone()),
            )
        })
        .collect()
}

fn volumes(out: &Value) -> BTreeMap<String, Value> {
    out["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap_or_default().to_string(),
                v.clone(),
            )
        })
        .collect()
}

fn mounts(out: &Value) -> BTreeMap<String, Value> {
    out["spec"]["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap_or_default().to_string(),
                m.clone(),
            )
        })
        .collect()
}

fn status(out: &Value) -> SidecarStatus {
    serde_json::from_str(
        out["metadata"]["annotations"][STATUS_ANNOTATION]
            .as_str()
            .expect("status"),
    )
    .expect("status JSON")
}

const CA_ENV: [&str; 5] = [
    "REMORA_CA_ADDRESS",
    "REMORA_CA_ROOT_CERT",
    "REMORA_TOKEN_PATH",
    "REMORA_TRUST_DOMAIN",
    "REMORA_CERT_TTL",
];

#[test]
fn the_ca_is_wired_when_enabled() {
    let (out, warnings) = injected(&pod(&[]), true);
    assert!(warnings.is_empty(), "{warnings:?}");
    let e = env(&out);
    assert_eq!(
        e["REMORA_CA_ADDRESS"],
        "remora-injector.remora-system.svc:15012"
    );
    assert_eq!(e["REMORA_CA_ROOT_CERT"], ca::TRUST_BUNDLE_PATH);
    assert_eq!(e["REMORA_TOKEN_PATH"], ca::TOKEN_PATH);
    assert_eq!(e["REMORA_TRUST_DOMAIN"], "mesh.example");
    assert_eq!(e["REMORA_CERT_TTL"], "12h");
    // The agent reads the TTL in the contract's grammar.
    assert_eq!(
        remora_contract::duration::parse("12h"),
        Ok(Duration::from_secs(12 * 3600))
    );
    // Its identity comes from the pod's service account and namespace.
    assert_eq!(
        e["SERVICE_ACCOUNT"]["fieldRef"]["fieldPath"],
        "spec.serviceAccountName"
    );
    assert_eq!(
        e["POD_NAMESPACE"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );

    let v = volumes(&out);
    assert_eq!(
        v[ca::TOKEN_VOLUME]["projected"]["sources"],
        json!([{"serviceAccountToken": {
            "audience": "remora-ca",
            "expirationSeconds": 3600,
            "path": "remora-token",
        }}])
    );
    assert_eq!(
        v[ca::TRUST_BUNDLE_VOLUME]["configMap"],
        json!({"name": "remora-ca-root-cert", "items": [{"key": "root-cert.pem", "path": "root-cert.pem"}]})
    );
    let m = mounts(&out);
    assert_eq!(m[ca::TOKEN_VOLUME]["mountPath"], ca::TOKEN_DIR);
    assert_eq!(
        m[ca::TRUST_BUNDLE_VOLUME]["mountPath"],
        ca::TRUST_BUNDLE_DIR
    );
    assert_eq!(m[ca::TOKEN_VOLUME]["readOnly"], true);
    assert_eq!(m[ca::TRUST_BUNDLE_VOLUME]["readOnly"], true);
    // Only the sidecar sees the token.
    assert!(out["spec"]["containers"][1]["volumeMounts"].is_null());

    let s = status(&out);
    assert!(s.volumes.iter().any(|n| n == ca::TOKEN_VOLUME), "{s:?}");
    assert!(
        s.volumes.iter().any(|n| n == ca::TRUST_BUNDLE_VOLUME),
        "{s:?}"
    );
}

#[test]
fn a_ca_dialled_by_its_cluster_ip_is_checked_under_its_name() {
    let mut c = chart(true);
    let w = c.workload_ca.as_mut().expect("wiring");
    w.address = "10.96.0.9:15012".into();
    w.server_name = Some("remora-injector.remora-system.svc".into());
    let (out, _) = mutate_chart(&pod(&[]), &c).expect("injected");
    let e = env(&out);
    assert_eq!(e["REMORA_CA_ADDRESS"], "10.96.0.9:15012");
    assert_eq!(
        e["REMORA_CA_SERVER_NAME"],
        "remora-injector.remora-system.svc"
    );
    let (out, _) = injected(&pod(&[]), true);
    assert!(!env(&out).contains_key("REMORA_CA_SERVER_NAME"));
}

#[test]
fn no_ca_when_disabled_or_opted_out() {
    let disabled = injected(&pod(&[]), false).0;
    let opted_out = injected(&pod(&[("remora.dev/workload-ca", "false")]), true).0;
    for (what, out) in [("disabled", &disabled), ("opted out", &opted_out)] {
        let e = env(out);
        for name in CA_ENV {
            assert!(!e.contains_key(name), "{what}: {name} set");
        }
        let v = volumes(out);
        assert!(!v.contains_key(ca::TOKEN_VOLUME), "{what}");
        assert!(!v.contains_key(ca::TRUST_BUNDLE_VOLUME), "{what}");
        assert!(!mounts(out).contains_key(ca::TOKEN_VOLUME), "{what}");
        assert_eq!(
            status(out).volumes,
            ["remora-run", "remora-podinfo"],
            "{what}"
        );
    }
    // Explicitly "true" is the default.
    let on = injected(&pod(&[("remora.dev/workload-ca", "true")]), true).0;
    assert!(env(&on).contains_key("REMORA_CA_ADDRESS"));
}

#[test]
fn the_restart_hash_follows_the_wiring() {
    let hash =
        |with_ca: bool, ann: &[(&str, &str)]| status(&injected(&pod(ann), with_ca).0).restart_hash;
    let off = hash(false, &[]);
    assert_ne!(hash(true, &[]), off, "enabling the CA needs a restart");
    assert_eq!(
        hash(true, &[("remora.dev/workload-ca", "false")]),
        off,
        "an opted-out pod is not restarted for it"
    );
}

#[test]
fn a_bad_workload_ca_value_is_refused() {
    let e = refusal(&pod(&[("remora.dev/workload-ca", "nope")]), true);
    let msg = e.to_string();
    assert!(msg.contains("remora.dev/workload-ca"), "{msg}");
    assert!(msg.contains("nope"), "{msg}");
    // Refused whether or not the CA is on: the pod asks something unreadable.
    assert!(matches!(
        mutate_with(&pod(&[("remora.dev/workload-ca", "nope")]), false),
        Err(MutateError::Refused(PlumbingError::BadValue { .. }))
    ));
}

#[test]
fn a_pod_volume_named_like_ours_skips_injection() {
    let mut p = pod(&[]);
    p["spec"]["volumes"] = json!([{"name": ca::TOKEN_VOLUME, "emptyDir": {}}]);
    let ns = BTreeMap::from([("remora.dev/inject".to_string(), "enabled".to_string())]);
    let t = Target {
        namespace: "shop",
        namespace_labels: &ns,
        native_sidecars: true,
        selection: Selection::Webhook,
    };
    let cfg = resolve(
        &chart(true),
        &[],
        "remora-system",
        "shop",
        &BTreeMap::new(),
        &BTreeMap::new(),
    );
    let m = mutate(&p, &t, &cfg).expect("mutate");
    assert_eq!(m.outcome, Outcome::Skipped(SkipReason::NameConflict));
    assert!(
        m.warnings.iter().any(|w| w.contains(ca::TOKEN_VOLUME)),
        "{:?}",
        m.warnings
    );
    // Without the CA that volume is the pod's business.
    let cfg = resolve(
        &chart(false),
        &[],
        "remora-system",
        "shop",
        &BTreeMap::new(),
        &BTreeMap::new(),
    );
    assert!(matches!(
        mutate(&p, &t, &cfg).map(|m| m.outcome),
        Ok(Outcome::Injected(_))
    ));
}

#[test]
fn inbound_tls_values() {
    let alice = "spiffe://mesh.example/ns/shop/sa/alice";
    let bob = "spiffe://mesh.example/ns/shop/sa/bob";
    let list = format!("{alice}, {bob}");
    let cases: [(&str, Option<&str>, Option<String>); 5] = [
        ("true", Some("true"), None),
        ("false", None, None),
        (alice, Some("true"), Some(alice.to_string())),
        (&list, Some("true"), Some(format!("{alice},{bob}"))),
        ("", None, None),
    ];
    for (value, tls, san) in cases {
        let (out, warnings) = injected(&pod(&[("remora.dev/inbound-tls", value)]), true);
        assert!(warnings.is_empty(), "{value}: {warnings:?}");
        let e = env(&out);
        assert_eq!(
            e.get("REMORA_INBOUND_TLS").and_then(Value::as_str),
            tls,
            "{value}"
        );
        assert_eq!(
            e.get("REMORA_INBOUND_TLS_SAN")
                .and_then(Value::as_str)
                .map(str::to_string),
            san,
            "{value}"
        );
    }
    for bad in [
        "maybe",
        "spiffe://",
        "cluster.local/ns/shop/sa/alice",
        "spiffe://mesh.example/ns/shop/sa/alice,maybe",
    ] {
        let msg = refusal(&pod(&[("remora.dev/inbound-tls", bad)]), true).to_string();
        assert!(msg.contains("remora.dev/inbound-tls"), "{bad}: {msg}");
    }
    // Without the CA it is injected, with a warning: certificates may be mounted.
    let (out, warnings) = injected(&pod(&[("remora.dev/inbound-tls", "true")]), false);
    assert_eq!(env(&out)["REMORA_INBOUND_TLS"], "true");
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("remora.dev/inbound-tls") && w.contains("workload CA")),
        "{warnings:?}"
    );
}

#[test]
fn outbound_tls_values() {
    let api = "spiffe://mesh.example/ns/shop/sa/api";
    let db = "spiffe://mesh.example/ns/data/sa/db";
    let outbound = (
        "remora.dev/outbound",
        "15001:api.shop:443,15002:db.data:5432",
    );
    let good = format!("15001={api},15002={db}");
    let (out, warnings) = injected(&pod(&[outbound, ("remora.dev/outbound-tls", &good)]), true);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(env(&out)["REMORA_OUTBOUND_TLS"], good.as_str());
    // Spaces around entries are dropped, as for the listener annotations.
    let spaced = format!(" 15001={api} ,");
    let (out, _) = injected(
        &pod(&[outbound, ("remora.dev/outbound-tls", &spaced)]),
        true,
    );
    assert_eq!(
        env(&out)["REMORA_OUTBOUND_TLS"],
        format!("15001={api}").as_str()
    );
    // Absent: nothing.
    let (out, _) = injected(&pod(&[outbound]), true);
    assert!(!env(&out).contains_key("REMORA_OUTBOUND_TLS"));

    let refused: [(String, &[&str]); 6] = [
        // Not an outbound listener of the pod.
        (format!("15003={api}"), &["15003", "not a listener"]),
        // The same port twice.
        (
            format!("15001={api},15001={db}"),
            &["15001", "already given"],
        ),
        (format!("15001:{api}"), &["PORT=SPIFFE_ID"]),
        ("15001=https://api.shop".into(), &["spiffe://"]),
        (format!("x={api}"), &["not a port"]),
        ("true".into(), &["PORT=SPIFFE_ID"]),
    ];
    for (value, names) in refused {
        let msg = refusal(&pod(&[outbound, ("remora.dev/outbound-tls", &value)]), true).to_string();
        assert!(msg.contains("remora.dev/outbound-tls"), "{value}: {msg}");
        for n in names {
            assert!(msg.contains(n), "{value}: {msg:?} does not name {n}");
        }
    }
    // No remora.dev/outbound at all: every port is unknown.
    let msg = refusal(&pod(&[("remora.dev/outbound-tls", &good)]), true).to_string();
    assert!(msg.contains("not a listener"), "{msg}");
}

#[test]
fn native_mode_gets_the_same_wiring() {
    let ns = BTreeMap::from([("remora.dev/inject".to_string(), "enabled".to_string())]);
    let t = Target {
        namespace: "shop",
        namespace_labels: &ns,
        native_sidecars: true,
        selection: Selection::Webhook,
    };
    let p = pod(&[]);
    let cfg = resolve(
        &chart(true),
        &[],
        "remora-system",
        "shop",
        &BTreeMap::new(),
        &BTreeMap::new(),
    );
    let m = mutate(&p, &t, &cfg).expect("mutate");
    assert_eq!(m.outcome, Outcome::Injected(SidecarMode::Native));
    let mut out = p.clone();
    json_patch::patch(&mut out, &m.patch).expect("applies");
    let sidecar = &out["spec"]["initContainers"][0];
    assert!(
        sidecar["env"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["name"] == "REMORA_CA_ADDRESS")
    );
    assert!(volumes(&out).contains_key(ca::TOKEN_VOLUME));
}

#[test]
fn offline_injection_wires_the_ca_and_is_idempotent() -> anyhow::Result<()> {
    let input = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web, namespace: shop}\nspec:\n  selector: {matchLabels: {app: web}}\n  template:\n    metadata:\n      labels: {app: web}\n      annotations: {remora.dev/inbound-tls: \"true\"}\n    spec:\n      containers: [{name: app, image: a, ports: [{containerPort: 8080}]}]\n---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: solo\n  annotations: {remora.dev/workload-ca: \"false\"}\nspec:\n  containers: [{name: app, image: a}]\n";
    let opts = OfflineOptions {
        chart: chart(true),
        mode: Some(SidecarMode::Native),
        ..OfflineOptions::default()
    };
    let (once, report) = inject_stream(input, &opts)?;
    assert_eq!(report.injected, 2);
    let docs: Vec<Value> = remora_injector::offline::split_documents(&once)
        .into_iter()
        .map(serde_saphyr::from_str)
        .collect::<Result<_, _>>()?;
    let deployment = &docs[0]["spec"]["template"];
    let sidecar = &deployment["spec"]["initContainers"][0];
    let env_of = |c: &Value, n: &str| {
        c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == n)
            .map(|e| e["value"].clone())
    };
    assert_eq!(
        env_of(sidecar, "REMORA_CA_ADDRESS"),
        Some(json!("remora-injector.remora-system.svc:15012"))
    );
    assert_eq!(env_of(sidecar, "REMORA_INBOUND_TLS"), Some(json!("true")));
    assert!(
        deployment["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|v| v["name"] == ca::TOKEN_VOLUME)
    );
    let solo = &docs[1]["spec"]["initContainers"][0];
    assert_eq!(env_of(solo, "REMORA_CA_ADDRESS"), None, "opted out");

    let (twice, report) = inject_stream(&once, &opts)?;
    assert_eq!(report.injected, 0);
    assert_eq!(once, twice);

    // A bad annotation fails the run, naming the workload and the annotation.
    let bad = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  annotations: {remora.dev/outbound-tls: \"15001=spiffe://td/x\"}\nspec:\n  containers: [{name: c, image: i}]\n";
    let err = inject_stream(bad, &opts).expect_err("refused").to_string();
    assert!(
        err.contains("Pod/p") && err.contains("remora.dev/outbound-tls"),
        "{err}"
    );
    // Without the CA in the options (the CLI default), nothing of it appears.
    let (plain, _) = inject_stream(input, &OfflineOptions::default())?;
    assert!(!plain.contains("REMORA_CA_ADDRESS"));
    Ok(())
}
