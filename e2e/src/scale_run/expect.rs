//! What the operator should have written, computed here from the plan and
//! from facts the operator does not decide (the SidecarLifecycles' real
//! creationTimestamps, which order "the older wins" since they are created
//! concurrently; which layers the webhook recorded in each pod's
//! `remora.dev/status`), by the rules of DESIGN.md: cluster default <
//! namespace-wide < workload selector, one winner per layer (the oldest,
//! then the name), and the CRD's status (matchedPods, Accepted, Conflicted,
//! Applied, RestartRequired). Written apart from the operator's code
//! (operator/src/controllers/lifecycle/status.rs): the point is to check it, not to replay it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::Value;

/// A SidecarLifecycle as the API server holds it.
#[derive(Debug, Clone)]
pub struct LifecycleFacts {
    pub namespace: String,
    pub name: String,
    /// metadata.creationTimestamp (RFC 3339, whole seconds).
    pub created: String,
    pub generation: i64,
    pub selector: Option<BTreeMap<String, String>>,
    /// Its spec (for the settings it sets).
    pub spec: Value,
}

/// A pod: its labels from the plan; what the webhook recorded.
#[derive(Debug, Clone)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// `sources` of `remora.dev/status`; `None`: not injected.
    pub sources: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Layer {
    Cluster,
    Namespace,
    Workload,
}

impl Layer {
    fn of(l: &LifecycleFacts, operator_ns: &str) -> Self {
        match (&l.selector, l.namespace == operator_ns) {
            (Some(_), _) => Self::Workload,
            (None, true) => Self::Cluster,
            (None, false) => Self::Namespace,
        }
    }

    fn word(self) -> &'static str {
        match self {
            Self::Cluster => "cluster",
            Self::Namespace => "namespace",
            Self::Workload => "workload",
        }
    }
}

/// Whether `l` (at its layer) takes part in the settings of `pod`.
fn reaches(l: &LifecycleFacts, pod: &PodFacts, operator_ns: &str) -> bool {
    match Layer::of(l, operator_ns) {
        Layer::Cluster => true,
        Layer::Namespace => pod.namespace == l.namespace && pod.namespace != operator_ns,
        Layer::Workload => {
            pod.namespace == l.namespace
                && l.selector
                    .iter()
                    .flatten()
                    .all(|(k, v)| pod.labels.get(k) == Some(v))
        }
    }
}

/// Older first; the same second: by name.
fn age(l: &LifecycleFacts) -> (&str, &str) {
    (l.created.as_str(), l.name.as_str())
}

/// The status one SidecarLifecycle should have.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    pub generation: i64,
    /// Pods it reaches where no older resource of its layer does.
    pub matched: usize,
    /// Older resources of its layer that win somewhere it reaches.
    pub conflicted_by: BTreeSet<String>,
    /// Every matched pod was injected with it.
    pub applied: bool,
    /// Injected pods whose strongest layer's winner it is.
    pub governed: usize,
}

/// The lifecycles of each layer reaching a pod's namespace, for quick lookup.
struct Index<'a> {
    operator_ns: &'a str,
    by_ns: HashMap<&'a str, Vec<&'a LifecycleFacts>>,
    cluster: Vec<&'a LifecycleFacts>,
}

impl<'a> Index<'a> {
    fn new(lcs: &'a [LifecycleFacts], operator_ns: &'a str) -> Self {
        let mut by_ns: HashMap<&str, Vec<&LifecycleFacts>> = HashMap::new();
        let mut cluster = Vec::new();
        for l in lcs {
            if Layer::of(l, operator_ns) == Layer::Cluster {
                cluster.push(l);
            } else {
                by_ns.entry(l.namespace.as_str()).or_default().push(l);
            }
        }
        Self {
            operator_ns,
            by_ns,
            cluster,
        }
    }

    /// The winner of `layer` for `pod`: the oldest reaching it.
    fn winner(&self, layer: Layer, pod: &PodFacts) -> Option<&'a LifecycleFacts> {
        let candidates: &[&LifecycleFacts] = match layer {
            Layer::Cluster => &self.cluster,
            _ => self
                .by_ns
                .get(pod.namespace.as_str())
                .map_or(&[], Vec::as_slice),
        };
        candidates
            .iter()
            .copied()
            .filter(|l| {
                Layer::of(l, self.operator_ns) == layer && reaches(l, pod, self.operator_ns)
            })
            .min_by(|a, b| age(a).cmp(&age(b)))
    }

    /// The resource that governs `pod`: the winner of its strongest layer.
    fn governor(&self, pod: &PodFacts) -> Option<&'a LifecycleFacts> {
        [Layer::Workload, Layer::Namespace, Layer::Cluster]
            .into_iter()
            .find_map(|l| self.winner(l, pod))
    }
}

fn key(l: &LifecycleFacts) -> (String, String) {
    (l.namespace.clone(), l.name.clone())
}

/// The status every lifecycle should have, by (namespace, name).
pub fn statuses(
    lcs: &[LifecycleFacts],
    pods: &[PodFacts],
    operator_ns: &str,
) -> BTreeMap<(String, String), Expected> {
    let index = Index::new(lcs, operator_ns);
    let mut out: BTreeMap<(String, String), Expected> = lcs
        .iter()
        .map(|l| {
            (
                key(l),
                Expected {
                    generation: l.generation,
                    applied: true,
                    ..Expected::default()
                },
            )
        })
        .collect();
    let mut pending: BTreeMap<(String, String), usize> = BTreeMap::new();
    for pod in pods {
        for layer in [Layer::Cluster, Layer::Namespace, Layer::Workload] {
            let Some(winner) = index.winner(layer, pod) else {
                continue;
            };
            let reaching: Vec<&LifecycleFacts> = match layer {
                Layer::Cluster => index.cluster.clone(),
                _ => index
                    .by_ns
                    .get(pod.namespace.as_str())
                    .into_iter()
                    .flatten()
                    .copied()
                    .filter(|l| Layer::of(l, operator_ns) == layer && reaches(l, pod, operator_ns))
                    .collect(),
            };
            for l in reaching {
                let e = out.entry(key(l)).or_default();
                if std::ptr::eq(l, winner) {
                    e.matched += 1;
                    let mine = format!("{}:{}/{}", layer.word(), l.namespace, l.name);
                    if !pod.sources.as_ref().is_some_and(|s| s.contains(&mine)) {
                        *pending.entry(key(l)).or_default() += 1;
                    }
                } else {
                    e.conflicted_by.insert(winner.name.clone());
                }
            }
        }
        if pod.sources.is_some()
            && let Some(g) = index.governor(pod)
        {
            out.entry(key(g)).or_default().governed += 1;
        }
    }
    // Two selector-less resources of one namespace (or two cluster
    // defaults) overlap even with no pod between them.
    for l in lcs {
        let layer = Layer::of(l, operator_ns);
        if layer == Layer::Workload {
            continue;
        }
        let older: Vec<String> = lcs
            .iter()
            .filter(|o| {
                o.namespace == l.namespace && Layer::of(o, operator_ns) == layer && age(o) < age(l)
            })
            .map(|o| o.name.clone())
            .collect();
        out.entry(key(l)).or_default().conflicted_by.extend(older);
    }
    for (k, n) in pending {
        if n > 0
            && let Some(e) = out.get_mut(&k)
        {
            e.applied = false;
        }
    }
    out
}

/// How `actual` (a SidecarLifecycle as the API server holds it) differs
/// from `want`; empty when it is right. Conditions are judged by status and
/// reason, and by the numbers and names their messages must carry.
pub fn status_problems(want: &Expected, actual: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    let status = &actual["status"];
    let generation = actual["metadata"]["generation"].as_i64();
    if generation != Some(want.generation) {
        problems.push(format!(
            "generation {generation:?}, expected {} (edited since?)",
            want.generation
        ));
    }
    if status["observedGeneration"].as_i64() != Some(want.generation) {
        problems.push(format!(
            "observedGeneration {}, expected {}",
            status["observedGeneration"], want.generation
        ));
    }
    if status["matchedPods"].as_u64() != Some(want.matched as u64) {
        problems.push(format!(
            "matchedPods {}, expected {}",
            status["matchedPods"], want.matched
        ));
    }
    let cond = |t: &str| {
        status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == t)
            .cloned()
    };
    let mut check = |t: &str, ok: bool, reason: &str, needles: Vec<String>| match cond(t) {
        None => problems.push(format!("no {t} condition")),
        Some(c) => {
            let want_status = if ok { "True" } else { "False" };
            let message = c["message"].as_str().unwrap_or_default();
            if c["status"] != want_status || c["reason"] != reason {
                problems.push(format!(
                    "{t} {}/{}, expected {want_status}/{reason} ({message})",
                    c["status"], c["reason"]
                ));
            }
            if c["observedGeneration"].as_i64() != Some(want.generation) {
                problems.push(format!(
                    "{t} observedGeneration {}, expected {}",
                    c["observedGeneration"], want.generation
                ));
            }
            for n in needles {
                if !message.contains(&n) {
                    problems.push(format!("{t} message {message:?} lacks {n:?}"));
                }
            }
        }
    };
    check("Accepted", true, "Valid", vec![]);
    if want.conflicted_by.is_empty() {
        check("Conflicted", false, "NoConflict", vec![]);
    } else {
        check(
            "Conflicted",
            true,
            "OlderResourceWins",
            vec![
                want.conflicted_by
                    .iter()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", "),
            ],
        );
    }
    if want.applied {
        check(
            "Applied",
            true,
            "PodsCurrent",
            vec![format!("{} matched pods", want.matched)],
        );
    } else {
        check(
            "Applied",
            false,
            "PodsPending",
            vec![format!(" of {} matched pods", want.matched)],
        );
    }
    // The load's specs set only drain settings, which running pods take
    // live: no governed pod ever needs a restart.
    check(
        "RestartRequired",
        false,
        "PodsCurrent",
        vec![format!("all {} governed pods", want.governed)],
    );
    problems
}

/// The value of `shutdown.<knob>` a pod should carry: that of the
/// strongest layer whose winner sets it; `None`: no resource sets it.
pub fn knob(
    lcs: &[LifecycleFacts],
    pod: &PodFacts,
    operator_ns: &str,
    name: &str,
) -> Option<String> {
    let index = Index::new(lcs, operator_ns);
    knob_in(&index, pod, name)
}

/// [`knob`] of every one of `pods`, in order.
pub fn knobs(
    lcs: &[LifecycleFacts],
    pods: &[PodFacts],
    operator_ns: &str,
    name: &str,
) -> Vec<Option<String>> {
    let index = Index::new(lcs, operator_ns);
    pods.iter().map(|p| knob_in(&index, p, name)).collect()
}

fn knob_in(index: &Index<'_>, pod: &PodFacts, name: &str) -> Option<String> {
    [Layer::Workload, Layer::Namespace, Layer::Cluster]
        .into_iter()
        .filter_map(|l| index.winner(l, pod))
        .find_map(|l| l.spec["shutdown"][name].as_str().map(str::to_owned))
}

/// The pods (namespace, name) whose `shutdown.<knob>` comes from the
/// lifecycle `from` (namespace, name): those an edit of that knob in it
/// retunes. The others reached by it keep a stronger layer's value.
pub fn carried_from(
    lcs: &[LifecycleFacts],
    pods: &[PodFacts],
    operator_ns: &str,
    from: (&str, &str),
    name: &str,
) -> BTreeSet<(String, String)> {
    let index = Index::new(lcs, operator_ns);
    pods.iter()
        .filter(|p| p.sources.is_some())
        .filter(|p| {
            [Layer::Workload, Layer::Namespace, Layer::Cluster]
                .into_iter()
                .filter_map(|l| index.winner(l, p))
                .find(|l| !l.spec["shutdown"][name].is_null())
                .is_some_and(|l| l.namespace == from.0 && l.name == from.1)
        })
        .map(|p| (p.namespace.clone(), p.name.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const OP: &str = "remora-system";

    fn lc(
        ns: &str,
        name: &str,
        sec: u32,
        sel: Option<(&str, &str)>,
        drain: &str,
    ) -> LifecycleFacts {
        LifecycleFacts {
            namespace: ns.into(),
            name: name.into(),
            created: format!("2026-01-01T00:00:{sec:02}Z"),
            generation: 1,
            selector: sel.map(|(k, v)| BTreeMap::from([(k.to_owned(), v.to_owned())])),
            spec: json!({"shutdown": {"drainDuration": drain}}),
        }
    }

    fn pod(ns: &str, name: &str, labels: &[(&str, &str)]) -> PodFacts {
        PodFacts {
            namespace: ns.into(),
            name: name.into(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            sources: Some(vec!["defaults".into()]),
        }
    }

    fn world() -> (Vec<LifecycleFacts>, Vec<PodFacts>) {
        let mut default = lc(OP, "default", 0, None, "45s");
        default.spec["shutdown"]["terminationDrainDuration"] = json!("5s");
        let lcs = vec![
            default,
            lc("a", "wide", 1, None, "10s"),
            // Same second: `front` < `web` by name, so `front` is older.
            lc("a", "web", 2, Some(("app", "web")), "12s"),
            lc("a", "front", 2, Some(("tier", "front")), "11s"),
            lc("a", "db", 3, Some(("app", "db")), "13s"),
            lc("a", "none", 3, Some(("app", "gone")), "14s"),
        ];
        let pods = vec![
            pod("a", "web-1", &[("app", "web"), ("tier", "front")]),
            pod("a", "web-2", &[("app", "web"), ("tier", "front")]),
            pod("a", "db-1", &[("app", "db"), ("tier", "back")]),
            pod("a", "plain", &[]),
            pod("b", "b-1", &[("app", "web")]),
        ];
        (lcs, pods)
    }

    #[test]
    fn oldest_wins_by_timestamp_then_name_and_the_others_are_conflicted() {
        let (lcs, pods) = world();
        let s = statuses(&lcs, &pods, OP);
        let get = |ns: &str, n: &str| s[&(ns.to_owned(), n.to_owned())].clone();
        // front (same second as web, older by name) wins both web pods.
        assert_eq!(get("a", "front").matched, 2);
        assert!(get("a", "front").conflicted_by.is_empty());
        assert_eq!(get("a", "web").matched, 0);
        assert_eq!(
            get("a", "web").conflicted_by,
            BTreeSet::from(["front".to_owned()])
        );
        assert_eq!((get("a", "db").matched, get("a", "db").governed), (1, 1));
        assert_eq!(get("a", "none").matched, 0);
        // Namespace-wide: every pod of its namespace, governing only the
        // one no selector reaches.
        assert_eq!(
            (get("a", "wide").matched, get("a", "wide").governed),
            (4, 1)
        );
        // The cluster default reaches all five, governs the one in `b`.
        let d = get(OP, "default");
        assert_eq!((d.matched, d.governed), (5, 1));
        // Nothing was injected with a lifecycle: matched ones are pending.
        assert!(!d.applied);
        assert!(get("a", "none").applied, "0 of 0 is current");
    }

    #[test]
    fn applied_counts_the_layers_the_webhook_recorded() {
        let (lcs, mut pods) = world();
        for p in &mut pods {
            if p.namespace == "a" {
                p.sources = Some(vec!["defaults".into(), "namespace:a/wide".into()]);
            }
        }
        let s = statuses(&lcs, &pods, OP);
        assert!(s[&("a".to_owned(), "wide".to_owned())].applied);
        pods[0].sources = None;
        let s = statuses(&lcs, &pods, OP);
        let wide = &s[&("a".to_owned(), "wide".to_owned())];
        assert!(!wide.applied, "one matched pod not injected with it");
        assert_eq!(wide.governed, 1, "a pod not injected is governed by none");
    }

    #[test]
    fn two_selectorless_ones_of_a_namespace_conflict_without_pods() {
        let lcs = vec![lc("c", "old", 1, None, "1s"), lc("c", "new", 2, None, "2s")];
        let s = statuses(&lcs, &[], OP);
        assert_eq!(
            s[&("c".to_owned(), "new".to_owned())].conflicted_by,
            BTreeSet::from(["old".to_owned()])
        );
        assert!(
            s[&("c".to_owned(), "old".to_owned())]
                .conflicted_by
                .is_empty()
        );
    }

    #[test]
    fn knobs_come_from_the_strongest_layer_that_sets_them() {
        let (lcs, pods) = world();
        let k = |p: &PodFacts, n: &str| knob(&lcs, p, OP, n);
        assert_eq!(k(&pods[0], "drainDuration").as_deref(), Some("11s"));
        assert_eq!(k(&pods[3], "drainDuration").as_deref(), Some("10s"));
        assert_eq!(k(&pods[4], "drainDuration").as_deref(), Some("45s"));
        // Only the cluster default sets it: every pod carries its value.
        assert_eq!(
            k(&pods[0], "terminationDrainDuration").as_deref(),
            Some("5s")
        );
        assert_eq!(k(&pods[0], "minimumDrainDuration"), None);
        // An edit of the default's drainDuration retunes only the pod no
        // stronger layer sets it for; of terminationDrainDuration, all.
        let drain = carried_from(&lcs, &pods, OP, (OP, "default"), "drainDuration");
        assert_eq!(drain, BTreeSet::from([("b".to_owned(), "b-1".to_owned())]));
        let term = carried_from(&lcs, &pods, OP, (OP, "default"), "terminationDrainDuration");
        assert_eq!(term.len(), 5);
        let wide = carried_from(&lcs, &pods, OP, ("a", "wide"), "drainDuration");
        assert_eq!(wide, BTreeSet::from([("a".to_owned(), "plain".to_owned())]));
    }

    fn actual(e: &Expected, conflicted: Option<&str>) -> Value {
        let c = |t: &str, s: &str, r: &str, m: String| json!({"type": t, "status": s, "reason": r, "message": m, "observedGeneration": e.generation});
        json!({
            "metadata": {"generation": e.generation},
            "status": {
                "observedGeneration": e.generation,
                "matchedPods": e.matched,
                "conditions": [
                    c("Accepted", "True", "Valid", "the spec is valid".into()),
                    match conflicted {
                        None => c("Conflicted", "False", "NoConflict", "none".into()),
                        Some(n) => c("Conflicted", "True", "OlderResourceWins",
                            format!("older resources win where they overlap: {n}")),
                    },
                    c("Applied", "False", "PodsPending",
                        format!("2 of {} matched pods were injected without this resource", e.matched)),
                    c("RestartRequired", "False", "PodsCurrent",
                        format!("all {} governed pods run with the current proxy settings", e.governed)),
                ]
            }
        })
    }

    #[test]
    fn status_problems_name_each_difference() {
        let want = Expected {
            generation: 2,
            matched: 2,
            conflicted_by: BTreeSet::from(["front".to_owned()]),
            applied: false,
            governed: 1,
        };
        assert_eq!(
            status_problems(&want, &actual(&want, Some("front"))),
            Vec::<String>::new()
        );
        let p = status_problems(&want, &actual(&want, None));
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].starts_with("Conflicted"), "{p:?}");
        let stale = Expected {
            generation: 3,
            ..want.clone()
        };
        let p = status_problems(&stale, &actual(&want, Some("front")));
        assert!(
            p.iter().any(|p| p.starts_with("observedGeneration")),
            "{p:?}"
        );
        let more = Expected {
            matched: 3,
            governed: 2,
            ..want.clone()
        };
        let p = status_problems(&more, &actual(&want, Some("front")));
        assert!(p.iter().any(|p| p.starts_with("matchedPods")), "{p:?}");
        assert!(p.iter().any(|p| p.contains("all 2 governed")), "{p:?}");
    }
}
