//! The Helm chart against the real kube-apiserver: `helm template` renders
//! it, the CRDs are installed for real, and every other rendered object is
//! applied with server-side dry-run, so the API server's own validation
//! (schemas, CEL rules of the SidecarLifecycle CRD, webhook configuration
//! and RBAC rules, pod template validation) judges it.

use std::time::Duration;

use anyhow::Context;
use e2e::controlplane::ControlPlane;
use e2e::operator::{Operator, Options};
use e2e::webhook::every_ca_bundle_is;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::discovery::{Discovery, Scope};
use kube::{Api, Client};
use remora_operator::identity::FIELD_MANAGER;
use remora_test_support::wait::wait_until;
use serde_json::Value;

const DEADLINE: Duration = Duration::from_secs(60);

/// Kinds whose API the local control plane does not have: cert-manager's
/// (Certificate, Issuer), rendered with certMode=certManager. Only these are
/// skipped, and the test says how many it skipped.
const ABSENT_GROUPS: &[&str] = &["cert-manager.io"];

/// Renders the chart with `sets` into `ns`, installs its CRDs, dry-runs the
/// rest; returns (applied kinds, skipped kinds).
async fn dry_run_chart(
    client: &Client,
    release: &str,
    ns: &str,
    sets: &[&str],
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let objects = e2e::chart::render(release, ns, sets)?;
    anyhow::ensure!(!objects.is_empty(), "helm rendered nothing");
    // The chart's crds/ (rendered first with --include-crds) for real.
    e2e::chart::install_crds(client).await?;
    let discovery = Discovery::new(client.clone()).run().await?;
    let mut applied = Vec::new();
    let mut skipped = Vec::new();
    for obj in &objects {
        let api_version = obj["apiVersion"].as_str().context("no apiVersion")?;
        let kind = obj["kind"].as_str().context("no kind")?;
        let name = obj["metadata"]["name"].as_str().context("no name")?;
        if kind == "CustomResourceDefinition" {
            continue;
        }
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        if ABSENT_GROUPS.contains(&group) {
            skipped.push(kind.to_owned());
            continue;
        }
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let (ar, caps) = discovery
            .resolve_gvk(&gvk)
            .with_context(|| format!("the API server does not serve {api_version} {kind}"))?;
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Namespaced => {
                let obj_ns = obj["metadata"]["namespace"].as_str().unwrap_or(ns);
                assert_eq!(obj_ns, ns, "{kind}/{name} outside the release namespace");
                Api::namespaced_with(client.clone(), ns, &ar)
            }
            Scope::Cluster => Api::all_with(client.clone(), &ar),
        };
        let dynobj: DynamicObject = serde_json::from_value(obj.clone())?;
        api.patch(
            name,
            &PatchParams::apply(e2e::chart::FIELD_MANAGER).dry_run(),
            &Patch::Apply(&dynobj),
        )
        .await
        .with_context(|| {
            format!(
                "the API server refused {kind}/{name}:\n{}",
                serde_json::to_string_pretty(obj).unwrap_or_default()
            )
        })?;
        applied.push(kind.to_owned());
    }
    Ok((applied, skipped))
}

fn find<'a>(objects: &'a [Value], kind: &str) -> anyhow::Result<&'a Value> {
    e2e::chart::find(objects, kind, None).with_context(|| format!("no {kind} rendered"))
}

#[tokio::test]
async fn default_render_is_accepted_by_the_api_server() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "chart").await?;
    let (mut applied, skipped) = dry_run_chart(&client, "remora", &ns, &[]).await?;
    applied.sort();
    assert_eq!(
        applied,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "Deployment",
            "MutatingWebhookConfiguration",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
            "SidecarLifecycle",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ]
    );
    assert!(skipped.is_empty(), "{skipped:?}");

    // The admission policy is on by default, and can be turned off, saying so.
    let off = e2e::chart::render(
        "remora",
        &ns,
        &[
            "admissionPolicy.enabled=false",
            "admissionPolicy.acknowledgeDisabled=true",
        ],
    )?;
    assert!(
        !off.iter().any(|o| o["kind"]
            .as_str()
            .is_some_and(|k| k.starts_with("ValidatingAdmissionPolicy"))),
        "admissionPolicy.enabled=false still renders the policy"
    );

    // What the issue asks of the rendered objects.
    let objects = e2e::chart::render("remora", &ns, &[])?;
    let dep = find(&objects, "Deployment")?;
    assert_eq!(dep["spec"]["replicas"], 2);
    let pod = &dep["spec"]["template"]["spec"];
    assert!(pod["affinity"]["podAntiAffinity"].is_object(), "{pod:#}");
    let sc = &pod["containers"][0]["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["capabilities"]["drop"][0], "ALL");
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    let probes = &pod["containers"][0];
    assert_eq!(probes["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(probes["livenessProbe"]["httpGet"]["path"], "/healthz");
    // Until told who the API servers are, the policy admits no one to the
    // webhook (it fails closed; see network_policy_admits_only_the_api_servers):
    // only the workload CA's and the discovery server's ports, on by default
    // (mesh_defaults_are_on_for_a_new_install_and_kept_on_upgrade).
    let np = find(&objects, "NetworkPolicy")?;
    assert_eq!(np["spec"]["policyTypes"][0], "Ingress");
    assert_eq!(
        np["spec"]["ingress"],
        serde_json::json!([
            {"ports": [{"port": 15012, "protocol": "TCP"}]},
            {"ports": [{"port": 15010, "protocol": "TCP"}]},
        ]),
        "{np:#}"
    );
    // The workload CA turned off: no port, no rights for it.
    let off = e2e::chart::render("remora", &ns, &["workloadCA.enabled=false"])?;
    let np = find(&off, "NetworkPolicy")?;
    assert_eq!(np["spec"]["ingress"], serde_json::json!([]), "{np:#}");
    let dep_off = find(&off, "Deployment")?;
    for port in ["15012", "15010"] {
        assert!(!dep_off.to_string().contains(port), "{dep_off:#}");
        assert!(!find(&off, "Service")?.to_string().contains(port));
    }
    for kind in ["ClusterRole", "Role", "ValidatingAdmissionPolicy"] {
        let text = find(&off, kind)?.to_string();
        for what in [
            "tokenreviews",
            "configmaps",
            "remora-workload-ca",
            "endpointslices",
        ] {
            assert!(!text.contains(what), "{kind} names {what}: {text}");
        }
    }
    let mwc = find(&objects, "MutatingWebhookConfiguration")?;
    let hooks = mwc["webhooks"].as_array().context("no webhooks")?;
    assert_eq!(hooks.len(), 2);
    for h in hooks {
        assert_eq!(h["failurePolicy"], "Fail");
        assert_eq!(h["sideEffects"], "None");
        assert_eq!(h["reinvocationPolicy"], "IfNeeded");
        assert_eq!(h["admissionReviewVersions"][0], "v1");
        assert!(h["timeoutSeconds"].as_i64().is_some_and(|t| t <= 10));
        let excluded = &h["namespaceSelector"]["matchExpressions"][0];
        assert_eq!(excluded["operator"], "NotIn");
        let values: Vec<&str> = excluded["values"]
            .as_array()
            .context("values")?
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            values.contains(&"kube-system") && values.contains(&ns.as_str()),
            "{values:?}"
        );
    }
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

#[tokio::test]
async fn cert_manager_render_is_accepted_by_the_api_server() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "chart-cm").await?;
    // Without the workload CA, whose signing Secret needs rights of its own
    // (workload_ca_render_is_accepted_by_the_api_server, in this mode too).
    let sets = [
        "certMode=certManager",
        "webhook.failurePolicy=Ignore",
        "workloadCA.enabled=false",
    ];
    let (applied, mut skipped) = dry_run_chart(&client, "remora", &ns, &sets).await?;
    assert!(applied.contains(&"MutatingWebhookConfiguration".to_owned()));
    skipped.sort();
    // cert-manager is not installed here: its two kinds are all that is skipped.
    assert_eq!(skipped, ["Certificate", "Issuer"]);

    let objects = e2e::chart::render("remora", &ns, &sets)?;
    let mwc = find(&objects, "MutatingWebhookConfiguration")?;
    assert_eq!(
        mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        format!("{ns}/remora-operator")
    );
    assert_eq!(mwc["webhooks"][0]["failurePolicy"], "Ignore");
    let cert = find(&objects, "Certificate")?;
    assert_eq!(cert["spec"]["secretName"], "remora-operator-tls");
    let dep = find(&objects, "Deployment")?;
    let vol = &dep["spec"]["template"]["spec"]["volumes"][0];
    assert_eq!(vol["secret"]["secretName"], "remora-operator-tls");
    // No self-managed Secret, so no RBAC on Secrets.
    let role = find(&objects, "Role")?;
    assert!(!role.to_string().contains("secrets"), "{role:#}");
    // Nor may the operator write a Secret or its webhook configuration
    // under the admission policy: cert-manager does both.
    let vap = find(&objects, "ValidatingAdmissionPolicy")?;
    let writes = vap["spec"]["validations"][0]["expression"]
        .as_str()
        .context("no first validation")?;
    assert!(
        writes.contains("leases")
            && !writes.contains("/secrets")
            && !writes.contains("webhookConfig"),
        "{writes}"
    );
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

/// The RBAC rules of a rendered (Cluster)Role as (apiGroups, resources,
/// resourceNames, verbs), one string each.
fn rules(role: &Value) -> Vec<[String; 4]> {
    let list = |r: &Value, k: &str| {
        r[k].as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default()
    };
    role["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            [
                list(r, "apiGroups"),
                list(r, "resources"),
                list(r, "resourceNames"),
                list(r, "verbs"),
            ]
        })
        .collect()
}

/// A container's env entries that have a plain value, by name.
fn plain_env(c: &Value) -> anyhow::Result<std::collections::BTreeMap<&str, &str>> {
    Ok(c["env"]
        .as_array()
        .context("env")?
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?, e["value"].as_str()?)))
        .collect())
}

fn rule(group: &str, resource: &str, names: &str, verbs: &str) -> [String; 4] {
    [group, resource, names, verbs].map(str::to_owned)
}

/// The rendered Deployment's env value `name`.
fn env_value<'a>(objects: &'a [Value], name: &str) -> anyhow::Result<Option<&'a str>> {
    let dep = find(objects, "Deployment")?;
    Ok(dep["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .context("env")?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str()))
}

/// The rights on workloads come with rollouts.automatic only (off by
/// default), in RBAC and in the admission policy, and the operator is told.
#[test]
fn workload_rights_only_with_automatic_rollouts() -> anyhow::Result<()> {
    let off = e2e::chart::render("remora", "remora-system", &[])?;
    let on = e2e::chart::render("remora", "remora-system", &["rollouts.automatic=true"])?;
    let before = rules(find(&off, "ClusterRole")?);
    let after = rules(find(&on, "ClusterRole")?);
    assert!(
        before.iter().all(|r| r[0] != "apps"),
        "no right on workloads by default: {before:?}"
    );
    let added: Vec<_> = after.iter().filter(|r| !before.contains(r)).collect();
    assert_eq!(
        added,
        [
            &rule("apps", "replicasets", "", "get"),
            &rule(
                "apps",
                "deployments,statefulsets,daemonsets",
                "",
                "get,patch"
            ),
        ]
    );
    assert!(before.iter().all(|r| after.contains(r)), "{after:?}");
    assert_eq!(
        rules(find(&off, "Role")?),
        rules(find(&on, "Role")?),
        "the namespaced Role does not change"
    );
    assert_eq!(env_value(&off, "REMORA_AUTOMATIC_ROLLOUTS")?, Some("false"));
    assert_eq!(env_value(&on, "REMORA_AUTOMATIC_ROLLOUTS")?, Some("true"));

    // The policy lets a workload update through only with it on.
    let writes = |objects: &[Value]| -> anyhow::Result<String> {
        let vap = find(objects, "ValidatingAdmissionPolicy")?;
        let v = vap["spec"]["validations"]
            .as_array()
            .context("validations")?
            .iter()
            .find(|v| {
                v["messageExpression"]
                    .as_str()
                    .is_some_and(|m| m.contains("it writes only what Remora owns"))
            })
            .context("no validation of which writes")?;
        Ok(v["expression"].as_str().context("expression")?.to_owned())
    };
    assert!(!writes(&off)?.contains("isWorkload"), "{}", writes(&off)?);
    assert!(
        writes(&on)?.contains("variables.isWorkload"),
        "{}",
        writes(&on)?
    );
    Ok(())
}

/// `admissionPolicy.enabled=false` alone refuses to render, naming the
/// value that acknowledges it; the policy refuses every write in the
/// excluded namespaces (never the release namespace, whose Lease and
/// Secrets it keeps) and pods, workloads and ConfigMaps in the release
/// namespace.
#[test]
fn the_policy_cannot_be_silently_off_and_guards_excluded_namespaces() -> anyhow::Result<()> {
    let err = e2e::chart::render(
        "remora",
        "remora-system",
        &["admissionPolicy.enabled=false"],
    )
    .expect_err("installing without the policy, unacknowledged");
    let text = err.to_string();
    assert!(
        text.contains("admissionPolicy.acknowledgeDisabled=true") && text.contains("unguarded"),
        "{text}"
    );
    let acknowledged = e2e::chart::render(
        "remora",
        "remora-system",
        &[
            "admissionPolicy.enabled=false",
            "admissionPolicy.acknowledgeDisabled=true",
        ],
    )?;
    assert!(e2e::chart::find(&acknowledged, "ValidatingAdmissionPolicy", None).is_none());

    let objects = e2e::chart::render(
        "remora",
        "remora-system",
        &[
            "webhook.excludeNamespaces={kube-system,remora-system,tenant-x}",
            "workloadCA.enabled=false",
        ],
    )?;
    let vap = find(&objects, "ValidatingAdmissionPolicy")?;
    let validations = vap["spec"]["validations"]
        .as_array()
        .context("validations")?;
    let by_message = |text: &str| -> anyhow::Result<&str> {
        validations
            .iter()
            .find(|v| {
                v["messageExpression"]
                    .as_str()
                    .is_some_and(|m| m.contains(text))
            })
            .and_then(|v| v["expression"].as_str())
            .with_context(|| format!("no validation saying {text:?}"))
    };
    assert_eq!(
        by_message("excluded from injection")?,
        r#"!(variables.reqNamespace in ["kube-system","tenant-x"])"#
    );
    let own = by_message("in its own namespace")?;
    assert!(
        own.contains("variables.reqNamespace != 'remora-system'")
            && own.contains("['/pods']")
            && own.contains("variables.isWorkload"),
        "{own}"
    );
    // With the workload CA, its ConfigMaps too.
    let ca = e2e::chart::render("remora", "remora-system", &["workloadCA.enabled=true"])?;
    let vap = find(&ca, "ValidatingAdmissionPolicy")?;
    assert!(
        vap["spec"]["validations"]
            .as_array()
            .context("validations")?
            .iter()
            .any(|v| v["expression"]
                .as_str()
                .is_some_and(|e| e.contains("['/pods', '/configmaps']"))),
        "{vap:#}"
    );
    Ok(())
}

/// With discovery.enabled (which needs the workload CA) the operator serves
/// xDS on 15010: its Deployment, Service and NetworkPolicy say so, and RBAC
/// adds only the reads of Services and EndpointSlices; the API server
/// accepts every object. Without the CA the chart refuses, saying why.
#[tokio::test]
async fn discovery_render_is_accepted_by_the_api_server() -> anyhow::Result<()> {
    let err = e2e::chart::render(
        "remora",
        "remora-system",
        &["workloadCA.enabled=false", "discovery.enabled=true"],
    )
    .expect_err("discovery without the workload CA");
    assert!(
        err.to_string()
            .contains("discovery.enabled needs workloadCA.enabled"),
        "{err}"
    );

    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "chart-xds").await?;
    let ca = ["workloadCA.enabled=true", "discovery.enabled=false"];
    let sets = ["workloadCA.enabled=true", "discovery.enabled=true"];
    let (applied, skipped) = dry_run_chart(&client, "remora", &ns, &sets).await?;
    assert!(applied.contains(&"Deployment".to_owned()), "{applied:?}");
    assert!(skipped.is_empty(), "{skipped:?}");
    let objects = e2e::chart::render("remora", &ns, &sets)?;

    let dep = find(&objects, "Deployment")?;
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    let env = plain_env(c)?;
    for (k, v) in [
        ("REMORA_DISCOVERY", "true"),
        ("REMORA_DISCOVERY_LISTEN", "0.0.0.0:15010"),
        ("REMORA_DISCOVERY_DEBOUNCE_QUIET", "100ms"),
        ("REMORA_DISCOVERY_DEBOUNCE_MAX", "1s"),
    ] {
        assert_eq!(env.get(k).copied(), Some(v), "{k}");
    }
    let port = remora_contract::discovery::PORT;
    let name = remora_contract::discovery::PORT_NAME;
    assert!(
        c["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["name"] == name && p["containerPort"] == port),
        "{c:#}"
    );
    let svc = find(&objects, "Service")?;
    assert!(
        svc["spec"]["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["name"] == name && p["port"] == port && p["targetPort"] == name),
        "{svc:#}"
    );
    let np = find(&objects, "NetworkPolicy")?;
    assert_eq!(
        np["spec"]["ingress"],
        serde_json::json!([
            {"ports": [{"port": 15012, "protocol": "TCP"}]},
            {"ports": [{"port": port, "protocol": "TCP"}]},
        ]),
        "{np:#}"
    );
    let with_ca = e2e::chart::render("remora", &ns, &ca)?;
    let added = |kind: &str| -> anyhow::Result<Vec<[String; 4]>> {
        let before = rules(find(&with_ca, kind)?);
        Ok(rules(find(&objects, kind)?)
            .into_iter()
            .filter(|r| !before.contains(r))
            .collect())
    };
    assert_eq!(
        added("ClusterRole")?,
        [
            rule("", "services", "", "list,watch"),
            rule("discovery.k8s.io", "endpointslices", "", "list,watch"),
            rule(
                "remora.dev",
                "externalservices,externalworkloads",
                "",
                "list,watch"
            ),
            rule("remora.dev", "externalservices/status", "", "patch"),
        ]
    );
    assert_eq!(added("Role")?, Vec::<[String; 4]>::new());
    Ok(())
}

/// With workloadCA.enabled the operator serves the CA on 15012 (its
/// Deployment, Service and NetworkPolicy say so) and gets exactly the rights
/// the CA needs, in RBAC and in the admission policy; the API server accepts
/// every object, in both certificate modes.
#[tokio::test]
async fn workload_ca_render_is_accepted_by_the_api_server() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "chart-ca").await?;
    let sets = [
        "workloadCA.enabled=true",
        "workloadCA.trustDomain=mesh.example",
        "workloadCA.certTTL=12h",
        "discovery.enabled=false",
    ];
    let (applied, skipped) = dry_run_chart(&client, "remora", &ns, &sets).await?;
    assert!(applied.contains(&"Deployment".to_owned()), "{applied:?}");
    assert!(skipped.is_empty(), "{skipped:?}");
    let objects = e2e::chart::render("remora", &ns, &sets)?;

    let dep = find(&objects, "Deployment")?;
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    let env = plain_env(c)?;
    for (k, v) in [
        ("REMORA_WORKLOAD_CA", "true"),
        ("REMORA_WORKLOAD_CA_LISTEN", "0.0.0.0:15012"),
        ("REMORA_WORKLOAD_CA_SECRET", "remora-workload-ca"),
        ("REMORA_TRUST_DOMAIN", "mesh.example"),
        ("REMORA_WORKLOAD_CERT_TTL", "12h"),
        ("REMORA_WORKLOAD_CERT_MAX_TTL", "48h"),
        ("REMORA_WORKLOAD_CA_ROOT_VALIDITY", "365d"),
        ("REMORA_WORKLOAD_CA_SETTLE", "2m"),
        ("REMORA_SERVICE_NAME", "remora-operator"),
    ] {
        assert_eq!(env.get(k).copied(), Some(v), "{k}");
    }
    assert!(
        c["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["name"] == "grpc-ca" && p["containerPort"] == 15012),
        "{c:#}"
    );
    let svc = find(&objects, "Service")?;
    assert!(
        svc["spec"]["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["name"] == "grpc-ca" && p["port"] == 15012 && p["targetPort"] == "grpc-ca"),
        "{svc:#}"
    );
    // The webhook port stays closed (no API server named); the CA's is
    // open to every pod (no `from`).
    let np = find(&objects, "NetworkPolicy")?;
    assert_eq!(
        np["spec"]["ingress"],
        serde_json::json!([{"ports": [{"port": 15012, "protocol": "TCP"}]}]),
        "{np:#}"
    );

    // RBAC: exactly these rules are added for the CA.
    let off = e2e::chart::render("remora", &ns, &["workloadCA.enabled=false"])?;
    let added = |kind: &str| -> anyhow::Result<Vec<[String; 4]>> {
        let before = rules(find(&off, kind)?);
        Ok(rules(find(&objects, kind)?)
            .into_iter()
            .filter(|r| !before.contains(r))
            .collect())
    };
    assert_eq!(
        added("ClusterRole")?,
        [
            rule("authentication.k8s.io", "tokenreviews", "", "create"),
            rule("", "configmaps", "", "create"),
            rule(
                "",
                "configmaps",
                "remora-ca-root-cert",
                "get,list,watch,patch"
            ),
        ]
    );
    assert_eq!(
        added("Role")?,
        [
            rule("", "secrets", "remora-workload-ca", "get,update"),
            rule("", "services", "remora-operator", "get"),
        ]
    );
    // The admission policy lets those writes through, by name.
    let vap = find(&objects, "ValidatingAdmissionPolicy")?;
    let writes = vap["spec"]["validations"][0]["expression"]
        .as_str()
        .context("no first validation")?;
    for what in [
        "'remora-workload-ca'",
        "'/configmaps'",
        "'remora-ca-root-cert'",
        "'authentication.k8s.io/tokenreviews'",
    ] {
        assert!(writes.contains(what), "{what}: {writes}");
    }

    // certManager: no TLS Secret of its own, but still the CA's, and its create.
    let cm_sets = [
        "workloadCA.enabled=true",
        "discovery.enabled=false",
        "certMode=certManager",
        "webhook.failurePolicy=Ignore",
    ];
    let (_, mut skipped) = dry_run_chart(&client, "remora", &ns, &cm_sets).await?;
    skipped.sort();
    assert_eq!(skipped, ["Certificate", "Issuer"]);
    let cm = e2e::chart::render("remora", &ns, &cm_sets)?;
    assert_eq!(
        rules(find(&cm, "Role")?)
            .into_iter()
            .filter(|r| r[1] == "secrets")
            .collect::<Vec<_>>(),
        [
            rule("", "secrets", "", "create"),
            rule("", "secrets", "remora-workload-ca", "get,update"),
        ]
    );
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

/// The chart's RBAC is enough for `remora-operator serve` in selfManaged
/// mode: the operator runs as the chart's ServiceAccount (a real token from
/// TokenRequest), lists and watches what it needs, creates its TLS Secret,
/// patches its CA into the chart's webhook configuration and writes
/// SidecarLifecycle status and Events, with no request refused by RBAC or by
/// the chart's ValidatingAdmissionPolicy.
#[tokio::test]
async fn operator_runs_with_only_the_charts_rbac() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let Some(pki) = cp.pki() else {
        // A real cluster's CA is not at hand as a file; the rest of the
        // chart tests still run there.
        eprintln!("not a local control plane: RBAC test not run");
        return Ok(());
    };
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "chart-rbac").await?;
    // The namespace as release name: cluster-scoped objects (ClusterRole,
    // webhook configuration) do not collide with other tests'.
    let release = ns.clone();
    // Without the CA (on by default): the rights of the webhook and the
    // controllers alone, so that none is missing.
    let objects = e2e::chart::render(
        &release,
        &ns,
        &["webhook.failurePolicy=Ignore", "workloadCA.enabled=false"],
    )?;
    e2e::chart::install_crds(&client).await?;
    let name = format!("{release}-remora-operator");
    // With the admission policy: every write the operator makes must pass it.
    let cluster_scoped = e2e::chart::apply(
        &client,
        &ns,
        &objects,
        &[&e2e::chart::IDENTITY_KINDS[..], &["SidecarLifecycle"]].concat(),
    )
    .await?;
    let token = e2e::controlplane::service_account_token(&client, &ns, &name).await?;
    // Start the operator only once the policy judges it, so that its writes
    // below are shown to pass the policy, not to precede it.
    let as_operator = Api::<MutatingWebhookConfiguration>::all(cp.client_with_token(&token)?);
    let retime = Patch::Json::<()>(serde_json::from_value(serde_json::json!(
        [{"op": "replace", "path": "/webhooks/0/timeoutSeconds", "value": 29}]))?);
    let dry_run = PatchParams::default().dry_run();
    e2e::chart::wait_until_policy_refuses(&name, || as_operator.patch(&name, &dry_run, &retime))
        .await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("operator.kubeconfig");
    let kc = serde_json::json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {
            "server": cp.server_url(),
            "certificate-authority": pki.ca_cert}}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "e2e", "user": "operator"}}],
        "current-context": "operator",
    });
    std::fs::write(&kubeconfig, serde_json::to_vec(&kc)?)?;

    let tls_dir = dir.path().join("tls");
    let mut options = Options::new(&ns);
    options.controller = true;
    options.args = vec![
        "--self-signed".into(),
        "--tls-secret".into(),
        format!("{name}-tls"),
        "--service-name".into(),
        name.clone(),
        "--webhook-config".into(),
        name.clone(),
        "--self-signed-dir".into(),
        tls_dir.display().to_string(),
        // The chart's REMORA_LEASE_NAME: its RBAC names this Lease only.
        "--lease-name".into(),
        name.clone(),
        "--retry-period".into(),
        "500ms".into(),
    ];
    let operator = Operator::start(&kubeconfig, options.clone()).await?;
    let log = || operator.log_tail();

    // Its Secret, its caBundle, a status written.
    let secret = Api::<Secret>::namespaced(client.clone(), &ns)
        .get(&format!("{name}-tls"))
        .await
        .with_context(log)?;
    assert!(secret.data.is_some_and(|d| !d.is_empty()));
    let mwc_api = Api::<MutatingWebhookConfiguration>::all(client.clone());
    wait_until(DEADLINE, "caBundle patched by the operator", || async {
        let mwc = mwc_api.get(&name).await?;
        let all = mwc.webhooks.unwrap_or_default().iter().all(|w| {
            w.client_config
                .ca_bundle
                .as_ref()
                .is_some_and(|b| !b.0.is_empty())
        });
        Ok::<_, anyhow::Error>(all.then_some(()))
    })
    .await
    .with_context(log)?;
    let gvk = GroupVersionKind::gvk("remora.dev", "v1alpha1", "SidecarLifecycle");
    let slc: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &ApiResource::from_gvk(&gvk));
    let slc_name = format!("{release}-remora-default");
    wait_until(DEADLINE, "the cluster default's status", || async {
        let o = slc.get(&slc_name).await?;
        Ok::<_, anyhow::Error>(o.data["status"]["observedGeneration"].as_i64().map(|_| ()))
    })
    .await
    .with_context(log)?;
    // Its Events pass the policy too (the cluster default was Accepted).
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), &ns);
    wait_until(DEADLINE, "the Accepted Event", || async {
        let list = events.list(&Default::default()).await?;
        Ok::<_, anyhow::Error>(
            list.items
                .iter()
                .any(|e| {
                    e.reason.as_deref() == Some("Accepted")
                        && e.reporting_controller.as_deref() == Some(FIELD_MANAGER)
                })
                .then_some(()),
        )
    })
    .await
    .with_context(log)?;
    // rolloutPolicy Automatic without rollouts.automatic (the default): no
    // right on workloads, so the controller does not try; the status says
    // why nothing is rolled, and nothing was refused.
    let work = cp.create_namespace(&client, "chart-rbac-work").await?;
    let slc_work: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &work, &ApiResource::from_gvk(&gvk));
    let spec = serde_json::json!({"rolloutPolicy": "Automatic",
        "selector": {"matchLabels": {"app": "web"}}});
    slc_work
        .create(&Default::default(), &e2e::webhook::lifecycle("web", spec)?)
        .await?;
    let old = serde_json::json!({"sources": ["chart"], "restartHash": "old"}).to_string();
    // Owned by a DaemonSet: a controller that tried to roll would read it,
    // and RBAC would refuse. (Its controller leaves a pod without a node
    // alone, and the garbage collector a pod whose owner exists.)
    let ds: k8s_openapi::api::apps::v1::DaemonSet = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {"selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "app", "image": "registry.invalid/app:1"}]}}},
    }))?;
    let ds = Api::<k8s_openapi::api::apps::v1::DaemonSet>::namespaced(client.clone(), &work)
        .create(&Default::default(), &ds)
        .await?;
    let mut outdated =
        e2e::webhook::pod("web-1", &[("app", "web")], &[("remora.dev/status", &old)]);
    outdated.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "apps/v1".into(),
            kind: "DaemonSet".into(),
            name: "web".into(),
            uid: ds.metadata.uid.context("no uid")?,
            controller: Some(true),
            ..Default::default()
        },
    ]);
    Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), &work)
        .create(&Default::default(), &outdated)
        .await?;
    let message = wait_until(
        DEADLINE,
        "RestartRequired: AutomaticRolloutsDisabled",
        || async {
            let o = slc_work.get("web").await?;
            let c = o.data["status"]["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == "RestartRequired").cloned());
            Ok::<_, anyhow::Error>(
                c.filter(|c| c["status"] == "True" && c["reason"] == "AutomaticRolloutsDisabled"),
            )
        },
    )
    .await
    .with_context(log)?;
    assert!(
        message["message"]
            .as_str()
            .is_some_and(|m| m.contains("rollouts.automatic")),
        "{message}"
    );
    // That it tried nothing (RBAC would have refused the DaemonSet's read)
    // is checked with the rest of its log below, seconds later.

    // The controller runs only on the leader: it created its Lease, and
    // renewing it (an update) is allowed too.
    let leases = Api::<Lease>::namespaced(client.clone(), &ns);
    let first = leases.get(&name).await.with_context(log)?;
    assert!(
        first
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_ref())
            .is_some_and(|h| !h.is_empty()),
        "{first:?}"
    );
    wait_until(DEADLINE, "the Lease renewed", || async {
        let l = leases.get(&name).await?;
        Ok::<_, anyhow::Error>(
            (l.metadata.resource_version != first.metadata.resource_version).then_some(()),
        )
    })
    .await
    .with_context(log)?;
    let text = operator.log_tail();
    assert!(
        !text.to_lowercase().contains("forbidden"),
        "the operator was refused something:\n{text}"
    );

    // What `helm upgrade` would render now keeps the operator's caBundle
    // (the template looks it up), so an upgrade never blanks it, which with
    // failurePolicy Fail would refuse pods until the operator patched it again.
    let live = mwc_api.get(&name).await?;
    let ca = live
        .webhooks
        .unwrap_or_default()
        .first()
        .and_then(|w| w.client_config.ca_bundle.clone())
        .context("no caBundle")?;
    let upgrade = e2e::chart::render_with(&release, &ns, &[], Some(cp.kubeconfig()))?;
    let rendered: MutatingWebhookConfiguration =
        serde_json::from_value(find(&upgrade, "MutatingWebhookConfiguration")?.clone())?;
    for w in rendered.webhooks.unwrap_or_default() {
        assert_eq!(w.client_config.ca_bundle.as_ref(), Some(&ca), "{}", w.name);
    }

    // A GitOps apply of the chart as rendered without a cluster
    // (`helm template | kubectl apply`) blanks the caBundle; the operator
    // watches its configuration and puts it back at once (it used to
    // look every 60 s).
    let blank = serde_json::from_value(serde_json::json!([
        {"op": "remove", "path": "/webhooks/0/clientConfig/caBundle"}]))?;
    mwc_api
        .patch(&name, &PatchParams::default(), &Patch::Json::<()>(blank))
        .await?;
    wait_until(Duration::from_secs(10), "caBundle restored", || async {
        let mwc = mwc_api.get(&name).await?;
        let first = mwc.webhooks.unwrap_or_default().into_iter().next();
        Ok::<_, anyhow::Error>(
            (first.and_then(|w| w.client_config.ca_bundle) == Some(ca.clone())).then_some(()),
        )
    })
    .await
    .with_context(log)?;

    // Stopped (SIGTERM), it released the Lease with the same rights.
    drop(operator);
    let released = leases.get(&name).await?;
    assert_eq!(
        released.spec.and_then(|s| s.holder_identity),
        None,
        "the Lease was not released"
    );

    // A Secret broken by hand (a serving certificate that is not one) is
    // repaired at the next start, with the chart's rights, and the new CA
    // goes into the caBundle: no crash loop.
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let broken = serde_json::json!({"data": {"tls.crt": "Z2FyYmFnZQ=="}});
    secrets
        .patch(
            &format!("{name}-tls"),
            &PatchParams::default(),
            &Patch::Merge(&broken),
        )
        .await?;
    let operator = Operator::start(&kubeconfig, options).await?;
    let log = || operator.log_tail();
    let repaired = wait_until(DEADLINE, "the Secret repaired", || async {
        let s = secrets.get(&format!("{name}-tls")).await?;
        let data = s.data.unwrap_or_default();
        let cert = data.get("tls.crt").map(|b| b.0.clone()).unwrap_or_default();
        Ok::<_, anyhow::Error>(
            cert.starts_with(b"-----BEGIN CERTIFICATE-----")
                .then(|| data.get("ca.crt").cloned())
                .flatten(),
        )
    })
    .await
    .with_context(log)?;
    assert_ne!(repaired, ca, "a new CA");
    wait_until(DEADLINE, "the new CA in the caBundle", || async {
        let mwc = mwc_api.get(&name).await?;
        Ok::<_, anyhow::Error>(every_ca_bundle_is(&mwc, &repaired).then_some(()))
    })
    .await
    .with_context(log)?;
    let text = operator.log_tail();
    assert!(text.contains("unusable; replacing them"), "{text}");
    assert!(
        !text.to_lowercase().contains("forbidden"),
        "the operator was refused something:\n{text}"
    );
    drop(operator);

    for (api, n) in cluster_scoped {
        api.delete(&n, &Default::default()).await?;
    }
    cp.delete_namespace(&client, &work).await?;
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

/// The `from` of the NetworkPolicy's webhook rule rendered with `sets`.
fn webhook_peers(sets: &[&str]) -> anyhow::Result<Value> {
    let objects = e2e::chart::render("remora", "remora-system", sets)?;
    let np = find(&objects, "NetworkPolicy")?;
    let rule = &np["spec"]["ingress"][0];
    assert_eq!(rule["ports"][0]["port"], 9443, "{np:#}");
    Ok(rule["from"].clone())
}

/// The webhook port admits the API servers and never the pod network:
/// "any address" only with the pods taken out, a pod CIDR taken out of
/// every CIDR that contains it (the API server refuses an `except` outside
/// its `cidr`), and a render that would admit every pod refused unless the
/// user says so. Each render is also dry-run against the API server.
#[tokio::test]
async fn network_policy_admits_only_the_api_servers() -> anyhow::Result<()> {
    use serde_json::json;
    // The pod network alone: any address of its families but the pods'.
    let pods = ["operator.networkPolicy.podCIDRs={10.244.0.0/16,fd00:10::/56}"];
    assert_eq!(
        webhook_peers(&pods)?,
        json!([
            {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.244.0.0/16"]}},
            {"ipBlock": {"cidr": "::/0", "except": ["fd00:10::/56"]}},
        ])
    );
    // The API servers by address; the pods are taken out only where they lie.
    let named = [
        "operator.networkPolicy.apiServerCIDRs={10.99.0.1/32,10.0.0.0/8,192.168.0.0/24,::/0}",
        "operator.networkPolicy.podCIDRs={10.244.0.0/16,fd00:10::/56}",
    ];
    assert_eq!(
        webhook_peers(&named)?,
        json!([
            {"ipBlock": {"cidr": "10.99.0.1/32"}},
            {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.244.0.0/16"]}},
            {"ipBlock": {"cidr": "192.168.0.0/24"}},
            {"ipBlock": {"cidr": "::/0", "except": ["fd00:10::/56"]}},
        ])
    );
    // Any address with no pod network of that family to take out: refused.
    for (sets, family) in [
        (
            vec!["operator.networkPolicy.apiServerCIDRs={0.0.0.0/0}"],
            "0.0.0.0/0 but podCIDRs names no IPv4",
        ),
        (
            vec![
                "operator.networkPolicy.apiServerCIDRs={0.0.0.0/0,::/0}",
                "operator.networkPolicy.podCIDRs={10.244.0.0/16}",
            ],
            "::/0 but podCIDRs names no IPv6",
        ),
    ] {
        let err = e2e::chart::render("remora", "remora-system", &sets)
            .err()
            .with_context(|| format!("{sets:?} rendered"))?
            .to_string();
        assert!(
            err.contains(family) && err.contains("allowPodNetwork=true"),
            "{err}"
        );
    }
    // Unless acknowledged.
    let open = [
        "operator.networkPolicy.apiServerCIDRs={0.0.0.0/0}",
        "operator.networkPolicy.allowPodNetwork=true",
    ];
    assert_eq!(
        webhook_peers(&open)?,
        json!([{"ipBlock": {"cidr": "0.0.0.0/0"}}])
    );
    // Not a CIDR: refused by the schema.
    let err = e2e::chart::render(
        "remora",
        "remora-system",
        &["operator.networkPolicy.podCIDRs={10.244.0/16}"],
    )
    .err()
    .context("a bad CIDR rendered")?
    .to_string();
    assert!(err.contains("podCIDRs"), "{err}");

    // values-local.yaml: the node's API server, as its calls arrive.
    let out = std::process::Command::new(e2e::chart::helm_bin()?)
        .args(["template", "remora"])
        .arg(e2e::chart::chart_dir())
        .args(["--namespace", "remora-system", "-f"])
        .arg(e2e::chart::chart_dir().join("values-local.yaml"))
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let local: Vec<Value> = serde_saphyr::from_multiple(&String::from_utf8_lossy(&out.stdout))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let local: Vec<Value> = local.into_iter().filter(Value::is_object).collect();
    let np = find(&local, "NetworkPolicy")?;
    assert_eq!(
        np["spec"]["ingress"][0]["from"],
        json!([
            {"ipBlock": {"cidr": "10.99.0.1/32"}},
            {"ipBlock": {"cidr": "10.244.0.1/32"}},
        ]),
        "{np:#}"
    );

    // The API server accepts each rendering.
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "chart-np").await?;
    for sets in [&pods[..], &named[..], &open[..]] {
        let (applied, _) = dry_run_chart(&client, "remora", &ns, sets).await?;
        assert!(applied.contains(&"NetworkPolicy".to_owned()), "{applied:?}");
    }
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

/// A values file written for the chart before the rename (keys `injector`
/// and `image.injector`) is refused with a message naming the new keys,
/// never half-applied: helm would otherwise drop those settings and install
/// the defaults without a word. A values file with the new keys renders,
/// and nothing the chart renders is named after the operator any more.
#[test]
fn values_for_the_injector_chart_are_refused_by_name() -> anyhow::Result<()> {
    let helm_with_file = |yaml: &str| -> anyhow::Result<std::process::Output> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("values.yaml");
        std::fs::write(&file, yaml)?;
        Ok(std::process::Command::new(e2e::chart::helm_bin()?)
            .args(["template", "remora"])
            .arg(e2e::chart::chart_dir())
            .args(["--namespace", "remora-system", "-f"])
            .arg(&file)
            .output()?)
    };
    let old = "injector:\n  replicas: 3\n  networkPolicy:\n    podCIDRs: [10.244.0.0/16]\n\
               image:\n  injector:\n    tag: v0.1.0\n";
    let out = helm_with_file(old)?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the old keys rendered");
    for want in [
        "values key injector was renamed operator",
        "injector.* is now operator.*",
        "image.injector.* is now image.operator.*",
    ] {
        assert!(err.contains(want), "{want:?} not in: {err}");
    }
    // Each key alone, as --set (or --reuse-values from an old release).
    for (set, named, not_named) in [
        ("injector.replicas=3", "injector.* is now", "image.injector"),
        (
            "image.injector.tag=v1",
            "image.injector.* is now",
            "renamed operator: injector.*",
        ),
    ] {
        let err = e2e::chart::render("remora", "remora-system", &[set])
            .err()
            .with_context(|| format!("--set {set} rendered"))?
            .to_string();
        assert!(
            err.contains("values key injector was renamed operator") && err.contains(named),
            "{err}"
        );
        assert!(!err.contains(not_named), "{set}: {err}");
    }

    let new = "operator:\n  replicas: 3\n  networkPolicy:\n    podCIDRs: [10.244.0.0/16]\n\
               image:\n  operator:\n    tag: v0.1.0\n";
    let out = helm_with_file(new)?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("replicas: 3"),
        "operator.replicas not applied"
    );
    assert!(
        text.contains("remora-operator:v0.1.0"),
        "image.operator.tag not applied"
    );

    // Every feature on: no object, label, argument or message the chart's
    // templates write names the operator (the CRD is generated from
    // crds/src, its descriptions are that crate's).
    for sets in [
        &["workloadCA.enabled=true", "rollouts.automatic=true"][..],
        &["certMode=certManager"][..],
    ] {
        let objects = e2e::chart::render("remora", "remora-system", sets)?;
        let named: Vec<String> = objects
            .iter()
            .filter(|o| o["kind"] != "CustomResourceDefinition")
            .filter(|o| o.to_string().contains("injector"))
            .map(|o| format!("{}/{}", o["kind"], o["metadata"]["name"]))
            .collect();
        assert!(named.is_empty(), "{sets:?}: {named:?} name the injector");
        // One leader Lease, named like the Deployment, and the right to it.
        assert_eq!(
            env_value(&objects, "REMORA_LEASE_NAME")?,
            Some("remora-operator")
        );
    }
    Ok(())
}

/// Sidecars injected before the rename dial the workload CA at the ClusterIP
/// of the Service `<release>-injector` and check its certificate under that
/// name: the chart keeps that Service (the same object, so the same address)
/// routing to the operator, and tells the CA to carry its name. `helm
/// template` cannot look the old Service up, so "auto" renders nothing here;
/// `true` stands for a cluster where it exists.
#[test]
fn the_injector_service_is_kept_for_sidecars_injected_before_the_rename() -> anyhow::Result<()> {
    let ca = "workloadCA.enabled=true";
    let objects = e2e::chart::render(
        "remora",
        "remora-system",
        &[ca, "operator.keepInjectorService=true"],
    )?;
    let old = e2e::chart::find(&objects, "Service", Some("remora-injector"))
        .context("the old Service is not rendered")?;
    let new = e2e::chart::find(&objects, "Service", Some("remora-operator"))
        .context("no operator Service")?;
    assert_eq!(
        old["spec"]["selector"], new["spec"]["selector"],
        "routes elsewhere"
    );
    let ports: Vec<_> = old["spec"]["ports"]
        .as_array()
        .context("ports")?
        .iter()
        .map(|p| p["port"].clone())
        .collect();
    assert_eq!(ports, [serde_json::json!(15012)], "only the CA's port");
    assert_eq!(
        env_value(&objects, "REMORA_WORKLOAD_CA_SERVICE_ALIASES")?,
        Some("remora-injector")
    );

    for sets in [
        &[ca][..],
        &[ca, "operator.keepInjectorService=false"][..],
        &[
            "operator.keepInjectorService=true",
            "workloadCA.enabled=false",
        ][..],
    ] {
        let objects = e2e::chart::render("remora", "remora-system", sets)?;
        assert!(
            e2e::chart::find(&objects, "Service", Some("remora-injector")).is_none(),
            "{sets:?} kept the old Service"
        );
        assert_eq!(
            env_value(&objects, "REMORA_WORKLOAD_CA_SERVICE_ALIASES")?,
            None,
            "{sets:?}"
        );
    }
    let bad = e2e::chart::render(
        "remora",
        "remora-system",
        &["operator.keepInjectorService=maybe"],
    );
    let err = bad
        .err()
        .context("keepInjectorService=maybe rendered")?
        .to_string();
    assert!(err.contains("keepInjectorService"), "{err}");
    Ok(())
}

/// The mesh as the rendered operator runs it: (workload CA, discovery), from
/// its Deployment's env.
fn mesh(objects: &[Value]) -> anyhow::Result<(bool, bool)> {
    Ok((
        env_value(objects, "REMORA_WORKLOAD_CA")? == Some("true"),
        env_value(objects, "REMORA_DISCOVERY")? == Some("true"),
    ))
}

/// The workload CA and discovery default to "auto": a new install gets both
/// (mTLS between meshed workloads out of the box); `helm upgrade` keeps what
/// the release's operator Deployment runs with, so an install made with
/// both off is not turned on (which would change every injected pod's
/// restart hash) by a chart upgrade; true and false always win; discovery
/// on with the CA off is refused, saying why. The upgrade renders look the
/// Deployment up in the real API server, as `helm upgrade` does.
#[tokio::test]
async fn mesh_defaults_are_on_for_a_new_install_and_kept_on_upgrade() -> anyhow::Result<()> {
    let fresh = |sets: &[&str]| -> anyhow::Result<(bool, bool)> {
        mesh(&e2e::chart::render("remora", "remora-system", sets)?)
    };
    // A new install (`helm template` and `helm install` look up nothing).
    assert_eq!(fresh(&[])?, (true, true), "a new install's defaults");
    // Explicit values win.
    assert_eq!(fresh(&["workloadCA.enabled=false"])?, (false, false));
    assert_eq!(fresh(&["discovery.enabled=false"])?, (true, false));
    assert_eq!(
        fresh(&["workloadCA.enabled=true", "discovery.enabled=true"])?,
        (true, true)
    );
    // Discovery needs the CA: asked for without it, refused by name.
    for sets in [
        &["workloadCA.enabled=false", "discovery.enabled=true"][..],
        &[
            "workloadCA.enabled=false",
            "discovery.enabled=true",
            "rollouts.automatic=true",
        ][..],
    ] {
        let err = e2e::chart::render("remora", "remora-system", sets)
            .err()
            .with_context(|| format!("{sets:?} rendered"))?
            .to_string();
        assert!(
            err.contains("discovery.enabled needs workloadCA.enabled")
                && err.contains("workloadCA.enabled to true"),
            "{err}"
        );
    }
    // Anything but true, false or auto: refused by the schema.
    for bad in ["workloadCA.enabled=yes", "discovery.enabled=on"] {
        let err = e2e::chart::render("remora", "remora-system", &[bad])
            .err()
            .with_context(|| format!("{bad} rendered"))?
            .to_string();
        assert!(err.contains("enabled"), "{bad}: {err}");
    }

    // Upgrades, against what is installed.
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "chart-mesh").await?;
    let release = "remora";
    let upgrade = |sets: &[&str]| -> anyhow::Result<(bool, bool)> {
        mesh(&e2e::chart::render_with(
            release,
            &ns,
            sets,
            Some(cp.kubeconfig()),
        )?)
    };
    // No operator Deployment to ask: an upgrade turns nothing on.
    assert_eq!(upgrade(&[])?, (false, false), "upgrade, nothing installed");
    // Installed as the chart before the defaults changed (both off), and as
    // the defaults or a user left it: what runs is kept.
    for (installed, want) in [
        (&["workloadCA.enabled=false"][..], (false, false)),
        (&["discovery.enabled=false"][..], (true, false)),
        (&[][..], (true, true)),
    ] {
        let objects = e2e::chart::render(release, &ns, installed)?;
        e2e::chart::apply(&client, &ns, &objects, &["Deployment"]).await?;
        assert_eq!(
            upgrade(&[])?,
            want,
            "upgrade of an install with {installed:?}"
        );
        // Explicit values still win on upgrade.
        assert_eq!(
            upgrade(&["workloadCA.enabled=true", "discovery.enabled=true"])?,
            (true, true),
            "explicit on, over {installed:?}"
        );
        assert_eq!(
            upgrade(&["workloadCA.enabled=false"])?,
            (false, false),
            "explicit off, over {installed:?}"
        );
        // Discovery asked for on an install without the CA: refused.
        if !want.0 {
            let err = e2e::chart::render_with(
                release,
                &ns,
                &["discovery.enabled=true"],
                Some(cp.kubeconfig()),
            )
            .err()
            .context("discovery on over an install without the CA rendered")?
            .to_string();
            assert!(
                err.contains("discovery.enabled needs workloadCA.enabled"),
                "{err}"
            );
        }
    }
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

/// The chart's cluster-default SidecarLifecycle says what the built-in
/// defaults say (values.yaml: "the same values as below"): a default changed
/// in one place and not the other fails here.
#[test]
fn the_cluster_default_is_the_built_in_defaults() -> anyhow::Result<()> {
    use remora_contract::defaults as d;
    let objects = e2e::chart::render("remora", "remora-system", &[])?;
    let spec = &find(&objects, "SidecarLifecycle")?["spec"];
    let dur = |v: &Value| -> anyhow::Result<Duration> {
        let s = v.as_str().with_context(|| format!("not a duration: {v}"))?;
        Ok(remora_contract::duration::parse(s)?)
    };
    let (startup, shutdown) = (&spec["startup"], &spec["shutdown"]);
    for (what, got, want) in [
        ("startup.timeout", &startup["timeout"], d::STARTUP_TIMEOUT),
        (
            "shutdown.quietPeriod",
            &shutdown["quietPeriod"],
            d::QUIET_PERIOD,
        ),
        (
            "shutdown.withdrawalTimeout",
            &shutdown["withdrawalTimeout"],
            d::WITHDRAWAL_TIMEOUT,
        ),
        (
            "shutdown.drainDuration",
            &shutdown["drainDuration"],
            d::DRAIN_DURATION,
        ),
        (
            "shutdown.terminationDrainDuration",
            &shutdown["terminationDrainDuration"],
            d::TERMINATION_DRAIN_DURATION,
        ),
        (
            "shutdown.minimumDrainDuration",
            &shutdown["minimumDrainDuration"],
            d::MINIMUM_DRAIN_DURATION,
        ),
    ] {
        assert_eq!(dur(got)?, remora_contract::duration::parse(want)?, "{what}");
    }
    assert_eq!(
        startup["holdApplicationUntilProxyStarts"],
        d::HOLD_APPLICATION_UNTIL_PROXY_STARTS
    );
    assert_eq!(
        shutdown["exitOnZeroActiveConnections"],
        d::EXIT_ON_ZERO_ACTIVE_CONNECTIONS
    );
    assert_eq!(shutdown["drainMode"], serde_json::to_value(d::DRAIN_MODE)?);
    Ok(())
}
