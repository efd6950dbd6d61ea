//! The effective sidecar configuration of one pod, resolved from its layers,
//! weakest first: chart defaults < cluster default < namespace-wide <
//! workload (selector; the oldest matching resource wins) < pod annotations.
//! Everything here is pure: the layers come from an in-memory store.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use remora_contract::{DrainFields, Overlay, annotations, defaults, duration, value};
use remora_crds::{
    DrainMode, LabelSet, LogLevel, SidecarLifecycle, SidecarLifecycleSpec, SidecarMode,
};
use serde::Serialize;

/// The defaults the chart (or the command line) gives; the weakest layer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChartDefaults {
    pub image: String,
    pub image_pull_policy: String,
    pub mode: SidecarMode,
    pub resources: ResourceRequirements,
    /// What every injected sidecar is told about the workload CA; `None`
    /// when the CA is not enabled.
    pub workload_ca: Option<WorkloadCaWiring>,
}

/// How a sidecar reaches the operator's workload CA (serve `--workload-ca`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadCaWiring {
    /// `host:port` the sidecar dials.
    pub address: String,
    /// The name the CA's certificate is checked against when `address`
    /// does not carry it (the Service's ClusterIP).
    pub server_name: Option<String>,
    pub trust_domain: String,
    /// The lifetime the sidecar requests.
    pub cert_ttl: Duration,
    /// `host:port` of the discovery server (Envoy's ADS), served with the
    /// CA's certificate under the same `server_name`; `None`: static mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discovery: Option<String>,
}

impl Default for ChartDefaults {
    fn default() -> Self {
        Self {
            image: "ghcr.io/remora/remora-agent:latest".into(),
            image_pull_policy: "IfNotPresent".into(),
            mode: SidecarMode::Auto,
            resources: default_resources(),
            workload_ca: None,
        }
    }
}

/// requests cpu 100m / memory 128Mi, limit memory 1Gi: Envoy with a small
/// config fits, and no CPU limit avoids throttling the data path.
pub fn default_resources() -> ResourceRequirements {
    let q = |s: &str| Quantity(s.to_string());
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_string(), q("100m")),
            ("memory".to_string(), q("128Mi")),
        ])),
        limits: Some(BTreeMap::from([("memory".to_string(), q("1Gi"))])),
        ..Default::default()
    }
}

/// Every setting of the sidecar, resolved.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EffectiveConfig {
    pub image: String,
    pub image_pull_policy: String,
    pub mode: SidecarMode,
    pub hold_application_until_proxy_starts: bool,
    pub startup_timeout: Duration,
    pub drain_duration: Duration,
    pub termination_drain_duration: Duration,
    pub exit_on_zero_active_connections: bool,
    pub minimum_drain_duration: Duration,
    pub drain_mode: DrainMode,
    pub quiet_period: Duration,
    pub withdrawal_timeout: Duration,
    pub concurrency: i32,
    pub log_level: LogLevel,
    pub resources: ResourceRequirements,
    /// The workload CA the sidecar is given; `None` when the chart does not
    /// enable it or the pod opts out (`remora.dev/workload-ca: "false"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload_ca: Option<WorkloadCaWiring>,
    /// Which layers contributed, weakest first (for the status annotation).
    pub sources: Vec<String>,
    /// Problems met while resolving (bad annotation values); they become warnings.
    #[serde(skip)]
    pub problems: Vec<String>,
}

impl EffectiveConfig {
    /// A digest of the settings a running sidecar cannot take live: they are
    /// baked into the pod spec at admission (image, mode, the startup hold,
    /// concurrency, log level, resources). The operator records it in
    /// `remora.dev/status`; the controller compares it with what the pod
    /// should get now to report `RestartRequired` and roll workloads. The
    /// requested mode is hashed (not the one `Auto` resolved to), so a node
    /// upgrade alone never asks for a restart.
    pub fn restart_hash(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut fields = serde_json::json!({
            "image": self.image,
            "imagePullPolicy": self.image_pull_policy,
            "mode": self.mode.as_str(),
            "hold": self.hold_application_until_proxy_starts,
            "startupTimeout": self.startup_timeout.as_millis() as u64,
            "concurrency": self.concurrency,
            "logLevel": self.log_level,
            "resources": self.resources,
        });
        // Only when wired: pods injected without the CA keep their hash.
        if let (Some(ca), Some(o)) = (&self.workload_ca, fields.as_object_mut()) {
            let mut wired = serde_json::json!({
                "address": ca.address,
                "trustDomain": ca.trust_domain,
                "certTtl": ca.cert_ttl.as_millis() as u64,
            });
            // Only when on, likewise: turning discovery on asks for a restart.
            if let (Some(d), Some(w)) = (&ca.discovery, wired.as_object_mut()) {
                w.insert("discovery".into(), serde_json::json!(d));
            }
            o.insert("workloadCa".into(), wired);
        }
        let digest = Sha256::digest(fields.to_string().as_bytes());
        let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!("sha256:{hex}")
    }

    pub fn from_defaults(d: &ChartDefaults) -> Self {
        // The contract's own test parses every default.
        let dur = |s: &str| duration::parse(s).unwrap_or_default();
        Self {
            image: d.image.clone(),
            image_pull_policy: d.image_pull_policy.clone(),
            mode: d.mode,
            hold_application_until_proxy_starts: defaults::HOLD_APPLICATION_UNTIL_PROXY_STARTS,
            startup_timeout: dur(defaults::STARTUP_TIMEOUT),
            drain_duration: dur(defaults::DRAIN_DURATION),
            termination_drain_duration: dur(defaults::TERMINATION_DRAIN_DURATION),
            exit_on_zero_active_connections: defaults::EXIT_ON_ZERO_ACTIVE_CONNECTIONS,
            minimum_drain_duration: dur(defaults::MINIMUM_DRAIN_DURATION),
            drain_mode: defaults::DRAIN_MODE,
            quiet_period: dur(defaults::QUIET_PERIOD),
            withdrawal_timeout: dur(defaults::WITHDRAWAL_TIMEOUT),
            concurrency: concurrency(defaults::CONCURRENCY),
            log_level: defaults::LOG_LEVEL,
            resources: d.resources.clone(),
            workload_ca: d.workload_ca.clone(),
            sources: vec!["defaults".into()],
            problems: Vec::new(),
        }
    }

    /// Overlay the fields a `SidecarLifecycle` sets. A duration the schema
    /// should have refused is reported and skipped.
    pub fn apply_spec(&mut self, spec: &SidecarLifecycleSpec, source: &str) {
        let mut problems = Vec::new();
        let mut set = |name: &str, v: &Option<remora_crds::DurationString>, slot: &mut Duration| {
            if let Some(v) = v {
                match v.parse() {
                    Ok(d) => *slot = d,
                    Err(e) => problems.push(format!("{source}: {name}: {e}")),
                }
            }
        };
        if let Some(m) = spec.mode {
            self.mode = m;
        }
        if let Some(s) = &spec.startup {
            if let Some(h) = s.hold_application_until_proxy_starts {
                self.hold_application_until_proxy_starts = h;
            }
            set("startup.timeout", &s.timeout, &mut self.startup_timeout);
        }
        if let Some(s) = &spec.shutdown {
            set(
                "shutdown.drainDuration",
                &s.drain_duration,
                &mut self.drain_duration,
            );
            set(
                "shutdown.terminationDrainDuration",
                &s.termination_drain_duration,
                &mut self.termination_drain_duration,
            );
            set(
                "shutdown.minimumDrainDuration",
                &s.minimum_drain_duration,
                &mut self.minimum_drain_duration,
            );
            set(
                "shutdown.quietPeriod",
                &s.quiet_period,
                &mut self.quiet_period,
            );
            set(
                "shutdown.withdrawalTimeout",
                &s.withdrawal_timeout,
                &mut self.withdrawal_timeout,
            );
            if let Some(b) = s.exit_on_zero_active_connections {
                self.exit_on_zero_active_connections = b;
            }
            let sets_termination = s.termination_drain_duration.is_some();
            let asked = DrainMode::asked(
                s.drain_mode,
                sets_termination,
                s.exit_on_zero_active_connections,
            );
            if let Some(m) = asked {
                self.drain_mode = m;
            }
        }
        if let Some(p) = &spec.proxy {
            if let Some(c) = p.concurrency {
                self.concurrency = c.clamp(0, concurrency(remora_contract::value::MAX_CONCURRENCY));
            }
            if let Some(l) = p.log_level {
                self.log_level = l;
            }
            if let Some(r) = &p.resources {
                self.resources = r.clone();
            }
        }
        self.problems.extend(problems);
        self.sources.push(source.to_string());
    }

    /// Overlay the pod's own `remora.dev/<kebab-case-field>` annotations, the
    /// strongest layer, read and (the drain settings) applied by the
    /// contract's [`Overlay`] exactly as the agent does. Bad values are
    /// reported and skipped.
    pub fn apply_annotations(&mut self, ann: &BTreeMap<String, String>) {
        let before = self.clone();
        let (o, problems) = Overlay::from_annotations(ann);
        o.apply_drain(DrainFields {
            drain_duration: &mut self.drain_duration,
            termination_drain_duration: &mut self.termination_drain_duration,
            exit_on_zero_active_connections: &mut self.exit_on_zero_active_connections,
            minimum_drain_duration: &mut self.minimum_drain_duration,
            drain_mode: &mut self.drain_mode,
            quiet_period: &mut self.quiet_period,
            withdrawal_timeout: &mut self.withdrawal_timeout,
            drain_deadline: None,
        });
        // Baked into the pod spec at admission: the agent does not take these live.
        self.mode = o.mode.unwrap_or(self.mode);
        self.hold_application_until_proxy_starts = o
            .hold_application_until_proxy_starts
            .unwrap_or(self.hold_application_until_proxy_starts);
        self.startup_timeout = o.startup_timeout.unwrap_or(self.startup_timeout);
        self.concurrency = o.concurrency.map_or(self.concurrency, concurrency);
        self.log_level = o.log_level.unwrap_or(self.log_level);
        // Only a clear "false" opts out; any other bad value is refused at
        // injection (mutate), not guessed at here.
        if ann
            .get(annotations::WORKLOAD_CA)
            .is_some_and(|v| value::parse_bool(v) == Ok(false))
        {
            self.workload_ca = None;
        }
        self.problems
            .extend(problems.iter().map(|p| format!("annotation {p}")));
        let mut after = self.clone();
        after.sources = before.sources.clone();
        after.problems = before.problems.clone();
        if after != before {
            self.sources.push("pod-annotations".into());
        }
    }
}

/// A worker count the contract bounded (at most 256) as the CRD's integer.
fn concurrency(c: u32) -> i32 {
    i32::try_from(c).unwrap_or(i32::MAX)
}

/// A `SidecarLifecycle` as the resolver sees it: where it lives, how old it is.
#[derive(Debug, Clone, PartialEq)]
pub struct LifecycleEntry {
    pub namespace: String,
    pub name: String,
    /// RFC 3339 creation time; `None` counts as newest.
    pub created: Option<String>,
    pub spec: SidecarLifecycleSpec,
}

impl LifecycleEntry {
    pub fn from_resource(r: &SidecarLifecycle) -> Self {
        Self {
            namespace: r.metadata.namespace.clone().unwrap_or_default(),
            name: r.metadata.name.clone().unwrap_or_default(),
            created: r
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.to_string()),
            spec: r.spec.clone(),
        }
    }

    /// Whether this resource takes part in the settings of a pod in
    /// `pod_namespace` with `pod_labels`, at its own layer (an older
    /// resource of the same layer may still win, see [`layers`]).
    pub fn reaches(
        &self,
        operator_namespace: &str,
        pod_namespace: &str,
        pod_labels: &(impl LabelSet + ?Sized),
    ) -> bool {
        self.reaches_at(
            Layer::of(self, operator_namespace),
            pod_namespace,
            pod_labels,
        )
    }

    fn reaches_at(
        &self,
        layer: Layer,
        pod_namespace: &str,
        pod_labels: &(impl LabelSet + ?Sized),
    ) -> bool {
        match layer {
            Layer::Cluster => true,
            // Never the operator's namespace (that one is `Cluster`), so a
            // pod there gets the cluster default once.
            Layer::Namespace => self.namespace == pod_namespace,
            Layer::Workload => {
                self.namespace == pod_namespace
                    && self
                        .spec
                        .selector
                        .as_ref()
                        .is_some_and(|s| s.matches(pod_labels))
            }
        }
    }

    /// Of two resources of one layer that reach a pod, whether this one
    /// wins: the oldest does; an unknown creation time counts as newest and
    /// the name breaks ties.
    pub fn wins_over(&self, other: &Self) -> bool {
        self.age_key() < other.age_key()
    }

    fn age_key(&self) -> (bool, Option<&str>, &str) {
        (self.created.is_none(), self.created.as_deref(), &self.name)
    }

    /// How the resource is named among a pod's sources
    /// (`<layer>:<namespace>/<name>`).
    pub fn source(&self, layer: Layer) -> String {
        format!("{}:{}/{}", layer.as_str(), self.namespace, self.name)
    }
}

/// Where a `SidecarLifecycle` sits in the precedence, weakest first. Its
/// place follows from where it lives and whether it has a selector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Layer {
    /// No selector, in the operator's namespace: every pod.
    Cluster,
    /// No selector, in another namespace: that namespace's pods.
    Namespace,
    /// A selector: the pods of its namespace it matches.
    Workload,
}

impl Layer {
    pub fn of(entry: &LifecycleEntry, operator_namespace: &str) -> Self {
        match &entry.spec.selector {
            Some(_) => Self::Workload,
            None if entry.namespace == operator_namespace => Self::Cluster,
            None => Self::Namespace,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cluster => "cluster",
            Self::Namespace => "namespace",
            Self::Workload => "workload",
        }
    }
}

/// The resource that wins each layer of one pod's settings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Layers<'a>([Option<&'a LifecycleEntry>; 3]);

impl<'a> Layers<'a> {
    /// The resource that wins `layer`; `None` when none of it reaches the pod.
    pub fn get(&self, layer: Layer) -> Option<&'a LifecycleEntry> {
        self.0[layer as usize]
    }

    /// The winners, weakest layer first: the order they apply in.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (Layer, &'a LifecycleEntry)> {
        [Layer::Cluster, Layer::Namespace, Layer::Workload]
            .into_iter()
            .filter_map(|l| Some((l, self.get(l)?)))
    }

    /// The winner of the strongest layer that reaches the pod.
    pub fn strongest(&self) -> Option<(Layer, &'a LifecycleEntry)> {
        self.iter().next_back()
    }
}

/// The `SidecarLifecycle` resources a pod's settings come from, one per
/// layer: of those that reach the pod at a layer, the oldest. This is the one
/// place precedence lives; [`resolve`] applies them and the controller's
/// status reports them.
pub fn layers<'a>(
    entries: &'a [LifecycleEntry],
    operator_namespace: &str,
    pod_namespace: &str,
    pod_labels: &(impl LabelSet + ?Sized),
) -> Layers<'a> {
    let mut won = Layers::default();
    for e in entries {
        let layer = Layer::of(e, operator_namespace);
        if !e.reaches_at(layer, pod_namespace, pod_labels) {
            continue;
        }
        let slot = &mut won.0[layer as usize];
        if slot.is_none_or(|w| e.wins_over(w)) {
            *slot = Some(e);
        }
    }
    won
}

/// Resolve the effective config of a pod. `operator_namespace` holds the
/// cluster default (a resource without selector there).
pub fn resolve(
    chart: &ChartDefaults,
    entries: &[LifecycleEntry],
    operator_namespace: &str,
    pod_namespace: &str,
    pod_labels: &(impl LabelSet + ?Sized),
    pod_annotations: &BTreeMap<String, String>,
) -> EffectiveConfig {
    let mut cfg = EffectiveConfig::from_defaults(chart);
    for (layer, e) in layers(entries, operator_namespace, pod_namespace, pod_labels).iter() {
        cfg.apply_spec(&e.spec, &e.source(layer));
    }
    cfg.apply_annotations(pod_annotations);
    cfg
}

#[cfg(test)]
mod tests {
    use super::*;
    use remora_contract::annotations;
    use remora_crds::{DurationString, ShutdownSpec, WorkloadSelector};
    use remora_test_support::maps::string_map as labels;

    fn entry(
        ns: &str,
        name: &str,
        created: &str,
        sel: Option<&[(&str, &str)]>,
        drain: &str,
    ) -> LifecycleEntry {
        LifecycleEntry {
            namespace: ns.into(),
            name: name.into(),
            created: Some(created.into()),
            spec: SidecarLifecycleSpec {
                selector: sel.map(|s| WorkloadSelector {
                    match_labels: s
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                }),
                shutdown: Some(ShutdownSpec {
                    termination_drain_duration: Some(DurationString::new(drain)),
                    ..Default::default()
                }),
                ..Default::default()
            },
        }
    }

    /// One row per rule: which layers exist, and which value must win.
    #[test]
    fn precedence_table() {
        let cluster = entry(
            "remora-system",
            "default",
            "2026-01-01T00:00:00Z",
            None,
            "1s",
        );
        let other_ns_default = entry("other", "default", "2026-01-01T00:00:00Z", None, "9s");
        let ns = entry("shop", "ns", "2026-01-02T00:00:00Z", None, "2s");
        let ns_newer = entry("shop", "ns-newer", "2026-01-05T00:00:00Z", None, "8s");
        let wl_old = entry(
            "shop",
            "web-old",
            "2026-01-03T00:00:00Z",
            Some(&[("app", "web")]),
            "3s",
        );
        let wl_new = entry(
            "shop",
            "web-new",
            "2026-01-04T00:00:00Z",
            Some(&[("app", "web")]),
            "4s",
        );
        let wl_other = entry(
            "shop",
            "db",
            "2026-01-01T00:00:00Z",
            Some(&[("app", "db")]),
            "7s",
        );
        let ann = |v: &str| labels(&[(annotations::TERMINATION_DRAIN_DURATION, v)]);

        struct Row {
            what: &'static str,
            entries: Vec<LifecycleEntry>,
            ns: &'static str,
            labels: BTreeMap<String, String>,
            annotations: BTreeMap<String, String>,
            want: u64,
        }
        let web = labels(&[("app", "web")]);
        let rows = vec![
            Row {
                what: "chart defaults only",
                entries: vec![],
                ns: "shop",
                labels: web.clone(),
                annotations: BTreeMap::new(),
                want: 5,
            },
            Row {
                what: "other namespace's default is ignored",
                entries: vec![other_ns_default.clone()],
                ns: "shop",
                labels: web.clone(),
                annotations: BTreeMap::new(),
                want: 5,
            },
            Row {
                what: "cluster default beats chart",
                entries: vec![cluster.clone()],
                ns: "shop",
                labels: web.clone(),
                annotations: BTreeMap::new(),
                want: 1,
            },
            Row {
                what: "namespace beats cluster",
                entries: vec![cluster.clone(), ns.clone()],
                ns: "shop",
                labels: web.clone(),
                annotations: BTreeMap::new(),
                want: 2,
            },
            Row {
                what: "older namespace-wide wins",
                entries: vec![ns_newer.clone(), ns.clone()],
                ns: "shop",
                labels: web.clone(),
                annotations: BTreeMap::new(),
                want: 2,
            },
            Row {
                what: "workload beats namespace",
                entries: vec![cluster.clone(), ns.clone(), wl_old.clone()],
                ns: "shop",
                labels: web.clone(),
                annotations: BTreeMap::new(),
                want: 3,
            },
            Row {
                what: "older workload wins on overlap",
                entries: vec![wl_new.clone(), wl_old.clone(), ns.clone()],
                ns: "shop",
                labels: web.clone(),
                annotations: BTreeMap::new(),
                want: 3,
            },
            Row {
                what: "non-matching selector is ignored",
                entries: vec![ns.clone(), wl_other.clone()],
                ns: "shop",
                labels: web.clone(),
                annotations: BTreeMap::new(),
                want: 2,
            },
            Row {
                what: "pod annotation beats everything",
                entries: vec![cluster.clone(), ns.clone(), wl_old.clone()],
                ns: "shop",
                labels: web.clone(),
                annotations: ann("6s"),
                want: 6,
            },
            Row {
                what: "bad annotation is skipped",
                entries: vec![cluster.clone(), ns.clone(), wl_old.clone()],
                ns: "shop",
                labels: web.clone(),
                annotations: ann("soon"),
                want: 3,
            },
            Row {
                what: "pod in the operator namespace gets the default once",
                entries: vec![cluster.clone()],
                ns: "remora-system",
                labels: web.clone(),
                annotations: BTreeMap::new(),
                want: 1,
            },
        ];
        for row in rows {
            let cfg = resolve(
                &ChartDefaults::default(),
                &row.entries,
                "remora-system",
                row.ns,
                &row.labels,
                &row.annotations,
            );
            assert_eq!(
                cfg.termination_drain_duration,
                Duration::from_secs(row.want),
                "{}: {:?}",
                row.what,
                cfg.sources
            );
        }
    }

    #[test]
    fn layers_name_one_winner_per_layer() {
        let cluster = entry(
            "remora-system",
            "default",
            "2026-01-01T00:00:00Z",
            None,
            "1s",
        );
        let ns = entry("shop", "ns", "2026-01-02T00:00:00Z", None, "2s");
        let web = Some(&[("app", "web")][..]);
        let wl_new = entry("shop", "web-new", "2026-01-04T00:00:00Z", web, "4s");
        let wl_old = entry("shop", "web-old", "2026-01-03T00:00:00Z", web, "3s");
        let all = [cluster, ns, wl_new, wl_old];
        let name = |l: Layers<'_>, layer| l.get(layer).map(|e| e.name.clone());

        let l = layers(&all, "remora-system", "shop", &labels(&[("app", "web")]));
        assert_eq!(name(l, Layer::Cluster).as_deref(), Some("default"));
        assert_eq!(name(l, Layer::Namespace).as_deref(), Some("ns"));
        assert_eq!(
            name(l, Layer::Workload).as_deref(),
            Some("web-old"),
            "the oldest"
        );
        assert_eq!(l.strongest().map(|(layer, _)| layer), Some(Layer::Workload));
        let sources: Vec<String> = l.iter().map(|(layer, e)| e.source(layer)).collect();
        assert_eq!(
            sources,
            [
                "cluster:remora-system/default",
                "namespace:shop/ns",
                "workload:shop/web-old"
            ]
        );

        let other = layers(&all, "remora-system", "other", &labels(&[("app", "web")]));
        assert_eq!(
            other.iter().map(|(layer, _)| layer).collect::<Vec<_>>(),
            [Layer::Cluster]
        );
    }

    #[test]
    fn layers_merge_field_by_field() {
        let mut cluster = entry(
            "remora-system",
            "default",
            "2026-01-01T00:00:00Z",
            None,
            "1s",
        );
        if let Some(s) = cluster.spec.shutdown.as_mut() {
            s.exit_on_zero_active_connections = Some(true);
        }
        let ns = entry("shop", "ns", "2026-01-02T00:00:00Z", None, "2s");
        let cfg = resolve(
            &ChartDefaults::default(),
            &[cluster, ns],
            "remora-system",
            "shop",
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        assert!(
            cfg.exit_on_zero_active_connections,
            "inherited from the cluster default"
        );
        assert_eq!(cfg.termination_drain_duration, Duration::from_secs(2));
        assert_eq!(cfg.drain_duration, Duration::from_secs(45), "chart default");
        assert_eq!(
            cfg.sources,
            [
                "defaults",
                "cluster:remora-system/default",
                "namespace:shop/ns"
            ]
        );
    }

    /// A `SidecarLifecycle` that sets terminationDrainDuration and no
    /// drainMode gets the fixed drain it asks for; a drainMode beside it wins.
    #[test]
    fn a_termination_drain_duration_alone_makes_the_drain_fixed() {
        let fixed = entry(
            "remora-system",
            "default",
            "2026-01-01T00:00:00Z",
            None,
            "0s",
        );
        let cfg = resolve(
            &ChartDefaults::default(),
            std::slice::from_ref(&fixed),
            "remora-system",
            "shop",
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        assert_eq!(
            (cfg.drain_mode, cfg.termination_drain_duration),
            (DrainMode::Fixed, Duration::ZERO)
        );
        let mut adaptive = fixed;
        if let Some(s) = adaptive.spec.shutdown.as_mut() {
            s.drain_mode = Some(DrainMode::Adaptive);
        }
        let cfg = resolve(
            &ChartDefaults::default(),
            &[adaptive],
            "remora-system",
            "shop",
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        assert_eq!(cfg.drain_mode, DrainMode::Adaptive);
        let none = resolve(
            &ChartDefaults::default(),
            &[],
            "remora-system",
            "shop",
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        assert_eq!(none.drain_mode, DrainMode::Adaptive);
    }

    #[test]
    fn annotations_cover_every_field() {
        let ann = labels(&[
            (annotations::MODE, "native"),
            (annotations::HOLD_APPLICATION_UNTIL_PROXY_STARTS, "false"),
            (annotations::STARTUP_TIMEOUT, "2m"),
            (annotations::DRAIN_DURATION, "10s"),
            (annotations::MINIMUM_DRAIN_DURATION, "250ms"),
            (annotations::EXIT_ON_ZERO_ACTIVE_CONNECTIONS, "true"),
            (annotations::CONCURRENCY, "4"),
            (annotations::LOG_LEVEL, "debug"),
        ]);
        let cfg = resolve(
            &ChartDefaults::default(),
            &[],
            "remora-system",
            "shop",
            &BTreeMap::new(),
            &ann,
        );
        assert_eq!(cfg.mode, SidecarMode::Native);
        assert!(!cfg.hold_application_until_proxy_starts);
        assert_eq!(cfg.startup_timeout, Duration::from_secs(120));
        assert_eq!(cfg.drain_duration, Duration::from_secs(10));
        assert_eq!(cfg.minimum_drain_duration, Duration::from_millis(250));
        assert!(cfg.exit_on_zero_active_connections);
        assert_eq!(cfg.concurrency, 4);
        assert_eq!(cfg.log_level, LogLevel::Debug);
        assert!(cfg.problems.is_empty(), "{:?}", cfg.problems);
        assert_eq!(
            cfg.sources.last().map(String::as_str),
            Some("pod-annotations")
        );
    }

    #[test]
    fn the_pod_opts_out_of_the_workload_ca() {
        let chart = ChartDefaults {
            workload_ca: Some(WorkloadCaWiring {
                address: "ca:15012".into(),
                server_name: None,
                trust_domain: "cluster.local".into(),
                cert_ttl: Duration::from_secs(3600),
                discovery: None,
            }),
            ..ChartDefaults::default()
        };
        let cfg = |v: Option<&str>| {
            let ann = v
                .map(|v| labels(&[(annotations::WORKLOAD_CA, v)]))
                .unwrap_or_default();
            resolve(&chart, &[], "remora-system", "shop", &BTreeMap::new(), &ann)
        };
        assert!(cfg(None).workload_ca.is_some());
        assert!(cfg(Some("true")).workload_ca.is_some());
        // Refused by mutate, not guessed at here.
        assert!(cfg(Some("nope")).workload_ca.is_some());
        let out = cfg(Some("false"));
        assert_eq!(out.workload_ca, None);
        assert_eq!(out.sources, ["defaults", "pod-annotations"]);
        assert_ne!(cfg(None).restart_hash(), out.restart_hash());
        assert_eq!(
            out.restart_hash(),
            EffectiveConfig::from_defaults(&ChartDefaults::default()).restart_hash(),
            "a pod without the CA hashes as before the CA existed"
        );
    }
}
