//! The schema's CEL rules, evaluated locally the way the API server does.

use kube::core::cel::Validator;
use serde_json::{Value, json};

fn schema() -> anyhow::Result<Value> {
    let crd = serde_json::to_value(remora_crds::crds().remove(0))?;
    Ok(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone())
}

fn object(spec: Value) -> Value {
    json!({
        "apiVersion": "remora.dev/v1alpha1",
        "kind": "SidecarLifecycle",
        "metadata": {"name": "x", "namespace": "shop"},
        "spec": spec
    })
}

fn errors(spec: Value) -> anyhow::Result<Vec<String>> {
    match Validator::new().validate(&schema()?, &object(spec), None) {
        Ok(()) => Ok(vec![]),
        Err(errs) => Ok(errs.into_iter().map(|e| e.to_string()).collect()),
    }
}

#[test]
fn valid_specs_pass() -> anyhow::Result<()> {
    for spec in [
        json!({}),
        json!({"mode": "Native", "startup": {"timeout": "1m30s", "holdApplicationUntilProxyStarts": true}}),
        json!({"shutdown": {"drainDuration": "45s", "terminationDrainDuration": "5s", "minimumDrainDuration": "250ms", "exitOnZeroActiveConnections": true}}),
        json!({"shutdown": {"minimumDrainDuration": "0s"}}),
    ] {
        assert_eq!(errors(spec.clone())?, Vec::<String>::new(), "{spec}");
    }
    Ok(())
}

#[test]
fn out_of_range_durations_fail() -> anyhow::Result<()> {
    for spec in [
        json!({"startup": {"timeout": "-5s"}}),
        json!({"shutdown": {"drainDuration": "25h"}}),
    ] {
        assert!(
            !errors(spec.clone())?.is_empty(),
            "{spec} should be refused"
        );
    }
    Ok(())
}

#[test]
fn cross_field_rules_fail() -> anyhow::Result<()> {
    let e = errors(json!({"shutdown": {"drainDuration": "10s", "minimumDrainDuration": "20s"}}))?;
    assert!(
        e.iter().any(|m| m.contains("minimumDrainDuration")),
        "{e:?}"
    );
    let e =
        errors(json!({"shutdown": {"drainDuration": "10s", "terminationDrainDuration": "11s"}}))?;
    assert!(
        e.iter().any(|m| m.contains("terminationDrainDuration")),
        "{e:?}"
    );
    Ok(())
}

/// The ExternalService's rules that the local evaluator supports (`isIP`,
/// a Kubernetes library, is checked against the real API server in
/// e2e/tests/envtest/external_crd.rs).
fn external_errors(spec: Value) -> anyhow::Result<Vec<String>> {
    let crd = serde_json::to_value(remora_crds::crds().remove(1))?;
    let schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone();
    let obj = json!({
        "apiVersion": "remora.dev/v1alpha1",
        "kind": "ExternalService",
        "metadata": {"name": "x", "namespace": "shop"},
        "spec": spec
    });
    match Validator::new().validate(&schema, &obj, None) {
        Ok(()) => Ok(vec![]),
        Err(errs) => Ok(errs.into_iter().map(|e| e.to_string()).collect()),
    }
}

#[test]
fn external_service_rules() -> anyhow::Result<()> {
    let ports = json!([{"number": 443, "name": "https", "protocol": "TLS"},
                       {"number": 80, "name": "http", "protocol": "HTTP"}]);
    let ok = json!({"hosts": ["api.example.com"], "ports": ports,
                    "workloadSelector": {"matchLabels": {"app": "api"}}});
    assert_eq!(external_errors(ok)?, Vec::<String>::new());
    for (spec, want) in [
        (
            json!({"hosts": ["api.example.com"], "ports": ports}),
            "exactly one of endpoints and workloadSelector",
        ),
        (
            json!({"hosts": ["api.example.com"], "ports": ports,
                   "workloadSelector": {}, "endpoints": []}),
            "exactly one of endpoints and workloadSelector",
        ),
        (
            json!({"hosts": ["cart.shop.svc.cluster.local"], "ports": ports, "workloadSelector": {}}),
            "cluster Service's name",
        ),
        (
            json!({"hosts": ["cart.shop.svc"], "ports": ports, "workloadSelector": {}}),
            "cluster Service's name",
        ),
        (
            json!({"hosts": ["api.example.com"], "workloadSelector": {},
                   "ports": [{"number": 1, "name": "a", "protocol": "TCP"},
                             {"number": 2, "name": "a", "protocol": "TCP"}]}),
            "port names must be unique",
        ),
    ] {
        let e = external_errors(spec.clone())?;
        assert!(e.iter().any(|m| m.contains(want)), "{spec}: {e:?}");
    }
    Ok(())
}
