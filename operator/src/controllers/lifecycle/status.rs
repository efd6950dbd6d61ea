//! The status of each `SidecarLifecycle`: which pods it applies to, whether
//! an older resource wins over it, whether its pods run with it and whether
//! they need a restart. All of it is pure; [`crate::controllers::lifecycle`] feeds it
//! from its reflectors and acts on the result.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::ObjectMeta;
use remora_crds::{SidecarLifecycleStatus, condition};

use remora_contract::lifecycle::LifecycleAnnotation;

use crate::cluster::live_pod::{Labels, LivePod};
use remora_inject::patch::lifecycle_annotation;
use remora_inject::resolve::{
    ChartDefaults, EffectiveConfig, Layer, Layers, LifecycleEntry, layers, resolve,
};

/// What one resource's status and pods are computed from: the resources
/// of its own namespace, and its pods grouped by namespace, each group
/// with the resources that can reach it (those of that namespace and the
/// cluster defaults). A pod is reached only by resources of its own
/// namespace or cluster defaults, so the answer is the same as from every
/// resource and every pod, at the cost of the few that matter.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    /// The resources of the computed one's namespace (the cluster defaults'
    /// when it is one): where selector-less ones overlap.
    pub own: Vec<LifecycleEntry>,
    pub groups: Vec<Group>,
}

/// Pods of one namespace and the resources that can reach them.
#[derive(Debug, Clone, Default)]
pub struct Group {
    pub entries: Vec<LifecycleEntry>,
    pub pods: Vec<Arc<PodInfo>>,
}

impl Scope {
    /// The scope of `entry` among `entries` (every resource, or at least
    /// those of its namespace and the operator's). `pods(Some(ns))` gives
    /// the pods of `ns`, `pods(None)` every namespace's, by namespace.
    pub fn of(
        entry: &LifecycleEntry,
        entries: Vec<LifecycleEntry>,
        operator_ns: &str,
        pods: impl FnOnce(Option<&str>) -> Vec<(String, Vec<Arc<PodInfo>>)>,
    ) -> Self {
        let cluster_wide = Layer::of(entry, operator_ns) == Layer::Cluster;
        let mut by_ns: HashMap<String, Vec<LifecycleEntry>> = HashMap::new();
        for e in entries {
            by_ns.entry(e.namespace.clone()).or_default().push(e);
        }
        let defaults: Vec<LifecycleEntry> = by_ns
            .get(operator_ns)
            .into_iter()
            .flatten()
            .filter(|e| Layer::of(e, operator_ns) == Layer::Cluster)
            .cloned()
            .collect();
        let reachable = |ns: &str| -> Vec<LifecycleEntry> {
            let mut v = by_ns.get(ns).cloned().unwrap_or_default();
            if ns != operator_ns {
                v.extend(defaults.iter().cloned());
            }
            v
        };
        let groups = pods((!cluster_wide).then_some(entry.namespace.as_str()))
            .into_iter()
            .map(|(ns, pods)| Group {
                entries: reachable(&ns),
                pods,
            })
            .collect();
        Self {
            own: by_ns.remove(&entry.namespace).unwrap_or_default(),
            groups,
        }
    }

    /// Every resource and every pod in one group: what the grouped
    /// computation must agree with.
    pub fn whole(all: &[LifecycleEntry], pods: &[PodInfo]) -> Self {
        Self {
            own: all.to_vec(),
            groups: vec![Group {
                entries: all.to_vec(),
                pods: pods.iter().cloned().map(Arc::new).collect(),
            }],
        }
    }
}

/// A pod and the settings it should run with now.
#[derive(Debug, Clone)]
pub struct Governed {
    pub pod: Arc<PodInfo>,
    pub cfg: EffectiveConfig,
}

/// What the controller needs to know about a pod, all of it metadata: the
/// pod as the leader's watch stored it, shared with the store, not copied:
/// the leader holds every pod of the cluster once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodInfo {
    pod: Arc<LivePod>,
}

/// A pod's controlling ownerReference.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodOwner {
    pub kind: String,
    pub name: String,
    pub uid: String,
}

impl PodInfo {
    /// The pod the watch stored ([`crate::cluster::live_pod::Slim::slim`]).
    pub fn of(pod: Arc<LivePod>) -> Self {
        Self { pod }
    }

    /// A pod of these metadata (a workload's pod template, say).
    pub fn from_meta(metadata: ObjectMeta) -> Self {
        Self::of(Arc::new(LivePod::from_meta(metadata)))
    }

    pub fn namespace(&self) -> &str {
        self.pod.metadata.namespace.as_deref().unwrap_or_default()
    }

    pub fn name(&self) -> &str {
        self.pod.metadata.name.as_deref().unwrap_or_default()
    }

    pub fn uid(&self) -> Option<&str> {
        self.pod.metadata.uid.as_deref()
    }

    pub fn labels(&self) -> &Labels {
        self.pod.labels()
    }

    /// The pod's own settings are among them.
    pub fn annotations(&self) -> &BTreeMap<String, String> {
        self.pod.annotations()
    }

    /// `remora.dev/lifecycle`: the settings the sidecar runs with.
    pub fn lifecycle(&self) -> Option<&str> {
        self.pod.lifecycle()
    }

    /// The layers recorded in `remora.dev/status`; `None` when not injected.
    pub fn sources(&self) -> Option<&[Box<str>]> {
        self.pod.injected().map(|i| &*i.sources)
    }

    /// `restartHash` from `remora.dev/status`, when the operator recorded one.
    pub fn restart_hash(&self) -> Option<&str> {
        self.pod.injected()?.restart_hash.as_deref()
    }

    /// The controlling owner as the pod's ownerReference names it. Anyone
    /// who may create pods may write it: the rollout checks it against the
    /// API server before acting on it.
    pub fn owner(&self) -> Option<PodOwner> {
        self.pod
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| PodOwner {
                kind: o.kind.clone(),
                name: o.name.clone(),
                uid: o.uid.clone(),
            })
    }

    /// The resources this pod's settings come from, one per layer.
    pub fn layers<'a>(&self, all: &'a [LifecycleEntry], operator_ns: &str) -> Layers<'a> {
        layers(all, operator_ns, self.namespace(), self.labels())
    }

    /// The settings this pod should run with now.
    pub fn effective(
        &self,
        chart: &ChartDefaults,
        all: &[LifecycleEntry],
        operator_ns: &str,
    ) -> EffectiveConfig {
        resolve(
            chart,
            all,
            operator_ns,
            self.namespace(),
            self.labels(),
            self.annotations(),
        )
    }
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
    scope: &Scope,
    operator_ns: &str,
    previous: Option<&SidecarLifecycleStatus>,
    now: Time,
) -> SidecarLifecycleStatus {
    let l = Layer::of(entry, operator_ns);
    let mine = entry.source(l);
    let (mut matched, mut applied) = (0i32, 0i32);
    let mut winners: BTreeMap<String, usize> = BTreeMap::new();
    for group in &scope.groups {
        for pod in group
            .pods
            .iter()
            .filter(|p| entry.reaches(operator_ns, p.namespace(), p.labels()))
        {
            let winner = pod.layers(&group.entries, operator_ns).get(l);
            match winner {
                Some(w) if w.wins_over(entry) => *winners.entry(w.name.clone()).or_default() += 1,
                _ => {
                    matched = matched.saturating_add(1);
                    if pod
                        .sources()
                        .is_some_and(|s| s.iter().any(|l| **l == *mine))
                    {
                        applied = applied.saturating_add(1);
                    }
                }
            }
        }
    }
    // Two selector-less resources of one namespace always overlap.
    if l != Layer::Workload {
        for o in scope.own.iter().filter(|o| {
            o.namespace == entry.namespace && Layer::of(o, operator_ns) == l && o.wins_over(entry)
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
        entry
            .spec
            .shutdown
            .as_ref()
            .and_then(|s| s.quiet_period.as_ref()),
        entry
            .spec
            .shutdown
            .as_ref()
            .and_then(|s| s.withdrawal_timeout.as_ref()),
    ]
    .into_iter()
    .flatten()
    .filter_map(|d| d.parse().err().map(|e| e.to_string()))
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
    keep_transition_times(&mut conditions, previous);
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

/// Whether `entry` takes part in `pod`'s settings (at its own layer; an
/// older resource of the same layer may still win).
pub fn reaches(entry: &LifecycleEntry, pod: &PodInfo, operator_ns: &str) -> bool {
    entry.reaches(operator_ns, pod.namespace(), pod.labels())
}

/// The resource that decides for `pod` whether it is restarted: the winner
/// of the strongest layer that reaches it. Every pod has at most one.
pub fn governor<'a>(
    all: &'a [LifecycleEntry],
    pod: &PodInfo,
    operator_ns: &str,
) -> Option<&'a LifecycleEntry> {
    pod.layers(all, operator_ns).strongest().map(|(_, e)| e)
}

/// The injected pods `entry` governs (see [`governor`]), each with the
/// settings it should run with now. Every injected pod is governed by at
/// most one resource, so a change reaching many resources' pods is written
/// once per pod, by the reconcile of its governor.
pub fn governed(
    entry: &LifecycleEntry,
    scope: &Scope,
    chart: &ChartDefaults,
    operator_ns: &str,
) -> Vec<Governed> {
    settings_where(scope, chart, operator_ns, |all, pod| {
        governor(all, pod, operator_ns)
            .is_some_and(|g| g.namespace == entry.namespace && g.name == entry.name)
    })
}

/// The injected pods `entry` reaches at its layer, each with the settings
/// it should run with now: when `entry` is gone (and not in `scope`), what
/// its pods fall back to.
pub fn reached(
    entry: &LifecycleEntry,
    scope: &Scope,
    chart: &ChartDefaults,
    operator_ns: &str,
) -> Vec<Governed> {
    settings_where(scope, chart, operator_ns, |_, pod| {
        reaches(entry, pod, operator_ns)
    })
}

fn settings_where(
    scope: &Scope,
    chart: &ChartDefaults,
    operator_ns: &str,
    pick: impl Fn(&[LifecycleEntry], &PodInfo) -> bool,
) -> Vec<Governed> {
    scope
        .groups
        .iter()
        .flat_map(|g| {
            g.pods
                .iter()
                .filter(|p| p.sources().is_some() && pick(&g.entries, p))
                .map(|p| Governed {
                    pod: Arc::clone(p),
                    cfg: p.effective(chart, &g.entries, operator_ns),
                })
        })
        .collect()
}

/// The pods a resource governs whose sidecar runs with settings that only
/// a restart applies.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RestartReport {
    pub governed: usize,
    /// Each outdated pod with the restart hash it should have.
    pub outdated: Vec<(Arc<PodInfo>, String)>,
}

/// What a restart would change among `governed` (from [`governed`]).
pub fn restart_report(governed: &[Governed]) -> RestartReport {
    let mut report = RestartReport {
        governed: governed.len(),
        outdated: Vec::new(),
    };
    for g in governed {
        let want = g.cfg.restart_hash();
        // A pod injected before restart hashes were recorded is not judged.
        if g.pod.restart_hash().is_some_and(|h| h != want) {
            report.outdated.push((Arc::clone(&g.pod), want));
        }
    }
    report
}

/// Who restarts a resource's outdated pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restarts {
    /// rolloutPolicy Manual: the workloads' owners.
    Manual,
    /// rolloutPolicy Automatic: the controller rolls the workloads.
    Automatic,
    /// rolloutPolicy Automatic in an installation that does not roll
    /// workloads (`--automatic-rollouts=false`, the chart's
    /// `rollouts.automatic`): the owners, and the status says why.
    AutomaticDisabled,
}

/// The `RestartRequired` condition for `report`.
pub fn restart_condition(
    report: &RestartReport,
    restarts: Restarts,
    generation: Option<i64>,
    now: &Time,
) -> Condition {
    if report.outdated.is_empty() {
        return cond(
            condition::RESTART_REQUIRED,
            false,
            "PodsCurrent",
            format!(
                "all {} governed pods run with the current proxy settings",
                report.governed
            ),
            generation,
            now,
        );
    }
    let (reason, how) = match restarts {
        Restarts::Automatic => (
            "RollingOut",
            "rolloutPolicy Automatic: their workloads are being rolled",
        ),
        Restarts::Manual => (
            "ManualRestartNeeded",
            "rolloutPolicy Manual: restart their workloads (kubectl rollout restart)",
        ),
        Restarts::AutomaticDisabled => (
            "AutomaticRolloutsDisabled",
            "rolloutPolicy Automatic, but this installation does not roll workloads \
             (chart value rollouts.automatic=false): restart them (kubectl rollout restart), \
             or have the cluster admin set rollouts.automatic=true",
        ),
    };
    cond(
        condition::RESTART_REQUIRED,
        true,
        reason,
        format!(
            "{} of {} governed pods run with mode, image, startup, concurrency, log level or resources that only a restart applies; {how}",
            report.outdated.len(),
            report.governed
        ),
        generation,
        now,
    )
}

/// Keep the transition time of each condition whose status did not change.
pub fn keep_transition_times(
    conditions: &mut [Condition],
    previous: Option<&SidecarLifecycleStatus>,
) {
    let Some(prev) = previous else { return };
    for c in conditions {
        if let Some(p) = prev
            .conditions
            .iter()
            .find(|p| p.type_ == c.type_ && p.status == c.status)
        {
            c.last_transition_time = p.last_transition_time.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use remora_contract::annotations::STATUS;
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
        labelled(ns, &format!("{app}-1"), &[("app", app)], sources)
    }

    fn labelled(
        ns: &str,
        name: &str,
        labels: &[(&str, &str)],
        sources: Option<&[&str]>,
    ) -> PodInfo {
        injected(ns, name, labels, sources, None)
    }

    /// A pod whose `remora.dev/status` records `sources` (none: not
    /// injected) and `restart_hash`.
    fn injected(
        ns: &str,
        name: &str,
        labels: &[(&str, &str)],
        sources: Option<&[&str]>,
        restart_hash: Option<&str>,
    ) -> PodInfo {
        let status = sources
            .map(|s| serde_json::json!({ "sources": s, "restartHash": restart_hash }).to_string());
        PodInfo::from_meta(ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            annotations: status.map(|s| [(STATUS.to_string(), s)].into()),
            ..ObjectMeta::default()
        })
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
        let s = compute(
            &old,
            Some(3),
            &Scope::whole(&all, &pods),
            "remora-system",
            None,
            now(),
        );
        assert_eq!(s.matched_pods, Some(2));
        assert_eq!(s.observed_generation, Some(3));
        assert_eq!(get(&s, "Conflicted").status, "False");
        assert_eq!(
            get(&s, "Applied").status,
            "False",
            "one matched pod was not injected with it"
        );
        let s = compute(
            &new,
            Some(1),
            &Scope::whole(&all, &pods),
            "remora-system",
            None,
            now(),
        );
        assert_eq!(s.matched_pods, Some(0));
        assert_eq!(get(&s, "Conflicted").status, "True");
        assert!(get(&s, "Conflicted").message.contains("old"));
        assert_eq!(get(&s, "Accepted").status, "True");
    }

    /// The pods of `pods` by namespace, as the controller's index gives
    /// them.
    fn by_namespace(pods: &[PodInfo], ns: Option<&str>) -> Vec<(String, Vec<Arc<PodInfo>>)> {
        let mut m: BTreeMap<String, Vec<Arc<PodInfo>>> = BTreeMap::new();
        for p in pods
            .iter()
            .filter(|p| ns.is_none_or(|ns| p.namespace() == ns))
        {
            m.entry(p.namespace().to_string())
                .or_default()
                .push(Arc::new(p.clone()));
        }
        m.into_iter().collect()
    }

    type Picker = fn(&LifecycleEntry, &Scope, &ChartDefaults, &str) -> Vec<Governed>;

    fn names(g: &[Governed]) -> Vec<(String, String, String)> {
        let mut v: Vec<_> = g
            .iter()
            .map(|g| {
                (
                    g.pod.namespace().to_string(),
                    g.pod.name().to_string(),
                    g.cfg.restart_hash(),
                )
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_scope_of_the_reachable_namespaces_agrees_with_every_resource_and_pod() {
        let sys = "remora-system";
        let mut tier = entry("shop", "front", 6, Some(("tier", "front")));
        tier.spec.shutdown = Some(remora_crds::ShutdownSpec {
            quiet_period: Some(remora_crds::DurationString("7s".into())),
            ..Default::default()
        });
        let all = vec![
            entry(sys, "default", 1, None),
            entry(sys, "default-late", 5, None),
            entry(sys, "sys-web", 2, Some(("app", "web"))),
            entry("shop", "wide", 3, None),
            entry("shop", "wide-late", 4, None),
            entry("shop", "web", 2, Some(("app", "web"))),
            tier,
            entry("other", "web", 9, Some(("app", "web"))),
        ];
        let mut pods = Vec::new();
        for (ns, app, tier) in [
            ("shop", "web", "front"),
            ("shop", "db", "front"),
            ("shop", "db", "back"),
            ("other", "web", "back"),
            ("other", "db", "back"),
            (sys, "web", "back"),
            ("bare", "web", "front"),
        ] {
            for i in 0..2 {
                pods.push(labelled(
                    ns,
                    &format!("{app}-{tier}-{i}"),
                    &[("app", app), ("tier", tier)],
                    Some(&["defaults"]),
                ));
            }
        }
        // One not injected: counted, never governed.
        pods.push(pod("shop", "web", None));
        let chart = ChartDefaults::default();
        let whole = Scope::whole(&all, &pods);
        for e in &all {
            let scoped = Scope::of(e, all.clone(), sys, |ns| by_namespace(&pods, ns));
            assert_eq!(
                compute(e, Some(1), &scoped, sys, None, now()),
                compute(e, Some(1), &whole, sys, None, now()),
                "status of {}/{}",
                e.namespace,
                e.name
            );
            for (what, pick) in [("governed", governed as Picker), ("reached", reached)] {
                assert_eq!(
                    names(&pick(e, &scoped, &chart, sys)),
                    names(&pick(e, &whole, &chart, sys)),
                    "pods {what} by {}/{}",
                    e.namespace,
                    e.name
                );
            }
        }
        // Every injected pod has one governor, so each is retuned once.
        let total: usize = all
            .iter()
            .map(|e| governed(e, &whole, &chart, sys).len())
            .sum();
        assert_eq!(total, pods.iter().filter(|p| p.sources().is_some()).count());
    }

    #[test]
    fn running_pods_get_new_drain_settings_but_keep_mode_and_deadline() {
        let mut cfg = EffectiveConfig::from_defaults(&ChartDefaults::default());
        let current = r#"{"mode":"Legacy","startup":{"holdApplicationUntilProxyStarts":true,"timeout":"1m"},"shutdown":{"drainDuration":"45s","terminationDrainDuration":"5s","exitOnZeroActiveConnections":false,"minimumDrainDuration":"5s","drainMode":"Adaptive","quietPeriod":"5s","withdrawalTimeout":"5s"},"drainDeadline":"55s"}"#;
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
            &Scope::whole(std::slice::from_ref(&def), &pods),
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
            &Scope::whole(std::slice::from_ref(&def), &pods),
            "remora-system",
            Some(&first),
            later,
        );
        assert_eq!(first, second, "nothing changed, nothing to write");
    }

    #[test]
    fn the_strongest_layer_governs_a_pod() {
        let cluster = entry("remora-system", "default", 1, None);
        let ns = entry("shop", "ns", 2, None);
        let old = entry("shop", "web-old", 3, Some(("app", "web")));
        let new = entry("shop", "web-new", 4, Some(("app", "web")));
        let all = vec![cluster.clone(), ns.clone(), new, old];
        let web = pod("shop", "web", Some(&[]));
        let db = pod("shop", "db", Some(&[]));
        let elsewhere = pod("other", "web", Some(&[]));
        let g = |p: &PodInfo| governor(&all, p, "remora-system").map(|e| e.name.clone());
        assert_eq!(
            g(&web).as_deref(),
            Some("web-old"),
            "older workload resource"
        );
        assert_eq!(g(&db).as_deref(), Some("ns"));
        assert_eq!(g(&elsewhere).as_deref(), Some("default"));
        assert!(reaches(&ns, &web, "remora-system"));
        assert!(!reaches(&ns, &elsewhere, "remora-system"));
    }

    #[test]
    fn a_restart_setting_change_outdates_governed_pods_only() {
        let chart = ChartDefaults::default();
        let mut e = entry("shop", "web", 1, Some(("app", "web")));
        let all = vec![e.clone()];
        let web = [("app", "web")];
        let want = pod("shop", "web", Some(&[]))
            .effective(&chart, &all, "remora-system")
            .restart_hash();
        let sources = Some(&["workload:shop/web"][..]);
        let current = injected("shop", "web-1", &web, sources, Some(&want));
        let legacy = injected("shop", "web-1", &web, Some(&[]), None);
        let other = pod("shop", "db", Some(&[]));
        let pods = vec![current.clone(), legacy, other];
        let r = restart_report(&governed(
            &e,
            &Scope::whole(&all, &pods),
            &chart,
            "remora-system",
        ));
        assert_eq!((r.governed, r.outdated.len()), (2, 0));
        assert_eq!(
            restart_condition(&r, Restarts::Manual, Some(1), &now()).status,
            "False"
        );

        // Concurrency is baked into the pod spec: a change needs a restart.
        e.spec.proxy = Some(remora_crds::ProxySpec {
            concurrency: Some(4),
            ..Default::default()
        });
        let all = vec![e.clone()];
        let r = restart_report(&governed(
            &e,
            &Scope::whole(&all, &pods),
            &chart,
            "remora-system",
        ));
        assert_eq!(
            r.outdated.len(),
            1,
            "the pod without a recorded hash is not judged"
        );
        assert_ne!(Some(r.outdated[0].1.as_str()), current.restart_hash());
        let c = restart_condition(&r, Restarts::Automatic, Some(2), &now());
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "RollingOut")
        );
        let c = restart_condition(&r, Restarts::AutomaticDisabled, Some(2), &now());
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "AutomaticRolloutsDisabled")
        );
        assert!(c.message.contains("rollouts.automatic"), "{}", c.message);

        // Drain settings are retuned live: no restart.
        let mut live = entry("shop", "web", 1, Some(("app", "web")));
        live.spec.shutdown = Some(remora_crds::ShutdownSpec {
            drain_duration: Some(remora_crds::DurationString("10s".into())),
            ..Default::default()
        });
        let all = vec![live.clone()];
        let r = restart_report(&governed(
            &live,
            &Scope::whole(&all, &[current]),
            &chart,
            "remora-system",
        ));
        assert!(r.outdated.is_empty());
    }
}
