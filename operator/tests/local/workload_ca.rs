//! The workload CA and static-mode mTLS in the injected pod: the CA's
//! address, token and trust bundle when the chart enables it (and the pod
//! does not opt out), the `remora.dev/inbound-tls`/`outbound-tls`
//! annotations, refusals, idempotency, and offline injection.

use std::collections::BTreeMap;
use std::time::Duration;

use remora_contract::lifecycle::SidecarStatus;
use remora_contract::workload_ca as ca;
use remora_crds::SidecarMode;
use remora_inject::offline::{OfflineOptions, inject_stream};
use remora_inject::patch::{
    MutateError, Outcome, STATUS_ANNOTATION, Selection, SkipReason, Target, mutate,
};
use remora_inject::resolve::{ChartDefaults, WorkloadCaWiring, resolve};
use remora_inject::traffic::PlumbingError;
use serde_json::{Value, json};

fn wiring() -> WorkloadCaWiring {
    WorkloadCaWiring {
        address: "remora-operator.remora-system.svc:15012".into(),
        server_name: None,
        trust_domain: "mesh.example".into(),
        cert_ttl: Duration::from_secs(12 * 3600),
        discovery: None,
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
    let (labels, annotations) = remora_inject::patch::pod_meta(p);
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
        "remora-operator.remora-system.svc:15012"
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
    // Only the sidecar sees the token and the bundle (the app mounts the hook volume alone).
    let app_mounts: Vec<&str> = out["spec"]["containers"][1]["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["name"].as_str())
        .collect();
    assert_eq!(app_mounts, ["remora-hook"]);

    let s = status(&out);
    assert!(s.volumes.iter().any(|n| n == ca::TOKEN_VOLUME), "{s:?}");
    assert!(
        s.volumes.iter().any(|n| n == ca::TRUST_BUNDLE_VOLUME),
        "{s:?}"
    );
    // Its inbound listener (15006 in front of the app's 8080) accepts the
    // mesh's mTLS: clients' sidecars may originate it to that port.
    assert_eq!(s.mtls_ports, [15006], "{s:?}");
    let two = injected(
        &pod(&[("remora.dev/inbound", "15006:8080,15007:9090")]),
        true,
    )
    .0;
    assert_eq!(status(&two).mtls_ports, [15006, 15007]);
}

#[test]
fn a_ca_dialled_by_its_cluster_ip_is_checked_under_its_name() {
    let mut c = chart(true);
    let w = c.workload_ca.as_mut().expect("wiring");
    w.address = "10.96.0.9:15012".into();
    w.server_name = Some("remora-operator.remora-system.svc".into());
    let (out, _) = mutate_chart(&pod(&[]), &c).expect("injected");
    let e = env(&out);
    assert_eq!(e["REMORA_CA_ADDRESS"], "10.96.0.9:15012");
    assert_eq!(
        e["REMORA_CA_SERVER_NAME"],
        "remora-operator.remora-system.svc"
    );
    let (out, _) = injected(&pod(&[]), true);
    assert!(!env(&out).contains_key("REMORA_CA_SERVER_NAME"));
}

/// With discovery on, the sidecar dials the discovery server where it dials
/// the CA, checks it under the same name, and proves itself with a token of
/// the discovery audience, projected next to the CA's (one volume).
#[test]
fn the_discovery_server_is_wired_when_on() {
    let mut c = chart(true);
    let w = c.workload_ca.as_mut().expect("wiring");
    w.address = "10.96.0.9:15012".into();
    w.server_name = Some("remora-operator.remora-system.svc".into());
    w.discovery = Some("10.96.0.9:15010".into());
    let (out, warnings) = mutate_chart(&pod(&[]), &c).expect("injected");
    assert!(warnings.is_empty(), "{warnings:?}");
    let e = env(&out);
    assert_eq!(e["REMORA_DISCOVERY_ADDRESS"], "10.96.0.9:15010");
    assert_eq!(
        e["REMORA_DISCOVERY_SERVER_NAME"],
        "remora-operator.remora-system.svc"
    );
    assert_eq!(
        e["REMORA_DISCOVERY_TOKEN_PATH"],
        remora_contract::discovery::TOKEN_PATH
    );
    assert_eq!(
        volumes(&out)[ca::TOKEN_VOLUME]["projected"]["sources"],
        json!([
            {"serviceAccountToken": {"audience": "remora-ca", "expirationSeconds": 3600, "path": "remora-token"}},
            {"serviceAccountToken": {"audience": "remora-discovery", "expirationSeconds": 3600, "path": "remora-discovery-token"}},
        ])
    );
    let hash =
        |c: &ChartDefaults| status(&mutate_chart(&pod(&[]), c).expect("injected").0).restart_hash;
    let on = hash(&c);

    // The static outbound pin has no place beside discovery (whose clusters
    // carry the mesh's mTLS): dropped with a warning, so the sidecar, which
    // refuses both together, still starts.
    let api = "spiffe://mesh.example/ns/shop/sa/api";
    let pinned = format!("15001={api}");
    let asked = pod(&[
        ("remora.dev/outbound", "15001:api.shop:443"),
        ("remora.dev/outbound-tls", &pinned),
    ]);
    let (out, warnings) = mutate_chart(&asked, &c).expect("injected");
    assert!(!env(&out).contains_key("REMORA_OUTBOUND_TLS"));
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("remora.dev/outbound-tls is ignored with discovery")),
        "{warnings:?}"
    );

    c.workload_ca.as_mut().expect("wiring").discovery = None;
    assert_ne!(hash(&c), on, "turning discovery on needs a restart");

    // Off: none of it, and the CA's token alone.
    let (out, _) = injected(&pod(&[]), true);
    let e = env(&out);
    for name in [
        "REMORA_DISCOVERY_ADDRESS",
        "REMORA_DISCOVERY_SERVER_NAME",
        "REMORA_DISCOVERY_TOKEN_PATH",
    ] {
        assert!(!e.contains_key(name), "{name} set with discovery off");
    }
    assert_eq!(
        volumes(&out)[ca::TOKEN_VOLUME]["projected"]["sources"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
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
            ["remora-run", "remora-podinfo", "remora-hook"],
            "{what}"
        );
        // No certificate, no mTLS: clients reach it in plain text.
        assert!(status(out).mtls_ports.is_empty(), "{what}");
        let raw = out["metadata"]["annotations"]["remora.dev/status"]
            .as_str()
            .expect("status");
        assert!(!raw.contains("mtlsPorts"), "{what}: {raw}");
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
    let docs: Vec<Value> = remora_inject::offline::split_documents(&once)
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
        Some(json!("remora-operator.remora-system.svc:15012"))
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

// The CA's server under attack, in process over real TLS on loopback: one
// source (127.0.0.1) attacks, a sidecar (127.0.0.2) asks for its
// certificate. TokenReviews go to a counting test double.
mod attacks {
    use std::net::{IpAddr, SocketAddr};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use futures::StreamExt;
    use remora_operator::pki::workload_ca::authn::{
        AuthError, Authenticate, Caller, Gate, GateLimits,
    };
    use remora_operator::pki::workload_ca::serve::{Limits, serve};
    use remora_operator::pki::workload_ca::service::{CaService, Lifetimes};
    use remora_operator::pki::workload_ca::{Metrics, testing};
    use remora_proto::istio::v1::auth::IstioCertificateRequest;
    use remora_proto::istio::v1::auth::istio_certificate_service_client::IstioCertificateServiceClient;
    use remora_test_support::h2_client::{self, H2};
    use remora_test_support::jwt;
    use remora_test_support::wait::wait_until;
    use tokio::time::Instant;
    use tokio_util::sync::CancellationToken;

    const AUD: &str = remora_contract::workload_ca::TOKEN_AUDIENCE;
    const SERVER_NAME: &str = "ca.test";
    const ME: &str = "spiffe://cluster.local/ns/web/sa/default";
    /// A fixed `exp` (in 2096), so a nonce names one token.
    const EXP: u64 = 4_000_000_000;
    const GOOD: u64 = 1;
    /// Reviewed slowly: a request in flight for a while.
    const SLOW: u64 = 2;

    fn attacker() -> IpAddr {
        "127.0.0.1".parse().expect("ip")
    }
    fn sidecar() -> IpAddr {
        "127.0.0.2".parse().expect("ip")
    }

    /// Test double of the API server's TokenReview: counts the reviews;
    /// accepts the tokens of nonces GOOD and SLOW (after a second) as
    /// web/default's, refuses any other.
    #[derive(Clone, Default)]
    struct CountingReviewer(Arc<AtomicUsize>);

    impl Authenticate for CountingReviewer {
        async fn authenticate(&self, token: &str) -> Result<Caller, AuthError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            if token == jwt::service_account(AUD, EXP, SLOW) {
                tokio::time::sleep(Duration::from_secs(1)).await;
            } else if token != jwt::service_account(AUD, EXP, GOOD) {
                return Err(AuthError::Rejected("invalid bearer token".into()));
            }
            Ok(Caller {
                namespace: "web".into(),
                service_account: "default".into(),
                pod: None,
            })
        }
    }

    struct Ca {
        addr: SocketAddr,
        bundle: String,
        reviews: Arc<AtomicUsize>,
        metrics: Metrics,
        stop: CancellationToken,
        served: tokio::task::JoinHandle<()>,
    }

    impl Ca {
        async fn start(limits: Limits, gate: GateLimits) -> Self {
            let authority = testing::authority(&[SERVER_NAME]).expect("authority");
            let bundle = authority.bundle.clone();
            let (tx, rx) = tokio::sync::watch::channel(Some(Arc::new(authority)));
            let reviewer = CountingReviewer::default();
            let reviews = Arc::clone(&reviewer.0);
            let metrics = Metrics::default();
            let svc = CaService {
                auth: reviewer,
                gate: Gate::new(AUD, gate),
                authority: rx,
                trust_domain: "cluster.local".into(),
                lifetimes: Lifetimes {
                    default: Duration::from_secs(600),
                    max: Duration::from_secs(600),
                },
                metrics: metrics.clone(),
                events: None,
            };
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("addr");
            let stop = CancellationToken::new();
            let token = stop.clone();
            let served = tokio::spawn(async move {
                let _tx = tx;
                serve(listener, svc, limits, token).await.expect("served");
            });
            Self {
                addr,
                bundle,
                reviews,
                metrics,
                stop,
                served,
            }
        }

        async fn connect(&self, from: IpAddr) -> Result<H2<tonic::body::Body>, String> {
            h2_client::connect(from, self.addr, SERVER_NAME, &self.bundle)
                .await
                .map_err(|e| e.to_string())
        }

        async fn stop(self) {
            self.stop.cancel();
            tokio::time::timeout(Duration::from_secs(30), self.served)
                .await
                .expect("the server stops, its connections closed")
                .expect("server task");
        }
    }

    type Client = IstioCertificateServiceClient<h2_client::Channel>;

    /// A gRPC client on one HTTP/2 connection.
    fn client(h2: &H2<tonic::body::Body>) -> Client {
        IstioCertificateServiceClient::with_origin(
            h2_client::channel(h2),
            format!("https://{SERVER_NAME}").parse().expect("origin"),
        )
    }

    async fn ask(c: &mut Client, token: &str, csr: &str) -> Result<Vec<String>, tonic::Status> {
        let mut req = tonic::Request::new(IstioCertificateRequest {
            csr: csr.to_string(),
            validity_duration: 600,
            metadata: None,
        });
        let v = format!("Bearer {token}").parse().expect("header value");
        req.metadata_mut().insert("authorization", v);
        c.create_certificate(req)
            .await
            .map(|r| r.into_inner().cert_chain)
    }

    fn csr() -> String {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut p = rcgen::CertificateParams::default();
        p.subject_alt_names = vec![rcgen::SanType::URI(ME.try_into().expect("uri"))];
        p.serialize_request(&key).expect("csr").pem().expect("pem")
    }

    /// What a starting sidecar does: connect, get its first certificate,
    /// then renew on the same connection. Returns both latencies.
    async fn first_and_renewal(ca: &Ca, csr: &str) -> (Duration, Duration) {
        let token = jwt::service_account(AUD, EXP, GOOD);
        let t = Instant::now();
        let h2 = tokio::time::timeout(Duration::from_secs(10), ca.connect(sidecar()))
            .await
            .expect("the sidecar connects within 10 s")
            .expect("the sidecar connects");
        let mut c = client(&h2);
        let chain = ask(&mut c, &token, csr).await.expect("first certificate");
        assert_eq!(chain.len(), 2);
        let first = t.elapsed();
        let t = Instant::now();
        ask(&mut c, &token, csr).await.expect("renewal");
        (first, t.elapsed())
    }

    fn median(mut v: Vec<Duration>) -> Duration {
        v.sort();
        v[v.len() / 2]
    }

    /// Enough open files for `n` connections, both ends in this process.
    fn files_for(n: u64) {
        use rustix::process::{Resource, getrlimit, setrlimit};
        let lim = getrlimit(Resource::Nofile);
        let want = 2 * n + 1024;
        if lim.current.is_some_and(|c| c < want) {
            assert!(
                lim.maximum.is_none_or(|m| m >= want),
                "this test needs {want} open files; the hard limit is {:?}",
                lim.maximum
            );
            setrlimit(
                Resource::Nofile,
                rustix::process::Rlimit {
                    current: Some(want),
                    maximum: lim.maximum,
                },
            )
            .expect("raise RLIMIT_NOFILE");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_source_holding_4096_connections_does_not_starve_the_ca() {
        const FLOOD: usize = 4096;
        files_for(FLOOD as u64);
        let limits = Limits::default();
        assert!(limits.per_source < FLOOD && FLOOD <= limits.connections);
        let ca = Ca::start(limits, GateLimits::default()).await;
        let csr = csr();

        let mut quiet = Vec::new();
        for _ in 0..5 {
            quiet.push(first_and_renewal(&ca, &csr).await);
            ca.reviews.store(0, Ordering::SeqCst);
        }

        // The attack: 4,096 connections (TLS and HTTP/2 done, then idle),
        // 64 being opened at a time, from one address.
        let opened: Vec<_> = futures::stream::iter(0..FLOOD)
            .map(|_| ca.connect(attacker()))
            .buffer_unordered(64)
            .collect()
            .await;
        let held: Vec<H2<tonic::body::Body>> = opened.into_iter().filter_map(Result::ok).collect();
        // Those over the cap were closed before their handshake; wait
        // until the rest are seen closed, then count the open ones.
        let open = || held.iter().filter(|h| !h.conn.is_finished()).count();
        wait_until(
            Duration::from_secs(10),
            "the flood's extra connections closed",
            || {
                let n = open();
                async move { (n <= limits.per_source).then_some(()) }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}: {} of {FLOOD} still open", open()));

        let mut flooded = Vec::new();
        for _ in 0..5 {
            flooded.push(first_and_renewal(&ca, &csr).await);
        }
        let still_open = open();
        assert!(
            still_open <= limits.per_source,
            "{still_open} flood connections open"
        );
        assert_eq!(
            ca.metrics.connections_refused_total("per_source"),
            (FLOOD - held.len()) as u64,
            "every connection over the cap counted"
        );
        let (q1, q2): (Vec<_>, Vec<_>) = quiet.into_iter().unzip();
        let (f1, f2): (Vec<_>, Vec<_>) = flooded.into_iter().unzip();
        println!(
            "workload CA, one source holding {FLOOD} connections ({} handshaken, {still_open} kept): \
             first certificate median {:?} quiet vs {:?} flooded; renewal median {:?} quiet vs {:?} flooded",
            held.len(),
            median(q1),
            median(f1),
            median(q2),
            median(f2),
        );
        drop(held);
        ca.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_source_silent_in_4096_handshakes_does_not_starve_the_ca() {
        const SILENT: usize = 4096;
        files_for(SILENT as u64);
        let limits = Limits::default();
        let ca = Ca::start(limits, GateLimits::default()).await;
        let csr = csr();
        // The attack: TCP connections that never send a ClientHello, each
        // worth a place for the handshake deadline (5 s) where a place is
        // taken before the handshake.
        let mut silent = Vec::with_capacity(SILENT);
        for _ in 0..SILENT {
            let socket = tokio::net::TcpSocket::new_v4().expect("socket");
            socket.bind(SocketAddr::new(attacker(), 0)).expect("bind");
            silent.push(socket.connect(ca.addr).await.expect("connect"));
        }
        let over = (SILENT - limits.per_source) as u64;
        wait_until(
            Duration::from_secs(10),
            "the silent connections over the cap closed",
            || {
                let n = ca.metrics.connections_refused_total("per_source");
                async move { (n >= over).then_some(()) }
            },
        )
        .await
        .expect("closed at accept");
        // Served well within the handshake deadline the silent ones hold.
        let (first, renewal) =
            tokio::time::timeout(limits.handshake_timeout / 2, first_and_renewal(&ca, &csr))
                .await
                .expect("the sidecar is served while the silent connections are open");
        println!(
            "workload CA, one source holding {SILENT} silent TCP connections: sidecar's first certificate {first:?}, renewal {renewal:?}"
        );
        drop(silent);
        ca.stop().await;
    }

    /// A request body that never comes: a slow client.
    struct Endless;

    impl hyper::body::Body for Endless {
        type Data = hyper::body::Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
            std::task::Poll::Pending
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_requests_of_one_source_do_not_hold_every_place() {
        const STREAMS: usize = 64;
        let limits = Limits::default();
        let streams = limits.per_source * STREAMS;
        assert!(
            streams > limits.max_in_flight,
            "the attack could fill the places"
        );
        let ca = Ca::start(limits, GateLimits::default()).await;
        let csr = csr();
        // The attack: every connection one source may hold, every stream of
        // each a CreateCertificate whose body never comes.
        let mut conns = Vec::new();
        for _ in 0..limits.per_source {
            let h2: H2<Endless> = h2_client::connect(attacker(), ca.addr, SERVER_NAME, &ca.bundle)
                .await
                .expect("connect");
            conns.push(h2);
        }
        let answered = Arc::new(AtomicUsize::new(0));
        let mut slow = Vec::new();
        for h2 in &conns {
            for _ in 0..STREAMS {
                let (mut sender, answered) = (h2.sender.clone(), Arc::clone(&answered));
                slow.push(tokio::spawn(async move {
                    sender.ready().await.ok()?;
                    let req = http::Request::post(format!(
                        "https://{SERVER_NAME}/istio.v1.auth.IstioCertificateService/CreateCertificate"
                    ))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .body(Endless)
                    .expect("request");
                    let res = sender.send_request(req).await.ok()?;
                    answered.fetch_add(1, Ordering::SeqCst);
                    res.headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string)
                }));
            }
        }
        // Past the source's share, its requests are refused at once; its
        // share waits for bodies that never come.
        let refused = streams - limits.per_source_requests;
        wait_until(
            Duration::from_secs(10),
            "the source's extra requests refused",
            || {
                let n = answered.load(Ordering::SeqCst);
                async move { (n >= refused).then_some(()) }
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}: {} answered", answered.load(Ordering::SeqCst)));

        let (first, renewal) =
            tokio::time::timeout(Duration::from_secs(5), first_and_renewal(&ca, &csr))
                .await
                .expect("the sidecar is served within 5 s");
        assert_eq!(
            answered.load(Ordering::SeqCst),
            refused,
            "the slow ones still hang"
        );
        assert_eq!(ca.metrics.refused_total("source_busy"), refused as u64);
        println!(
            "workload CA, one source holding {streams} slow requests ({refused} refused at once): \
             sidecar's first certificate {first:?}, renewal {renewal:?}"
        );
        let mut codes = Vec::new();
        for t in slow {
            if t.is_finished() {
                codes.push(t.await.expect("request task"));
            } else {
                t.abort();
            }
        }
        for h2 in conns {
            h2.conn.abort();
        }
        assert_eq!(
            codes.iter().filter(|c| c.as_deref() == Some("14")).count(),
            refused,
            "refused with UNAVAILABLE: {codes:?}"
        );
        ca.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn junk_tokens_cost_no_token_review() {
        const JUNK: u64 = 10_000;
        let ca = Ca::start(Limits::default(), GateLimits::default()).await;
        let h2 = ca.connect(attacker()).await.expect("connect");
        let c = client(&h2);
        let junk = |n: u64| match n % 3 {
            // Random bytes, as text.
            0 => format!("{:x}{:x}", rand::random::<u128>(), rand::random::<u64>()),
            // A service-account token's shape for the API server's audience.
            1 => jwt::service_account("https://kubernetes.default.svc", EXP, n),
            // Ours, but expired an hour ago.
            _ => jwt::service_account(AUD, jwt::unix_from_now(-3600), n),
        };
        let started = Instant::now();
        let codes: Vec<tonic::Code> = futures::stream::iter(0..JUNK)
            .map(|n| {
                let mut c = c.clone();
                let token = junk(n);
                async move {
                    match ask(&mut c, &token, "not a CSR").await {
                        Ok(_) => panic!("junk token {n} was issued a certificate"),
                        Err(s) => {
                            assert!(!s.message().contains(&token), "the token echoed");
                            s.code()
                        }
                    }
                }
            })
            .buffer_unordered(Limits::default().per_source_requests)
            .collect()
            .await;
        let elapsed = started.elapsed();
        assert!(
            codes.iter().all(|c| *c == tonic::Code::Unauthenticated),
            "{:?}",
            codes.iter().find(|c| **c != tonic::Code::Unauthenticated)
        );
        let reviews = ca.reviews.load(Ordering::SeqCst);
        println!("workload CA: {JUNK} junk tokens in {elapsed:?} caused {reviews} TokenReviews");
        assert_eq!(reviews, 0, "TokenReviews caused by junk tokens");

        // A good token: reviewed once, then served from the cache.
        let csr = csr();
        let good = jwt::service_account(AUD, EXP, GOOD);
        let mut c = client(&h2);
        for _ in 0..20 {
            ask(&mut c, &good, &csr).await.expect("issued");
        }
        assert_eq!(
            ca.reviews.load(Ordering::SeqCst),
            1,
            "one review for 20 requests"
        );
        ca.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn forged_tokens_of_one_source_do_not_use_up_the_reviews() {
        // Tokens shaped right (our audience, a future exp) pass the
        // precheck; only the API server can tell them forged, so they are
        // rate-limited per source and in total.
        let gate = GateLimits::default();
        let ca = Ca::start(Limits::default(), gate).await;
        let h2 = ca.connect(attacker()).await.expect("connect");
        let c = client(&h2);
        let started = Instant::now();
        let codes: Vec<tonic::Code> = futures::stream::iter(0..2_000u64)
            .map(|n| {
                let mut c = c.clone();
                async move {
                    let token = jwt::service_account(AUD, EXP, 1_000 + n);
                    ask(&mut c, &token, "not a CSR")
                        .await
                        .expect_err("forged")
                        .code()
                }
            })
            .buffer_unordered(Limits::default().per_source_requests)
            .collect()
            .await;
        let elapsed = started.elapsed();
        let reviews = ca.reviews.load(Ordering::SeqCst);
        let unavailable = codes
            .iter()
            .filter(|c| **c == tonic::Code::Unavailable)
            .count();
        let allowed = u64::from(gate.per_source_burst)
            + u64::from(gate.per_source_per_second) * (elapsed.as_secs() + 1);
        println!(
            "workload CA: 2000 forged tokens from one source in {elapsed:?}: {reviews} TokenReviews, {unavailable} answered Unavailable"
        );
        assert!(
            (reviews as u64) <= allowed,
            "{reviews} reviews in {elapsed:?}, at most {allowed} allowed"
        );
        assert_eq!(unavailable + reviews, codes.len(), "{codes:?}");
        // Another source still gets its review.
        let h2 = ca.connect(sidecar()).await.expect("connect");
        let csr = csr();
        ask(
            &mut client(&h2),
            &jwt::service_account(AUD, EXP, GOOD),
            &csr,
        )
        .await
        .expect("the sidecar's first certificate");
        ca.stop().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_idle_connection_is_closed_and_a_busy_one_is_not() {
        let idle = Duration::from_millis(400);
        let ca = Ca::start(
            Limits {
                idle,
                ..Limits::default()
            },
            GateLimits::default(),
        )
        .await;
        let csr = csr();
        // Busy: a request whose review takes a second, longer than `idle`.
        let h2 = ca.connect(sidecar()).await.expect("connect");
        let mut c = client(&h2);
        ask(&mut c, &jwt::service_account(AUD, EXP, SLOW), &csr)
            .await
            .expect("a slow request finishes");
        let answered = Instant::now();
        // Then idle: closed after `idle`, with a GOAWAY (a clean end).
        let closed = tokio::time::timeout(Duration::from_secs(10), h2.conn)
            .await
            .expect("the idle connection is closed within 10 s")
            .expect("connection task");
        assert!(closed.is_ok(), "closed cleanly: {closed:?}");
        // The server's clock starts as it answers, a little before the
        // client has the answer; closed during the request, it would end
        // at once after it.
        let after = answered.elapsed();
        assert!(after >= idle / 2, "closed {after:?} after its last answer");
        println!(
            "workload CA: an idle connection closed {after:?} after its last answer (idle {idle:?})"
        );

        // An idle connection that never asked anything is closed too.
        let h2 = ca.connect(attacker()).await.expect("connect");
        let closed = tokio::time::timeout(Duration::from_secs(10), h2.conn)
            .await
            .expect("the silent connection is closed within 10 s")
            .expect("connection task");
        assert!(closed.is_ok(), "{closed:?}");
        ca.stop().await;
    }
}
