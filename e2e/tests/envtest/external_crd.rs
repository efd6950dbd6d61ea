//! The ExternalService and ExternalWorkload CRDs behind the real
//! kube-apiserver: its CEL (including Kubernetes' own libraries, such as
//! `isIP`, which the local evaluator in crds/tests lacks) and the bounds.

use e2e::controlplane::ControlPlane;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value, json};

fn api(client: &kube::Client, ns: &str, kind: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("remora.dev", "v1alpha1", kind);
    Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
}

fn object(kind: &str, name: &str, spec: Value) -> Result<DynamicObject, serde_json::Error> {
    serde_json::from_value(json!({
        "apiVersion": "remora.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": spec,
    }))
}

/// Each `(spec, what the message must say)` of `kind` is refused with 422.
async fn refused(
    api: &Api<DynamicObject>,
    kind: &str,
    cases: Vec<(Value, Vec<&str>)>,
) -> anyhow::Result<()> {
    for (i, (spec, want)) in cases.into_iter().enumerate() {
        let name = format!("bad-{i}");
        let err = api
            .create(&PostParams::default(), &object(kind, &name, spec.clone())?)
            .await
            .expect_err(&format!("{spec} must be refused"));
        let kube::Error::Api(status) = err else {
            anyhow::bail!("{spec}: not an API error: {err}");
        };
        assert_eq!(status.code, 422, "{spec}: {status:?}");
        for w in want {
            assert!(
                status.message.contains(w),
                "{spec}: message lacks {w:?}: {}",
                status.message
            );
        }
    }
    Ok(())
}

#[tokio::test]
async fn crds_refuse_invalid_external_services_with_readable_messages() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    e2e::chart::install_crds(&client).await?;
    let ns = cp.create_namespace(&client, "xsvc").await?;
    let services = api(&client, &ns, "ExternalService");
    let workloads = api(&client, &ns, "ExternalWorkload");
    let ports = json!([{"number": 443, "name": "https", "protocol": "TLS"},
                       {"number": 80, "name": "http", "protocol": "HTTP", "targetPort": 8080}]);

    for (name, spec) in [
        (
            "by-address",
            json!({"hosts": ["api.example.com", "api.example.org"], "ports": ports,
                   "connectTimeout": "250ms",
                   "endpoints": [{"address": "192.0.2.1", "ports": {"https": 8443}, "serviceAccount": "api"},
                                 {"address": "2001:db8::1", "weight": 3}]}),
        ),
        (
            "by-label",
            json!({"hosts": ["vm.example.com"], "ports": ports,
                   "workloadSelector": {"matchLabels": {"app": "vm"}}}),
        ),
        // The schema takes 0s (the duration grammar of every resource);
        // Envoy refuses it (operator/tests/local/discovery.rs, node_external.rs).
        (
            "zero-timeout",
            json!({"hosts": ["z.example.com"], "ports": ports, "connectTimeout": "0s",
                   "workloadSelector": {}}),
        ),
    ] {
        services
            .create(
                &PostParams::default(),
                &object("ExternalService", name, spec)?,
            )
            .await?;
    }
    workloads
        .create(
            &PostParams::default(),
            &object(
                "ExternalWorkload",
                "vm-1",
                json!({"address": "192.0.2.7", "labels": {"app": "vm"}, "serviceAccount": "vm",
                       "ports": {"https": 443}}),
            )?,
        )
        .await?;

    let many_hosts: Vec<String> = (0..17).map(|i| format!("h{i}.example.com")).collect();
    let many_eps: Vec<Value> = (0..65)
        .map(|i| json!({"address": format!("192.0.2.{i}")}))
        .collect();
    refused(
        &services,
        "ExternalService",
        vec![
            (
                json!({"hosts": ["api.example.com"], "ports": ports}),
                vec!["set exactly one of endpoints and workloadSelector"],
            ),
            (
                json!({"hosts": ["cart.shop.svc.cluster.local"], "ports": ports, "workloadSelector": {}}),
                vec!["spec.hosts[0]", "cluster Service's name"],
            ),
            (
                json!({"hosts": ["localhost"], "ports": ports, "workloadSelector": {}}),
                vec!["spec.hosts[0]", "should match"],
            ),
            (
                json!({"hosts": ["API.example.com"], "ports": ports, "workloadSelector": {}}),
                vec!["spec.hosts[0]", "should match"],
            ),
            (
                json!({"hosts": ["a.example.com"], "ports": ports,
                       "endpoints": [{"address": "api.example.com"}]}),
                vec!["spec.endpoints[0].address", "must be an IPv4 or IPv6 address"],
            ),
            (
                json!({"hosts": ["a.example.com"], "ports": ports,
                       "endpoints": [{"address": "192.0.2.1", "ports": {"grpc": 9000}}]}),
                vec!["an endpoint's ports must name ports of spec.ports"],
            ),
            (
                json!({"hosts": ["a.example.com"], "ports": ports,
                       "endpoints": [{"address": "192.0.2.1", "ports": {"https": 70000}}]}),
                vec!["ports must be between 1 and 65535"],
            ),
            (
                json!({"hosts": ["a.example.com"], "workloadSelector": {},
                       "ports": [{"number": 1, "name": "a", "protocol": "TCP"},
                                 {"number": 2, "name": "a", "protocol": "TCP"}]}),
                vec!["port names must be unique"],
            ),
            (
                json!({"hosts": ["a.example.com"], "workloadSelector": {},
                       "ports": [{"number": 1, "name": "a", "protocol": "TCP"},
                                 {"number": 1, "name": "b", "protocol": "TCP"}]}),
                vec!["Duplicate value"],
            ),
            (
                json!({"hosts": ["a.example.com"], "workloadSelector": {},
                       "ports": [{"number": 1, "name": "a", "protocol": "QUIC"}]}),
                vec!["Unsupported value: \"QUIC\""],
            ),
            (
                json!({"hosts": many_hosts, "ports": ports, "workloadSelector": {}}),
                vec!["spec.hosts", "must have at most 16 items"],
            ),
            (
                json!({"hosts": ["a.example.com"], "ports": ports, "endpoints": many_eps}),
                vec!["spec.endpoints", "must have at most 64 items"],
            ),
            (
                json!({"hosts": ["a.example.com"], "ports": ports, "workloadSelector": {},
                       "connectTimeout": "soon"}),
                vec!["spec.connectTimeout"],
            ),
        ],
    )
    .await?;
    refused(
        &workloads,
        "ExternalWorkload",
        vec![
            (
                json!({"labels": {}}),
                vec!["spec.address", "Required value"],
            ),
            (
                json!({"address": "fe80::1%eth0"}),
                vec!["must be an IPv4 or IPv6 address"],
            ),
            (
                json!({"address": "192.0.2.1", "serviceAccount": "Not_A_Name"}),
                vec!["spec.serviceAccount", "should match"],
            ),
            (
                json!({"address": "192.0.2.1", "weight": 0}),
                vec!["spec.weight", "greater than or equal to 1"],
            ),
        ],
    )
    .await?;
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}
