//! The status of each `SidecarLifecycle`: which pods it applies to, whether
//! an older resource wins over it, and whether its pods run with it. The
//! computation is pure; [`run`] feeds it from the reflectors and writes the
//! status subresource when it changed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::Store;
use kube::{Api, Client};
use remora_crds::{SidecarLifecycle, SidecarLifecycleStatus, condition};

use remora_agent::lifecycle::{LIFECYCLE_ANNOTATION, LifecycleAnnotation};

use crate::config::{ChartDefaults, EffectiveConfig, LifecycleEntry, resolve};
use crate::mutate::{STATUS_ANNOTATION, lifecycle_annotation};

/// What the status needs to know about a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    /// The layers recorded in `remora.dev/status`; `None` when not injected.
    pub sources: Option<Vec<String>>,
}

impl PodInfo {
    pub fn from_meta(p: &PartialObjectMeta<Pod>) -> Self {
        let sources = p
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(STATUS_ANNOTATION))
            .map(|s| {
                serde_json::from_str::<serde_json::Value>(s)
                    .ok()
                    .and_then(|v| {
                        v["sources"].as_array().map(|a| {
                            a.iter()
                                .filter_map(|s| s.as_str().map(str::to_string))
                                .collect()
                        })
                    })
                    .unwrap_or_default()
            });
        Self {
            namespace: p.metadata.namespace.clone().unwrap_or_default(),
            labels: p.metadata.labels.clone().unwrap_or_default(),
            sources,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layer {
    Cluster,
    Namespace,
    Workload,
}

fn layer(e: &LifecycleEntry, operator_ns: &str) -> Layer {
    match &e.spec.selector {
        Some(_) => Layer::Workload,
        None if e.namespace == operator_ns => Layer::Cluster,
        None => Layer::Namespace,
    }
}

fn applies(e: &LifecycleEntry, l: Layer, pod: &PodInfo, operator_ns: &str) -> bool {
    match l {
        Layer::Cluster => true,
        // The operator's namespace gets the cluster default once, as in `resolve`.
        Layer::Namespace => pod.namespace == e.namespace && pod.namespace != operator_ns,
        Layer::Workload => {
            pod.namespace == e.namespace
                && e.spec
                    .selector
                    .as_ref()
                    .is_some_and(|s| s.matches(&pod.labels))
        }
    }
}

fn label(e: &LifecycleEntry, l: Layer) -> String {
    let layer = match l {
        Layer::Cluster => "cluster",
        Layer::Namespace => "namespace",
        Layer::Workload => "workload",
    };
    format!("{layer}:{}/{}", e.namespace, e.name)
}

fn age_key(e: &LifecycleEntry) -> (bool, Option<String>, String) {
    (e.created.is_none(), e.created.clone(), e.name.clone())
}

fn cond(
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time: now.clone(),
    }
}

/// The status `entry` should have, given every resource and every pod.
pub fn compute(
    entry: &LifecycleEntry,
    generation: Option<i64>,
    all: &[LifecycleEntry],
    pods: &[PodInfo],
    operator_ns: &str,
    previous: Option<&SidecarLifecycleStatus>,
    now: Time,
) -> SidecarLifecycleStatus {
    let l = layer(entry, operator_ns);
    let me = age_key(entry);
    let (mut matched, mut applied) = (0i32, 0i32);
    let mut winners: BTreeMap<String, usize> = BTreeMap::new();
    for pod in pods.iter().filter(|p| applies(entry, l, p, operator_ns)) {
        let winner = all
            .iter()
            .filter(|o| layer(o, operator_ns) == l && applies(o, l, pod, operator_ns))
            .min_by_key(|o| age_key(o));
        match winner {
            Some(w) if age_key(w) < me => *winners.entry(w.name.clone()).or_default() += 1,
            _ => {
                matched += 1;
                if pod
                    .sources
                    .as_ref()
                    .is_some_and(|s| s.contains(&label(entry, l)))
                {
                    applied += 1;
                }
            }
        }
    }
    // Two selector-less resources of one namespace always overlap.
    if l != Layer::Workload {
        for o in all.iter().filter(|o| {
            o.namespace == entry.namespace && layer(o, operator_ns) == l && age_key(o) < me
        }) {
            winners.entry(o.name.clone()).or_default();
        }
    }
    let bad: Vec<String> = [
        entry.spec.startup.as_ref().and_then(|s| s.timeout.as_ref()),
        entry
            .spec
            .shutdown
            .as_ref()
            .and_then(|s| s.drain_duration.as_ref()),
        entry
            .spec
            .shutdown
            .as_ref()
            .and_then(|s| s.termination_drain_duration.as_ref()),
        entry
            .spec
            .shutdown
            .as_ref()
            .and_then(|s| s.minimum_drain_duration.as_ref()),
    ]
    .into_iter()
    .flatten()
    .filter_map(|d| d.parse().err())
    .collect();
    let mut conditions = vec![
        if bad.is_empty() {
            cond(
                condition::ACCEPTED,
                true,
                "Valid",
                "the spec is valid".into(),
                generation,
                &now,
            )
        } else {
            cond(
                condition::ACCEPTED,
                false,
                "InvalidDuration",
                bad.join("; "),
                generation,
                &now,
            )
        },
        if winners.is_empty() {
            cond(
                condition::CONFLICTED,
                false,
                "NoConflict",
                "no older resource selects these pods".into(),
                generation,
                &now,
            )
        } else {
            let names: Vec<String> = winners.keys().cloned().collect();
            cond(
                condition::CONFLICTED,
                true,
                "OlderResourceWins",
                format!(
                    "older resources win where they overlap: {}",
                    names.join(", ")
                ),
                generation,
                &now,
            )
        },
        if applied == matched {
            cond(
                condition::APPLIED,
                true,
                "PodsCurrent",
                format!("{matched} matched pods run with this resource"),
                generation,
                &now,
            )
        } else {
            cond(
                condition::APPLIED,
                false,
                "PodsPending",
                format!(
                    "{} of {matched} matched pods were injected without this resource; they get it when recreated",
                    matched - applied
                ),
                generation,
                &now,
            )
        },
    ];
    // Keep the transition time of a condition whose status did not change.
    if let Some(prev) = previous {
        for c in &mut conditions {
            if let Some(p) = prev
                .conditions
                .iter()
                .find(|p| p.type_ == c.type_ && p.status == c.status)
            {
                c.last_transition_time = p.last_transition_time.clone();
            }
        }
    }
    SidecarLifecycleStatus {
        observed_generation: generation,
        matched_pods: Some(matched),
        conditions,
    }
}

/// The `remora.dev/lifecycle` a running pod should now carry: its startup
/// and shutdown settings from `cfg`, its mode and drain deadline unchanged
/// (both are fixed for the pod's life). `None` when nothing changes or the
/// current value is unreadable (that pod is left alone).
pub fn refreshed_lifecycle(current: &str, cfg: &EffectiveConfig) -> Option<String> {
    let old: LifecycleAnnotation = serde_json::from_str(current).ok()?;
    let fresh = lifecycle_annotation(cfg, cfg.mode, Duration::ZERO);
    let new = LifecycleAnnotation {
        startup: fresh.startup,
        shutdown: fresh.shutdown,
        ..old.clone()
    };
    if new == old {
        return None;
    }
    serde_json::to_string(&new).ok()
}

/// Every `period`: recompute every status and patch the ones that changed,
/// and bring the lifecycle annotation of running injected pods up to date
/// (the agent reads it at drain time, so a change reaches them live).
pub async fn run(
    client: Client,
    lifecycles: Store<SidecarLifecycle>,
    pods: Store<PartialObjectMeta<Pod>>,
    chart: ChartDefaults,
    operator_ns: String,
    period: Duration,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let resources: Vec<Arc<SidecarLifecycle>> = lifecycles.state();
        let entries: Vec<LifecycleEntry> = resources
            .iter()
            .map(|r| LifecycleEntry::from_resource(r))
            .collect();
        let pod_infos: Vec<PodInfo> = pods.state().iter().map(|p| PodInfo::from_meta(p)).collect();
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        for (r, e) in resources.iter().zip(&entries) {
            let status = compute(
                e,
                r.metadata.generation,
                &entries,
                &pod_infos,
                &operator_ns,
                r.status.as_ref(),
                now.clone(),
            );
            if r.status.as_ref() == Some(&status) {
                continue;
            }
            let api: Api<SidecarLifecycle> = Api::namespaced(client.clone(), &e.namespace);
            let patch = Patch::Merge(serde_json::json!({ "status": status }));
            if let Err(err) = api
                .patch_status(&e.name, &PatchParams::default(), &patch)
                .await
            {
                tracing::warn!(resource = %format!("{}/{}", e.namespace, e.name), error = %err, "cannot update status");
            }
        }
        for p in pods.state() {
            let ann = p.metadata.annotations.clone().unwrap_or_default();
            let Some(current) = ann.get(LIFECYCLE_ANNOTATION) else {
                continue;
            };
            if !ann.contains_key(STATUS_ANNOTATION) {
                continue;
            }
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            let labels = p.metadata.labels.clone().unwrap_or_default();
            let cfg = resolve(&chart, &entries, &operator_ns, &ns, &labels, &ann);
            let Some(fresh) = refreshed_lifecycle(current, &cfg) else {
                continue;
            };
            let name = p.metadata.name.clone().unwrap_or_default();
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
            let patch = Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {LIFECYCLE_ANNOTATION: fresh}}}),
            );
            match api
                .patch_metadata(&name, &PatchParams::default(), &patch)
                .await
            {
                Ok(_) => {
                    tracing::info!(pod = %format!("{ns}/{name}"), "lifecycle annotation updated")
                }
                Err(err) => tracing::warn!(pod = %format!("{ns}/{name}"), error = %err,
                    "cannot update the lifecycle annotation"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use remora_crds::{SidecarLifecycleSpec, WorkloadSelector};

    fn entry(ns: &str, name: &str, day: u32, sel: Option<(&str, &str)>) -> LifecycleEntry {
        LifecycleEntry {
            namespace: ns.into(),
            name: name.into(),
            created: Some(format!("2026-01-{day:02}T00:00:00Z")),
            spec: SidecarLifecycleSpec {
                selector: sel.map(|(k, v)| WorkloadSelector {
                    match_labels: BTreeMap::from([(k.to_string(), v.to_string())]),
                }),
                ..Default::default()
            },
        }
    }

    fn pod(ns: &str, app: &str, sources: Option<&[&str]>) -> PodInfo {
        PodInfo {
            namespace: ns.into(),
            labels: BTreeMap::from([("app".to_string(), app.to_string())]),
            sources: sources.map(|s| s.iter().map(|s| s.to_string()).collect()),
        }
    }

    fn get<'a>(s: &'a SidecarLifecycleStatus, t: &str) -> &'a Condition {
        s.conditions
            .iter()
            .find(|c| c.type_ == t)
            .expect("condition")
    }

    fn now() -> Time {
        Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)
    }

    #[test]
    fn older_overlapping_selector_wins_and_newer_is_conflicted() {
        let old = entry("shop", "old", 1, Some(("app", "web")));
        let new = entry("shop", "new", 2, Some(("app", "web")));
        let all = vec![new.clone(), old.clone()];
        let pods = vec![
            pod("shop", "web", Some(&["defaults", "workload:shop/old"])),
            pod("shop", "web", None),
            pod("shop", "db", None),
            pod("other", "web", None),
        ];
        let s = compute(&old, Some(3), &all, &pods, "remora-system", None, now());
        assert_eq!(s.matched_pods, Some(2));
        assert_eq!(s.observed_generation, Some(3));
        assert_eq!(get(&s, "Conflicted").status, "False");
        assert_eq!(
            get(&s, "Applied").status,
            "False",
            "one matched pod was not injected with it"
        );
        let s = compute(&new, Some(1), &all, &pods, "remora-system", None, now());
        assert_eq!(s.matched_pods, Some(0));
        assert_eq!(get(&s, "Conflicted").status, "True");
        assert!(get(&s, "Conflicted").message.contains("old"));
        assert_eq!(get(&s, "Accepted").status, "True");
    }

    #[test]
    fn running_pods_get_new_drain_settings_but_keep_mode_and_deadline() {
        let mut cfg = EffectiveConfig::from_defaults(&ChartDefaults::default());
        let current = r#"{"mode":"Legacy","startup":{"holdApplicationUntilProxyStarts":true,"timeout":"1m"},"shutdown":{"drainDuration":"45s","terminationDrainDuration":"5s","exitOnZeroActiveConnections":false,"minimumDrainDuration":"5s"},"drainDeadline":"55s"}"#;
        assert_eq!(refreshed_lifecycle(current, &cfg), None, "unchanged");
        cfg.exit_on_zero_active_connections = true;
        cfg.mode = remora_crds::SidecarMode::Native;
        let fresh = refreshed_lifecycle(current, &cfg).expect("changed");
        let l: LifecycleAnnotation = serde_json::from_str(&fresh).expect("json");
        assert_eq!(l.mode.as_deref(), Some("Legacy"));
        assert_eq!(l.drain_deadline.as_deref(), Some("55s"));
        assert_eq!(
            l.shutdown.and_then(|s| s.exit_on_zero_active_connections),
            Some(true)
        );
        assert_eq!(refreshed_lifecycle("{broken", &cfg), None);
    }

    #[test]
    fn cluster_default_counts_every_pod_and_keeps_transition_times() {
        let def = entry("remora-system", "default", 1, None);
        let pods = vec![
            pod(
                "shop",
                "web",
                Some(&["defaults", "cluster:remora-system/default"]),
            ),
            pod(
                "remora-system",
                "x",
                Some(&["defaults", "cluster:remora-system/default"]),
            ),
        ];
        let first = compute(
            &def,
            Some(1),
            std::slice::from_ref(&def),
            &pods,
            "remora-system",
            None,
            now(),
        );
        assert_eq!(first.matched_pods, Some(2));
        assert_eq!(get(&first, "Applied").status, "True");
        let later = Time(
            k8s_openapi::jiff::Timestamp::from_second(1000)
                .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
        );
        let second = compute(
            &def,
            Some(1),
            std::slice::from_ref(&def),
            &pods,
            "remora-system",
            Some(&first),
            later,
        );
        assert_eq!(first, second, "nothing changed, nothing to write");
    }
}
