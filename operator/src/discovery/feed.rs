//! The registry fed from the shared watches: one of Services, one of
//! EndpointSlices, and when the API server serves them one of
//! ExternalServices and one of ExternalWorkloads (started here, trimmed to
//! what discovery reads), and the process's pod watch
//! ([`crate::cluster::live_pod::live_pods`], which the leader's controllers
//! share when discovery is on).

use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher;
use kube::{Api, Client};
use remora_contract::annotations::IDENTITIES;
use remora_contract::discovery::ServiceHost;
use remora_contract::mesh::MAX_IDENTITIES_BYTES;
use tokio_util::sync::CancellationToken;

use remora_crds::external::{ExternalService, ExternalWorkload};

use super::external::{ExternalInfo, WorkloadInfo};
use super::push::Discovery;
use super::registry::{PodKey, ProxyInfo, SERVICE_NAME_LABEL, ServiceInfo, SliceInfo};
use crate::cluster::live_pod::LivePod;
use crate::cluster::watch::{Change, SharedWatch};

/// The watches discovery reads.
pub struct Watches {
    pub services: SharedWatch<Service>,
    pub slices: SharedWatch<EndpointSlice>,
    pub pods: SharedWatch<LivePod>,
    /// `None` when the API server does not serve the external-service CRDs
    /// (an install upgraded without them, see [`externals_served`]).
    pub externals: Option<ExternalWatches>,
}

/// The watches of services outside the cluster.
pub struct ExternalWatches {
    pub services: SharedWatch<ExternalService>,
    pub workloads: SharedWatch<ExternalWorkload>,
}

impl ExternalWatches {
    pub fn start(client: &Client, shutdown: CancellationToken) -> Self {
        Self {
            services: SharedWatch::start(
                "externalservices",
                Api::<ExternalService>::all(client.clone()),
                watcher::Config::default(),
                |s: &mut ExternalService| {
                    s.metadata.managed_fields = None;
                    s.metadata.annotations = None;
                    s.metadata.labels = None;
                },
                shutdown.clone(),
            ),
            workloads: SharedWatch::start(
                "externalworkloads",
                Api::<ExternalWorkload>::all(client.clone()),
                watcher::Config::default(),
                |w: &mut ExternalWorkload| {
                    w.metadata.managed_fields = None;
                    w.metadata.annotations = None;
                    w.metadata.labels = None;
                },
                shutdown,
            ),
        }
    }
}

/// Whether the API server serves the external-service CRDs to this
/// replica (installed, and listable under its RBAC). Helm installs a
/// chart's CRDs only on first install: an upgraded install may lack them,
/// and discovery must then still become ready, without external services.
pub async fn externals_served(client: &Client) -> bool {
    let lp = kube::api::ListParams::default().limit(1);
    let (services, workloads) = (
        Api::<ExternalService>::all(client.clone()),
        Api::<ExternalWorkload>::all(client.clone()),
    );
    match tokio::join!(services.list_metadata(&lp), workloads.list_metadata(&lp)) {
        (Ok(_), Ok(_)) => true,
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(error = %e, "the ExternalService and ExternalWorkload CRDs are not served (apply charts/remora/crds/ and restart): discovery runs without external services");
            false
        }
    }
}

impl Watches {
    /// Start the Service and EndpointSlice watches until `shutdown`; `pods`
    /// is the process's pod watch.
    /// `externals`: whether to watch the external-service CRDs too.
    pub fn start(
        client: &Client,
        pods: SharedWatch<LivePod>,
        externals: bool,
        shutdown: CancellationToken,
    ) -> Self {
        let externals = externals.then(|| ExternalWatches::start(client, shutdown.clone()));
        let services = SharedWatch::start(
            "services",
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
            trim_service,
            shutdown.clone(),
        );
        let slices = SharedWatch::start(
            "endpointslices",
            Api::<EndpointSlice>::all(client.clone()),
            watcher::Config::default(),
            |s: &mut EndpointSlice| {
                s.metadata.managed_fields = None;
                s.metadata.annotations = None;
                if let Some(l) = s.metadata.labels.as_mut() {
                    l.retain(|k, _| k == SERVICE_NAME_LABEL);
                }
            },
            shutdown,
        );
        Self {
            services,
            slices,
            pods,
            externals,
        }
    }

    /// Feed `discovery` from the watches, change by change, from what they
    /// hold now on.
    pub fn feed(&self, discovery: &Arc<Discovery>) {
        let d = Arc::clone(discovery);
        self.services.observe(move |c| {
            service_changed(&d, c);
            true
        });
        let d = Arc::clone(discovery);
        self.slices.observe(move |c| {
            slice_changed(&d, c);
            true
        });
        let d = Arc::clone(discovery);
        self.pods.observe(move |c| {
            pod_changed(&d, c);
            true
        });
        if let Some(x) = &self.externals {
            let d = Arc::clone(discovery);
            x.services.observe(move |c| {
                external_service_changed(&d, c);
                true
            });
            let d = Arc::clone(discovery);
            x.workloads.observe(move |c| {
                external_workload_changed(&d, c);
                true
            });
        }
    }

    /// Returns once every watch has its first listing.
    pub async fn synced(&self) {
        tokio::join!(
            self.services.listed(),
            self.slices.listed(),
            self.pods.listed(),
            async {
                if let Some(x) = &self.externals {
                    tokio::join!(x.services.listed(), x.workloads.listed());
                }
            }
        );
    }
}

/// What discovery reads of a Service: the spec's ports and type, and the
/// identities it declares (bounded: a longer value is kept just over the
/// bound, which then fails to parse: closed).
fn trim_service(s: &mut Service) {
    s.metadata.managed_fields = None;
    s.metadata.labels = None;
    s.status = None;
    if let Some(a) = s.metadata.annotations.as_mut() {
        a.retain(|k, _| k == IDENTITIES);
        if let Some(v) = a.get_mut(IDENTITIES) {
            truncate(v, MAX_IDENTITIES_BYTES + 1);
        }
    }
    if s.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.is_empty())
    {
        s.metadata.annotations = None;
    }
}

/// `v` cut to at most `max` bytes, on a character boundary.
fn truncate(v: &mut String, max: usize) {
    if v.len() > max {
        let mut end = max;
        while !v.is_char_boundary(end) {
            end -= 1;
        }
        v.truncate(end);
    }
}

fn service_changed(d: &Discovery, c: &Change<Service>) {
    let o = c.object();
    let host = || {
        Some(ServiceHost {
            name: o.metadata.name.clone()?,
            namespace: o.metadata.namespace.clone()?,
        })
    };
    match (c, ServiceInfo::read(o)) {
        (Change::Applied(_), Some((h, info))) => d.update(|r| r.apply_service(h, info)),
        // Deleted, or no longer one discovery serves (ExternalName).
        _ => {
            if let Some(h) = host() {
                d.update(|r| r.delete_service(&h));
            }
        }
    }
}

fn slice_changed(d: &Discovery, c: &Change<EndpointSlice>) {
    let o = c.object();
    let (Some(ns), Some(name)) = (o.metadata.namespace.clone(), o.metadata.name.clone()) else {
        return;
    };
    match c {
        Change::Applied(s) => d.update(|r| r.apply_slice((ns, name), SliceInfo::read(s))),
        Change::Deleted(_) => d.update(|r| r.delete_slice(&(ns, name))),
    }
}

fn external_service_changed(d: &Discovery, c: &Change<ExternalService>) {
    let o = c.object();
    let (Some(ns), Some(name)) = (o.metadata.namespace.clone(), o.metadata.name.clone()) else {
        return;
    };
    match (c, ExternalInfo::read(o)) {
        (Change::Applied(_), Some((key, info))) => {
            d.update(|r| r.apply_external_service(key, info));
        }
        _ => d.update(|r| r.delete_external_service(&(ns, name))),
    }
}

fn external_workload_changed(d: &Discovery, c: &Change<ExternalWorkload>) {
    let o = c.object();
    let (Some(ns), Some(name)) = (o.metadata.namespace.clone(), o.metadata.name.clone()) else {
        return;
    };
    match (c, WorkloadInfo::read(o)) {
        (Change::Applied(_), Some((key, info))) => {
            d.update(|r| r.apply_external_workload(key, info));
        }
        // Deleted, or no longer an endpoint (no IP).
        _ => d.update(|r| r.delete_external_workload(&(ns, name))),
    }
}

fn pod_changed(d: &Discovery, c: &Change<LivePod>) {
    let o = c.object();
    match (c, ProxyInfo::read(o)) {
        // Withdrawn at once when it starts deleting or stops being Ready.
        (Change::Applied(_), Some((key, info))) => d.apply_proxy(key, info),
        _ => {
            if let (Some(namespace), Some(name)) =
                (o.metadata.namespace.clone(), o.metadata.name.clone())
            {
                d.delete_proxy(&PodKey { namespace, name });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::push::Debounce;
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
    use kube::api::ObjectMeta;

    fn service(type_: Option<&str>) -> Arc<Service> {
        Arc::new(Service {
            metadata: ObjectMeta {
                name: Some("cart".into()),
                namespace: Some("shop".into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                type_: type_.map(str::to_string),
                ports: Some(vec![ServicePort {
                    port: 80,
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    #[test]
    fn a_service_turned_external_name_leaves_the_registry() {
        let (d, _debounce) = Discovery::new("cluster.local", None, Debounce::default());
        let host = ServiceHost {
            name: "cart".into(),
            namespace: "shop".into(),
        };
        service_changed(&d, &Change::Applied(service(None)));
        assert!(d.read(|r| r.service(&host).is_some()));
        service_changed(&d, &Change::Applied(service(Some("ExternalName"))));
        assert!(d.read(|r| r.service(&host).is_none()));
        service_changed(&d, &Change::Applied(service(None)));
        service_changed(&d, &Change::Deleted(service(None)));
        assert!(d.read(|r| r.service(&host).is_none()));
    }

    #[test]
    fn a_service_keeps_only_its_declared_identities_and_bounded() {
        use remora_contract::mesh::parse_identities;
        let mut svc = (*service(None)).clone();
        svc.metadata.annotations = Some(
            [
                (IDENTITIES.to_string(), "cart".to_string()),
                (
                    "kubectl.kubernetes.io/last-applied-configuration".into(),
                    "{}".into(),
                ),
            ]
            .into(),
        );
        trim_service(&mut svc);
        assert_eq!(
            svc.metadata.annotations,
            Some([(IDENTITIES.to_string(), "cart".to_string())].into())
        );
        // Oversized: cut just over the bound, so it still fails to parse.
        let long = format!("cart,{}", "é".repeat(MAX_IDENTITIES_BYTES));
        svc.metadata.annotations = Some([(IDENTITIES.to_string(), long)].into());
        trim_service(&mut svc);
        let kept = &svc.metadata.annotations.as_ref().expect("kept")[IDENTITIES];
        assert!(kept.len() <= MAX_IDENTITIES_BYTES + 1);
        assert!(parse_identities(kept).is_err());
        svc.metadata.annotations = Some([("other".to_string(), String::new())].into());
        trim_service(&mut svc);
        assert_eq!(svc.metadata.annotations, None);
    }

    #[test]
    fn only_injected_pods_are_proxies() {
        let (d, _debounce) = Discovery::new("cluster.local", None, Debounce::default());
        let key = PodKey {
            namespace: "shop".into(),
            name: "web-0".into(),
        };
        let meta = |injected: bool| ObjectMeta {
            name: Some("web-0".into()),
            namespace: Some("shop".into()),
            annotations: injected.then(|| {
                [(
                    remora_contract::annotations::STATUS.to_string(),
                    "{}".to_string(),
                )]
                .into()
            }),
            ..Default::default()
        };
        pod_changed(
            &d,
            &Change::Applied(Arc::new(LivePod::from_meta(meta(false)))),
        );
        assert!(d.read(|r| r.proxy(&key).is_none()));
        pod_changed(
            &d,
            &Change::Applied(Arc::new(LivePod::from_meta(meta(true)))),
        );
        let sa = d.read(|r| r.proxy(&key).map(|p| p.service_account.clone()));
        assert_eq!(sa.as_deref(), Some("default"));
        pod_changed(
            &d,
            &Change::Deleted(Arc::new(LivePod::from_meta(meta(true)))),
        );
        assert!(d.read(|r| r.proxy(&key).is_none()));
    }

    /// A pod of the watch that starts deleting leaves its Service's
    /// endpoints at once, tracked; Ready again (a readiness blip), it returns.
    #[tokio::test]
    async fn a_deleting_or_unready_pod_is_withdrawn_from_the_watch() {
        use k8s_openapi::api::core::v1::{Pod, PodCondition, PodStatus};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let (d, debounce) = Discovery::new("cluster.local", None, Debounce::default());
        tokio::spawn(debounce);
        let cart = ServiceHost {
            name: "cart".into(),
            namespace: "shop".into(),
        };
        let ip: std::net::IpAddr = "10.0.0.1".parse().expect("ip");
        service_changed(&d, &Change::Applied(service(None)));
        d.update(|r| {
            r.apply_slice(
                ("shop".into(), "cart-abc".into()),
                SliceInfo {
                    service: Some(cart.clone()),
                    ports: [(String::new(), 8080)].into(),
                    ready: [ip].into(),
                    pods: [(ip, "cart-0".to_string())].into(),
                },
            )
        });
        let pod = |ready: &str, deleting: bool| {
            let p = Pod {
                metadata: ObjectMeta {
                    name: Some("cart-0".into()),
                    namespace: Some("shop".into()),
                    annotations: Some(
                        [(
                            remora_contract::annotations::STATUS.to_string(),
                            "{}".to_string(),
                        )]
                        .into(),
                    ),
                    deletion_timestamp: deleting.then(|| Time(Default::default())),
                    ..Default::default()
                },
                status: Some(PodStatus {
                    pod_ip: Some(ip.to_string()),
                    conditions: Some(vec![PodCondition {
                        type_: "Ready".into(),
                        status: ready.into(),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
                ..Default::default()
            };
            Change::Applied(Arc::new(crate::cluster::live_pod::read(&p)))
        };
        let key = PodKey {
            namespace: "shop".into(),
            name: "cart-0".into(),
        };
        let served = || d.read(|r| r.endpoints(&cart, 80).len());
        pod_changed(&d, &pod("True", false));
        assert_eq!(served(), 1);
        assert!(d.withdrawals.progress(&key).is_none());
        pod_changed(&d, &pod("False", false));
        assert_eq!(served(), 0, "not Ready: withdrawn");
        pod_changed(&d, &pod("True", false));
        assert_eq!(served(), 1, "Ready again: back");
        assert!(d.withdrawals.progress(&key).is_none());
        // Not Ready, with none of its addresses served: still starting, not
        // tracked (nobody can have held it).
        let mut starting = pod("False", false);
        if let Change::Applied(p) = &mut starting {
            let p = Arc::make_mut(p);
            p.metadata.name = Some("cart-9".into());
        }
        pod_changed(&d, &starting);
        let cart_9 = PodKey {
            name: "cart-9".into(),
            ..key.clone()
        };
        assert!(d.read(|r| r.is_withdrawn(&cart_9)));
        assert!(d.withdrawals.progress(&cart_9).is_none());
        pod_changed(&d, &pod("True", true));
        assert_eq!(served(), 0, "deleting: withdrawn though Ready");
        // Nobody held it: done at once.
        let p = d.withdrawals.progress(&key).expect("withdrawn");
        assert_eq!((p.expected, p.done), (0, true));
        pod_changed(
            &d,
            &Change::Deleted(Arc::new(LivePod::from_meta(ObjectMeta {
                name: Some("cart-0".into()),
                namespace: Some("shop".into()),
                ..Default::default()
            }))),
        );
        assert!(d.withdrawals.progress(&key).is_none());
    }

    /// What the agent is sent of its pod, read as the pod watch reads a pod
    /// (the lifecycle kept apart, everything else Remora does not read gone).
    #[test]
    fn a_proxy_keeps_the_annotations_its_agent_reads() {
        use remora_contract::annotations::{LIFECYCLE, OUTBOUND, QUIET_PERIOD, STATUS, STOP};
        let pod = k8s_openapi::api::core::v1::Pod {
            metadata: ObjectMeta {
                name: Some("job-0".into()),
                namespace: Some("shop".into()),
                annotations: Some(
                    [
                        (STATUS, r#"{"mtlsPorts":[15006,15007]}"#),
                        (LIFECYCLE, r#"{"mode":"Legacy"}"#),
                        (QUIET_PERIOD, "1s"),
                        (STOP, "AppsCompleted"),
                        (OUTBOUND, "15001:cart.shop:80"),
                        ("kubectl.kubernetes.io/last-applied-configuration", "{}"),
                    ]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        };
        let live = crate::cluster::live_pod::read(&pod);
        let (_, info) = ProxyInfo::read(&live).expect("injected");
        let keys: Vec<&str> = info.agent_annotations.keys().map(String::as_str).collect();
        assert_eq!(keys, [LIFECYCLE, QUIET_PERIOD, STOP]);
        assert_eq!(info.agent_annotations[LIFECYCLE], r#"{"mode":"Legacy"}"#);
        // What its sidecar accepts, as the webhook recorded it.
        assert_eq!(info.mtls_ports, [15006, 15007].into());
    }

    #[test]
    fn external_services_and_workloads_feed_the_registry() {
        use remora_crds::external::{
            ExternalHost, ExternalPort, ExternalProtocol, ExternalServiceSpec,
            ExternalWorkloadSpec, WorkloadEndpoint,
        };
        let (d, _debounce) = Discovery::new("cluster.local", None, Debounce::default());
        let meta = |name: &str| ObjectMeta {
            name: Some(name.into()),
            namespace: Some("shop".into()),
            ..Default::default()
        };
        let es = Arc::new(ExternalService {
            metadata: meta("api"),
            spec: ExternalServiceSpec {
                hosts: vec![ExternalHost("api.example.com".into())],
                ports: vec![ExternalPort {
                    number: 443,
                    name: "https".into(),
                    protocol: ExternalProtocol::Tls,
                    target_port: None,
                }],
                workload_selector: Some(remora_crds::WorkloadSelector::default()),
                ..Default::default()
            },
            status: None,
        });
        let wl = |address: &str| {
            Arc::new(ExternalWorkload {
                metadata: meta("vm-1"),
                spec: ExternalWorkloadSpec {
                    endpoint: WorkloadEndpoint {
                        address: address.into(),
                        ..Default::default()
                    },
                    labels: Default::default(),
                },
            })
        };
        let key = ("shop".to_string(), "api".to_string());
        let endpoints = || d.read(|r| r.externals().endpoints(&key, 443).len());
        external_service_changed(&d, &Change::Applied(Arc::clone(&es)));
        external_workload_changed(&d, &Change::Applied(wl("192.0.2.1")));
        assert_eq!(endpoints(), 1);
        // No longer an IP: no longer an endpoint.
        external_workload_changed(&d, &Change::Applied(wl("vm.example.com")));
        assert_eq!(endpoints(), 0);
        external_service_changed(&d, &Change::Deleted(es));
        assert!(d.read(|r| r.externals().holder("api.example.com").is_none()));
    }
}
