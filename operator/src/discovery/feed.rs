//! The registry fed from the shared watches: one of Services and one of
//! EndpointSlices (started here, trimmed to what discovery reads), and the
//! process's pod watch ([`crate::cluster::live_pod::live_pods`], which the
//! leader's controllers share when discovery is on).

use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher;
use kube::{Api, Client};
use remora_contract::annotations::IDENTITIES;
use remora_contract::discovery::ServiceHost;
use remora_contract::mesh::MAX_IDENTITIES_BYTES;
use tokio_util::sync::CancellationToken;

use super::push::Discovery;
use super::registry::{PodKey, ProxyInfo, SERVICE_NAME_LABEL, ServiceInfo, SliceInfo};
use crate::cluster::live_pod::LivePod;
use crate::cluster::watch::{Change, SharedWatch};

/// The watches discovery reads.
pub struct Watches {
    pub services: SharedWatch<Service>,
    pub slices: SharedWatch<EndpointSlice>,
    pub pods: SharedWatch<LivePod>,
}

impl Watches {
    /// Start the Service and EndpointSlice watches until `shutdown`; `pods`
    /// is the process's pod watch.
    pub fn start(client: &Client, pods: SharedWatch<LivePod>, shutdown: CancellationToken) -> Self {
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
    }

    /// Returns once every watch has its first listing.
    pub async fn synced(&self) {
        tokio::join!(
            self.services.listed(),
            self.slices.listed(),
            self.pods.listed()
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

fn pod_changed(d: &Discovery, c: &Change<LivePod>) {
    let o = c.object();
    match (c, ProxyInfo::read(o)) {
        (Change::Applied(_), Some((key, info))) => d.update(|r| r.apply_proxy(key, info)),
        _ => {
            if let (Some(namespace), Some(name)) =
                (o.metadata.namespace.clone(), o.metadata.name.clone())
            {
                d.update(|r| r.delete_proxy(&PodKey { namespace, name }));
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
}
