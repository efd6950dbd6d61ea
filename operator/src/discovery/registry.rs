//! What the discovery server knows of the cluster, pure: Services (their
//! ports, what protocol each speaks, the identities they declare), the
//! ready endpoints of each Service port (from its EndpointSlices, with the
//! pod each names) and the proxies (injected pods: IP, ServiceAccount,
//! `remora.dev/outbound`, the ports on which their sidecar accepts the
//! mesh's mTLS), and the services outside the cluster
//! ([`super::external`]). Fed change by change from the shared watches; each change
//! says what it touched, so the server recomputes only the proxies that
//! depend on it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use remora_contract::annotations::IDENTITIES;
use remora_contract::discovery::ServiceHost;
use remora_contract::mesh::parse_identities;

use super::external::{ExternalInfo, Externals, ObjKey, WorkloadInfo};
use super::inbound::ServedInbound;
use crate::cluster::live_pod::LivePod;

/// The label an EndpointSlice names its Service by.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Ports kept of one Service, and endpoints of one EndpointSlice: the API
/// allows 100 and 1,000; more read as none (no input may cost unbounded).
pub const MAX_PORTS: usize = 100;
pub const MAX_SLICE_ENDPOINTS: usize = 1000;

/// How a Service port's traffic is proxied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// HTTP/1.1, h2c or gRPC: balanced per request.
    Http,
    /// Bytes: balanced per connection.
    Tcp,
}

impl Protocol {
    /// From `appProtocol`, else the port's name (Istio's `tcp-..` prefix
    /// convention); HTTP when neither says otherwise, as the issue asks. TLS
    /// (`https`, `tls`) is TCP: the sidecar cannot read it.
    pub fn of(app_protocol: Option<&str>, name: Option<&str>) -> Self {
        let tcp = |p: &str| {
            let p = p.to_ascii_lowercase();
            let base = p.split('-').next().unwrap_or_default();
            matches!(base, "tcp" | "tls" | "https" | "mongo" | "mysql" | "redis")
        };
        match app_protocol {
            Some(p) if !p.is_empty() => {
                if tcp(p) {
                    Self::Tcp
                } else {
                    Self::Http
                }
            }
            _ => match name {
                Some(n) if tcp(n) => Self::Tcp,
                _ => Self::Http,
            },
        }
    }
}

/// A Service port as discovery reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub port: u16,
    /// Empty for the single unnamed port; an EndpointSlice port of the same
    /// name carries its target port.
    pub name: String,
    pub protocol: Protocol,
}

/// A Service as discovery reads it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceInfo {
    pub ports: Vec<ServicePort>,
    /// `remora.dev/identities`: the ServiceAccounts whose pods may serve it,
    /// `None` when it declares none. A value that does not parse declares
    /// the empty set: no endpoint is admitted (fail closed).
    pub identities: Option<BTreeSet<String>>,
}

impl ServiceInfo {
    /// The TCP ports of `svc`; UDP and SCTP ports are not proxied.
    /// `None` for an ExternalName Service (no endpoints to serve).
    pub fn read(svc: &Service) -> Option<(ServiceHost, Self)> {
        let host = ServiceHost {
            name: svc.metadata.name.clone()?,
            namespace: svc.metadata.namespace.clone()?,
        };
        let spec = svc.spec.as_ref()?;
        if spec.type_.as_deref() == Some("ExternalName") {
            return None;
        }
        let identities = svc
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(IDENTITIES))
            .map(|raw| {
                parse_identities(raw).unwrap_or_else(|reason| {
                    // Info, not warn: whoever writes Services writes the log.
                    tracing::info!(
                        service = %format_args!("{}/{}", host.namespace, host.name),
                        %reason,
                        "{IDENTITIES} does not parse: no endpoint of the Service is sent"
                    );
                    BTreeSet::new()
                })
            });
        let all = spec.ports.as_deref().unwrap_or_default();
        let ports = if all.len() > MAX_PORTS {
            Vec::new()
        } else {
            all.iter()
                .filter(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
                .filter_map(|p| {
                    Some(ServicePort {
                        port: u16::try_from(p.port).ok()?,
                        name: p.name.clone().unwrap_or_default(),
                        protocol: Protocol::of(p.app_protocol.as_deref(), p.name.as_deref()),
                    })
                })
                .collect()
        };
        Some((host, Self { ports, identities }))
    }

    pub fn port(&self, port: u16) -> Option<&ServicePort> {
        self.ports.iter().find(|p| p.port == port)
    }
}

/// One EndpointSlice, as discovery reads it: its ready addresses, the pods
/// they belong to, and its ports by name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SliceInfo {
    pub service: Option<ServiceHost>,
    /// Port name (empty for unnamed) → target port.
    pub ports: BTreeMap<String, u16>,
    pub ready: BTreeSet<IpAddr>,
    /// Ready address → the pod of the slice's namespace its `targetRef`
    /// names (the EndpointSlice controller's record of whose it is).
    pub pods: BTreeMap<IpAddr, String>,
}

impl SliceInfo {
    pub fn read(slice: &EndpointSlice) -> Self {
        let namespace = slice.metadata.namespace.clone().unwrap_or_default();
        let service = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
            .filter(|n| !n.is_empty() && !namespace.is_empty())
            .map(|name| ServiceHost {
                name: name.clone(),
                namespace: namespace.clone(),
            });
        let ports = slice
            .ports
            .iter()
            .flatten()
            .take(MAX_PORTS)
            .filter(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
            .filter_map(|p| {
                let port = u16::try_from(p.port?).ok()?;
                Some((p.name.clone().unwrap_or_default(), port))
            })
            .collect();
        let endpoints = slice.endpoints.as_deref().unwrap_or_default();
        let mut ready = BTreeSet::new();
        let mut pods = BTreeMap::new();
        if endpoints.len() <= MAX_SLICE_ENDPOINTS {
            // No condition is ready: the API's "unknown" means serve it.
            let serving = endpoints
                .iter()
                .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false));
            for e in serving {
                let pod = e.target_ref.as_ref().filter(|r| {
                    r.kind.as_deref() == Some("Pod")
                        && r.namespace.as_deref().is_none_or(|n| n == namespace)
                });
                for ip in e.addresses.iter().filter_map(|a| a.parse::<IpAddr>().ok()) {
                    ready.insert(ip);
                    if let Some(name) = pod.and_then(|r| r.name.clone()) {
                        pods.insert(ip, name);
                    }
                }
            }
        }
        Self {
            service,
            ports,
            ready,
            pods,
        }
    }
}

/// A proxy: an injected pod the discovery server may serve.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProxyInfo {
    pub ip: Option<String>,
    pub service_account: String,
    /// `remora.dev/outbound` as the pod carries it.
    pub outbound: Option<Arc<str>>,
    /// Its inbound listeners ([`super::inbound`]).
    pub inbound: Arc<ServedInbound>,
    /// The annotations its agent reads while it runs
    /// ([`remora_contract::discovery::sent_to_agent`]).
    pub agent_annotations: BTreeMap<String, String>,
    /// The inbound ports on which its sidecar accepts the mesh's mTLS
    /// (`remora.dev/status`): none unless the workload CA is wired.
    pub mtls_ports: BTreeSet<u16>,
    /// Its pod is deleting or not Ready: its addresses are withdrawn from
    /// every Service's endpoints, whatever its EndpointSlices still say
    /// (a terminating pod stays `serving` in them).
    pub withdrawn: bool,
    /// Its pod is deleting (withdrawn, then, too).
    pub deleting: bool,
}

impl ProxyInfo {
    /// `None` for a pod Remora did not inject (it runs no proxy).
    pub fn read(pod: &LivePod) -> Option<(PodKey, Self)> {
        pod.injected()?;
        let key = PodKey {
            namespace: pod.metadata.namespace.clone()?,
            name: pod.metadata.name.clone()?,
        };
        Some((
            key,
            Self {
                ip: pod.ip().map(str::to_string),
                // The API server sets it; "default" when it did not.
                service_account: pod.service_account().unwrap_or("default").to_string(),
                outbound: pod.outbound().map(Arc::from),
                inbound: ServedInbound::read(pod),
                agent_annotations: agent_annotations(pod),
                mtls_ports: pod
                    .injected()
                    .map(|i| i.mtls_ports.iter().copied().collect())
                    .unwrap_or_default(),
                withdrawn: pod.deleting() || pod.ready() == Some(false),
                deleting: pod.deleting(),
            },
        ))
    }
}

/// The pod's annotations its agent reads, with the lifecycle the pod
/// watch keeps apart.
fn agent_annotations(pod: &LivePod) -> BTreeMap<String, String> {
    let mut a: BTreeMap<String, String> = pod
        .annotations()
        .iter()
        .filter(|(k, _)| remora_contract::discovery::sent_to_agent(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Some(l) = pod.lifecycle() {
        a.insert(remora_contract::annotations::LIFECYCLE.into(), l.into());
    }
    a
}

/// Who holds the hosts `keys` ([`super::external::external_key`]) changed:
/// a change of what their dependents get, listeners and clusters included.
fn hosts_touched(keys: Vec<ServiceHost>) -> Vec<Touched> {
    keys.into_iter().map(Touched::Service).collect()
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
}

/// What discovery knows of the pod behind one endpoint, as secure naming
/// needs it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Backend {
    /// A pod whose sidecar accepts the mesh's mTLS on the endpoint's port,
    /// running under this ServiceAccount.
    Meshed { service_account: String },
    /// Anything else: an address no pod is named for, a pod Remora did not
    /// inject or injected without the workload CA (or before it recorded
    /// its mTLS ports), a port its sidecar does not listen on.
    Plain,
}

/// What one change touched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Touched {
    /// A Service's ports (listeners and clusters of its dependents).
    Service(ServiceHost),
    /// A Service's endpoints only.
    Endpoints(ServiceHost),
    /// A proxy's own pod.
    Pod(PodKey),
}

/// The registry. Every `apply_*`/`delete_*` returns what it changed, or
/// `None` when nothing discovery serves changed (a status update, say).
#[derive(Debug, Default)]
pub struct Registry {
    services: BTreeMap<ServiceHost, ServiceInfo>,
    /// (namespace, slice name) → slice.
    slices: BTreeMap<(String, String), SliceInfo>,
    /// Service → the slices naming it.
    by_service: BTreeMap<ServiceHost, BTreeSet<(String, String)>>,
    /// Pod → the slices with an endpoint naming it (their Services'
    /// endpoints change with what the pod's sidecar accepts).
    by_pod: BTreeMap<PodKey, BTreeSet<(String, String)>>,
    proxies: BTreeMap<PodKey, ProxyInfo>,
    /// The proxies' pods whose addresses are withdrawn
    /// ([`ProxyInfo::withdrawn`]): left out of every Service's endpoints.
    withdrawn: BTreeSet<PodKey>,
    externals: Externals,
    /// The operator's own Service and this replica's pod: who the other
    /// discovery replicas are ([`Registry::other_replicas`]).
    replicas: Option<Replicas>,
}

/// How a replica finds the other discovery replicas: the ready endpoints
/// of the operator's Service at its discovery port, read from the shared
/// EndpointSlice watch (no watch of its own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replicas {
    pub service: ServiceHost,
    /// This replica's pod (`POD_NAME`), left out. Without it a replica
    /// cannot tell itself from the others and names none.
    pub own_pod: String,
}

impl Registry {
    /// The services outside the cluster.
    pub fn externals(&self) -> &Externals {
        &self.externals
    }

    /// Which Service the discovery replicas back, and which pod this one is.
    pub fn set_replicas(&mut self, replicas: Option<Replicas>) {
        self.replicas = replicas;
    }

    /// The other discovery replicas serving now, by pod name: each ready
    /// address of the operator's Service's slices at the target port named
    /// [`remora_contract::discovery::PORT_NAME`], this replica's pod left
    /// out, at most [`remora_contract::discovery::MAX_DISCOVERY_REPLICAS`]
    /// (the first by name). An address without a pod named is no replica
    /// the agent could name: left out.
    pub fn other_replicas(&self) -> BTreeMap<String, SocketAddr> {
        use remora_contract::discovery::{MAX_DISCOVERY_REPLICAS, PORT_NAME};
        let Some(me) = &self.replicas else {
            return BTreeMap::new();
        };
        let mut out = BTreeMap::new();
        let slices = self
            .by_service
            .get(&me.service)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.get(k));
        for s in slices {
            let Some(port) = s.ports.get(PORT_NAME).copied() else {
                continue;
            };
            for (ip, pod) in &s.pods {
                if me.own_pod != *pod {
                    out.insert(pod.clone(), SocketAddr::new(*ip, port));
                }
            }
        }
        out.into_iter().take(MAX_DISCOVERY_REPLICAS).collect()
    }

    /// The operator's namespace, whose ExternalServices may claim any host.
    pub fn set_mesh_namespace(&mut self, namespace: Option<String>) {
        self.externals.mesh_namespace = namespace;
    }

    pub fn apply_external_service(&mut self, key: ObjKey, info: ExternalInfo) -> Vec<Touched> {
        hosts_touched(self.externals.apply_service(key, info))
    }

    pub fn delete_external_service(&mut self, key: &ObjKey) -> Vec<Touched> {
        hosts_touched(self.externals.delete_service(key))
    }

    pub fn apply_external_workload(&mut self, key: ObjKey, info: WorkloadInfo) -> Vec<Touched> {
        hosts_touched(self.externals.apply_workload(key, info))
    }

    pub fn delete_external_workload(&mut self, key: &ObjKey) -> Vec<Touched> {
        hosts_touched(self.externals.delete_workload(key))
    }

    pub fn apply_service(&mut self, host: ServiceHost, info: ServiceInfo) -> Option<Touched> {
        if self.services.get(&host) == Some(&info) {
            return None;
        }
        self.services.insert(host.clone(), info);
        Some(Touched::Service(host))
    }

    pub fn delete_service(&mut self, host: &ServiceHost) -> Option<Touched> {
        self.services.remove(host)?;
        Some(Touched::Service(host.clone()))
    }

    /// A slice created or changed; `key` is (namespace, name).
    pub fn apply_slice(&mut self, key: (String, String), slice: SliceInfo) -> Vec<Touched> {
        if self.slices.get(&key) == Some(&slice) {
            return Vec::new();
        }
        let mut touched = self.delete_slice(&key);
        for name in slice.pods.values() {
            let pod = PodKey {
                namespace: key.0.clone(),
                name: name.clone(),
            };
            self.by_pod.entry(pod).or_default().insert(key.clone());
        }
        if let Some(svc) = &slice.service {
            self.by_service
                .entry(svc.clone())
                .or_default()
                .insert(key.clone());
            let t = Touched::Endpoints(svc.clone());
            if !touched.contains(&t) {
                touched.push(t);
            }
        }
        self.slices.insert(key, slice);
        touched
    }

    pub fn delete_slice(&mut self, key: &(String, String)) -> Vec<Touched> {
        let Some(old) = self.slices.remove(key) else {
            return Vec::new();
        };
        for name in old.pods.values() {
            let pod = PodKey {
                namespace: key.0.clone(),
                name: name.clone(),
            };
            if let Some(keys) = self.by_pod.get_mut(&pod) {
                keys.remove(key);
                if keys.is_empty() {
                    self.by_pod.remove(&pod);
                }
            }
        }
        let Some(svc) = old.service else {
            return Vec::new();
        };
        if let Some(keys) = self.by_service.get_mut(&svc) {
            keys.remove(key);
            if keys.is_empty() {
                self.by_service.remove(&svc);
            }
        }
        vec![Touched::Endpoints(svc)]
    }

    /// A proxy's pod created or changed: its own configuration, and the
    /// endpoints of the Services it serves if what its sidecar accepts
    /// (ServiceAccount, mTLS ports) changed.
    pub fn apply_proxy(&mut self, key: PodKey, info: ProxyInfo) -> Vec<Touched> {
        let old = self.proxies.get(&key);
        if old == Some(&info) {
            return Vec::new();
        }
        let serving =
            |p: &ProxyInfo| (p.service_account.clone(), p.mtls_ports.clone(), p.withdrawn);
        let served_changed = old.map(serving) != Some(serving(&info));
        if info.withdrawn {
            self.withdrawn.insert(key.clone());
        } else {
            self.withdrawn.remove(&key);
        }
        self.proxies.insert(key.clone(), info);
        let mut touched = vec![Touched::Pod(key.clone())];
        if served_changed {
            touched.extend(self.services_served_by(&key));
        }
        touched
    }

    pub fn delete_proxy(&mut self, key: &PodKey) -> Vec<Touched> {
        if self.proxies.remove(key).is_none() {
            return Vec::new();
        }
        self.withdrawn.remove(key);
        let mut touched = vec![Touched::Pod(key.clone())];
        touched.extend(self.services_served_by(key));
        touched
    }

    /// The endpoints of every Service with an endpoint naming `pod`.
    fn services_served_by(&self, pod: &PodKey) -> Vec<Touched> {
        let services: BTreeSet<&ServiceHost> = self
            .by_pod
            .get(pod)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.get(k)?.service.as_ref())
            .collect();
        services
            .into_iter()
            .map(|s| Touched::Endpoints(s.clone()))
            .collect()
    }

    /// Whether `pod`'s addresses are withdrawn ([`ProxyInfo::withdrawn`]).
    pub fn is_withdrawn(&self, pod: &PodKey) -> bool {
        self.withdrawn.contains(pod)
    }

    /// The addresses the EndpointSlices name ready for `pod`, withdrawn or
    /// not: what a proxy holding one of its Services' endpoints may route to.
    pub fn addresses(&self, pod: &PodKey) -> BTreeSet<IpAddr> {
        self.by_pod
            .get(pod)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.get(k))
            .flat_map(|s| {
                s.pods
                    .iter()
                    .filter(|(_, name)| **name == pod.name)
                    .map(|(ip, _)| *ip)
            })
            .collect()
    }

    pub fn service(&self, host: &ServiceHost) -> Option<&ServiceInfo> {
        self.services.get(host)
    }

    pub fn proxy(&self, key: &PodKey) -> Option<&ProxyInfo> {
        self.proxies.get(key)
    }

    /// The ready endpoints of `host`'s port `port`: each ready address of
    /// its slices at the target port of the slice port of the same name,
    /// with what is known of its pod. An address two slices name for
    /// different pods is taken as meshed if either says so (it is then
    /// reached over mTLS, whose identity check fails closed).
    pub fn endpoints(&self, host: &ServiceHost, port: u16) -> BTreeMap<SocketAddr, Backend> {
        let mut out = BTreeMap::new();
        let Some(sp) = self.services.get(host).and_then(|s| s.port(port)) else {
            return out;
        };
        let slices = self
            .by_service
            .get(host)
            .into_iter()
            .flatten()
            .filter_map(|k| Some((&k.0, self.slices.get(k)?)));
        for (namespace, s) in slices {
            let Some(target) = s.ports.get(&sp.name).copied() else {
                continue;
            };
            for ip in &s.ready {
                if self.withdrawn_ip(namespace, s.pods.get(ip)) {
                    continue;
                }
                let backend = self.backend(namespace, s.pods.get(ip), target);
                let slot = out
                    .entry(SocketAddr::new(*ip, target))
                    .or_insert(Backend::Plain);
                if *slot == Backend::Plain {
                    *slot = backend;
                }
            }
        }
        out
    }

    /// Whether the pod `name` of `namespace` is withdrawn.
    fn withdrawn_ip(&self, namespace: &str, name: Option<&String>) -> bool {
        !self.withdrawn.is_empty()
            && name.is_some_and(|name| {
                self.withdrawn.contains(&PodKey {
                    namespace: namespace.to_string(),
                    name: name.clone(),
                })
            })
    }

    /// What the pod `name` of `namespace` accepts on `port`.
    fn backend(&self, namespace: &str, name: Option<&String>, port: u16) -> Backend {
        let proxy = name.and_then(|name| {
            self.proxies.get(&PodKey {
                namespace: namespace.to_string(),
                name: name.clone(),
            })
        });
        match proxy {
            Some(p) if p.mtls_ports.contains(&port) => Backend::Meshed {
                service_account: p.service_account.clone(),
            },
            _ => Backend::Plain,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ServicePort as KPort, ServiceSpec};
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};
    use kube::api::ObjectMeta;

    fn host(name: &str) -> ServiceHost {
        ServiceHost {
            name: name.into(),
            namespace: "shop".into(),
        }
    }

    fn service(name: &str, ports: &[(i32, Option<&str>, Option<&str>)]) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("shop".into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                ports: Some(
                    ports
                        .iter()
                        .map(|(port, name, app)| KPort {
                            port: *port,
                            name: name.map(str::to_string),
                            app_protocol: app.map(str::to_string),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn slice(svc: &str, ports: &[(&str, i32)], eps: &[(&str, Option<bool>)]) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(format!("{svc}-abc")),
                namespace: Some("shop".into()),
                labels: Some([(SERVICE_NAME_LABEL.to_string(), svc.to_string())].into()),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p)| EndpointPort {
                        name: Some(n.to_string()),
                        port: Some(*p),
                        ..Default::default()
                    })
                    .collect(),
            ),
            endpoints: Some(
                eps.iter()
                    .map(|(a, ready)| Endpoint {
                        addresses: vec![a.to_string()],
                        conditions: Some(EndpointConditions {
                            ready: *ready,
                            ..Default::default()
                        }),
                        ..Default::default()
                    })
                    .collect(),
            ),
        }
    }

    #[test]
    fn protocols_from_app_protocol_then_name() {
        assert_eq!(Protocol::of(Some("tcp"), Some("http")), Protocol::Tcp);
        assert_eq!(Protocol::of(Some("grpc"), Some("tcp-x")), Protocol::Http);
        assert_eq!(
            Protocol::of(Some("kubernetes.io/h2c"), None),
            Protocol::Http
        );
        assert_eq!(Protocol::of(None, Some("tcp-db")), Protocol::Tcp);
        assert_eq!(Protocol::of(None, Some("https")), Protocol::Tcp);
        assert_eq!(Protocol::of(None, Some("web")), Protocol::Http);
        assert_eq!(Protocol::of(None, None), Protocol::Http);
    }

    /// The other discovery replicas: the ready pods of the operator's
    /// Service at its discovery port, this replica left out, bounded.
    #[test]
    fn other_replicas_are_the_ready_pods_of_the_operators_service_but_this_one() {
        use remora_contract::discovery::{MAX_DISCOVERY_REPLICAS, PORT_NAME};
        let mut r = Registry::default();
        let operator = ServiceHost {
            name: "remora".into(),
            namespace: "remora-system".into(),
        };
        let ip = |n: u8| IpAddr::from([10, 0, 1, n]);
        let slice = |ready: &[(u8, &str)]| SliceInfo {
            service: Some(operator.clone()),
            ports: [(PORT_NAME.to_string(), 15010), ("https".to_string(), 8443)].into(),
            ready: ready.iter().map(|(n, _)| ip(*n)).collect(),
            pods: ready.iter().map(|(n, p)| (ip(*n), p.to_string())).collect(),
        };
        let key = ("remora-system".to_string(), "remora-x1".to_string());
        r.apply_slice(key.clone(), slice(&[(1, "op-a"), (2, "op-b"), (3, "op-c")]));
        assert!(r.other_replicas().is_empty(), "no Service set: none");
        r.set_replicas(Some(Replicas {
            service: operator.clone(),
            own_pod: "op-b".into(),
        }));
        let others = r.other_replicas();
        assert_eq!(
            others,
            BTreeMap::from([
                ("op-a".to_string(), SocketAddr::new(ip(1), 15010)),
                ("op-c".to_string(), SocketAddr::new(ip(3), 15010)),
            ])
        );
        // A replica not ready any more (terminating) is no longer named.
        r.apply_slice(key.clone(), slice(&[(2, "op-b"), (3, "op-c")]));
        assert_eq!(r.other_replicas().keys().collect::<Vec<_>>(), ["op-c"]);
        // A slice without the discovery port names none; many are bounded.
        let many: Vec<(u8, String)> = (10..60).map(|n| (n, format!("op-{n}"))).collect();
        let many: Vec<(u8, &str)> = many.iter().map(|(n, p)| (*n, p.as_str())).collect();
        r.apply_slice(key.clone(), slice(&many));
        assert_eq!(r.other_replicas().len(), MAX_DISCOVERY_REPLICAS);
        r.apply_slice(
            key,
            SliceInfo {
                ports: [("https".to_string(), 8443)].into(),
                ..slice(&[(1, "op-a")])
            },
        );
        assert!(r.other_replicas().is_empty());
    }

    #[test]
    fn endpoints_are_the_ready_addresses_at_the_named_target_port() {
        let mut r = Registry::default();
        let (h, info) = ServiceInfo::read(&service(
            "cart",
            &[(80, Some("http"), None), (9000, Some("tcp-db"), None)],
        ))
        .expect("service");
        assert_eq!(
            r.apply_service(h.clone(), info.clone()),
            Some(Touched::Service(h.clone()))
        );
        assert_eq!(r.apply_service(h.clone(), info), None, "unchanged");
        let s = slice(
            "cart",
            &[("http", 8080), ("tcp-db", 5432)],
            &[
                ("10.0.0.1", Some(true)),
                ("10.0.0.2", None),
                ("10.0.0.3", Some(false)),
            ],
        );
        let key = ("shop".to_string(), "cart-abc".to_string());
        assert_eq!(
            r.apply_slice(key.clone(), SliceInfo::read(&s)),
            vec![Touched::Endpoints(h.clone())]
        );
        let eps: Vec<String> = r
            .endpoints(&h, 80)
            .keys()
            .map(ToString::to_string)
            .collect();
        assert_eq!(eps, ["10.0.0.1:8080", "10.0.0.2:8080"]);
        let db: Vec<String> = r
            .endpoints(&h, 9000)
            .keys()
            .map(ToString::to_string)
            .collect();
        assert_eq!(db, ["10.0.0.1:5432", "10.0.0.2:5432"]);
        assert!(r.endpoints(&h, 81).is_empty(), "no such port");
        assert!(r.endpoints(&host("other"), 80).is_empty());
        assert_eq!(
            r.apply_slice(key.clone(), SliceInfo::read(&s)),
            vec![],
            "unchanged"
        );
        assert_eq!(r.delete_slice(&key), vec![Touched::Endpoints(h.clone())]);
        assert!(r.endpoints(&h, 80).is_empty());
        assert_eq!(r.delete_service(&h), Some(Touched::Service(h)));
    }

    #[test]
    fn bad_and_oversized_input_reads_as_nothing() {
        let mut s = slice(
            "cart",
            &[("", 8080)],
            &[("not-an-ip", None), ("10.0.0.1", None)],
        );
        assert_eq!(SliceInfo::read(&s).ready.len(), 1);
        s.endpoints = Some(vec![Endpoint::default(); MAX_SLICE_ENDPOINTS + 1]);
        assert!(SliceInfo::read(&s).ready.is_empty());
        s.metadata.labels = None;
        assert_eq!(SliceInfo::read(&s).service, None);
        let mut svc = service("cart", &[(80, None, None)]);
        svc.spec.as_mut().expect("spec").type_ = Some("ExternalName".into());
        assert!(ServiceInfo::read(&svc).is_none());
        let many: Vec<_> = (1..=101).map(|p| (p, None, None)).collect();
        let (_, info) = ServiceInfo::read(&service("cart", &many)).expect("read");
        assert!(info.ports.is_empty());
    }

    fn proxy(sa: &str, mtls_ports: &[u16]) -> ProxyInfo {
        ProxyInfo {
            service_account: sa.into(),
            mtls_ports: mtls_ports.iter().copied().collect(),
            ..Default::default()
        }
    }

    fn pod(name: &str) -> PodKey {
        PodKey {
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    #[test]
    fn an_endpoint_is_meshed_when_its_pods_sidecar_takes_mtls_on_its_port() {
        use k8s_openapi::api::core::v1::ObjectReference;
        let mut r = Registry::default();
        let (h, info) =
            ServiceInfo::read(&service("cart", &[(80, Some("http"), None)])).expect("service");
        r.apply_service(h.clone(), info);
        let mut s = slice(
            "cart",
            &[("http", 15006)],
            &[
                ("10.0.0.1", None),
                ("10.0.0.2", None),
                ("10.0.0.3", None),
                ("10.0.0.4", None),
                ("10.0.0.5", None),
            ],
        );
        let refs = [
            (Some("Pod"), Some("shop"), "a"),
            (Some("Pod"), None, "b"),
            (Some("Pod"), Some("elsewhere"), "a"),
            (Some("Node"), Some("shop"), "a"),
        ];
        for (e, (kind, ns, name)) in s.endpoints.iter_mut().flatten().zip(refs) {
            e.target_ref = Some(ObjectReference {
                kind: kind.map(str::to_string),
                namespace: ns.map(str::to_string),
                name: Some(name.into()),
                ..Default::default()
            });
        }
        let read = SliceInfo::read(&s);
        let named: Vec<(String, &str)> = read
            .pods
            .iter()
            .map(|(ip, p)| (ip.to_string(), p.as_str()))
            .collect();
        // Only pods of the slice's namespace are taken at their word.
        assert_eq!(
            named,
            [("10.0.0.1".to_string(), "a"), ("10.0.0.2".to_string(), "b")]
        );
        let key = ("shop".to_string(), "cart-abc".to_string());
        r.apply_slice(key.clone(), read);

        assert_eq!(
            r.apply_proxy(pod("a"), proxy("cart", &[15006])),
            [Touched::Pod(pod("a")), Touched::Endpoints(h.clone())]
        );
        // b's sidecar has no certificate (no mTLS port).
        r.apply_proxy(pod("b"), proxy("cart", &[]));
        let meshed = |sa: &str| Backend::Meshed {
            service_account: sa.into(),
        };
        let backends =
            |r: &Registry| -> Vec<Backend> { r.endpoints(&h, 80).into_values().collect() };
        assert_eq!(
            backends(&r),
            [
                meshed("cart"),
                Backend::Plain,
                Backend::Plain,
                Backend::Plain,
                Backend::Plain
            ]
        );
        // What b's sidecar accepts changes: the Service's endpoints do.
        assert_eq!(
            r.apply_proxy(pod("b"), proxy("other", &[15006])),
            [Touched::Pod(pod("b")), Touched::Endpoints(h.clone())]
        );
        assert_eq!(backends(&r)[1], meshed("other"));
        // Anything else of it concerns its own proxy only.
        let mut b = proxy("other", &[15006]);
        b.outbound = Some("15001:x.y:80".into());
        assert_eq!(r.apply_proxy(pod("b"), b.clone()), [Touched::Pod(pod("b"))]);
        assert_eq!(r.apply_proxy(pod("b"), b), []);
        // mTLS on another port than the endpoint's is plain text there.
        r.apply_proxy(pod("a"), proxy("cart", &[15007]));
        assert_eq!(backends(&r)[0], Backend::Plain);
        assert_eq!(
            r.delete_proxy(&pod("b")),
            [Touched::Pod(pod("b")), Touched::Endpoints(h.clone())]
        );
        assert_eq!(backends(&r)[1], Backend::Plain);
        // The slice gone, a pod's change no longer touches the Service.
        r.delete_slice(&key);
        assert_eq!(
            r.apply_proxy(pod("a"), proxy("cart", &[15006])),
            [Touched::Pod(pod("a"))]
        );
    }

    /// `cart` with one slice naming pods a (10.0.0.1) and b (10.0.0.2),
    /// whose proxies are known.
    fn withdrawable() -> (Registry, ServiceHost, (String, String), EndpointSlice) {
        use k8s_openapi::api::core::v1::ObjectReference;
        let mut r = Registry::default();
        let (h, info) =
            ServiceInfo::read(&service("cart", &[(80, Some("http"), None)])).expect("service");
        r.apply_service(h.clone(), info);
        let mut s = slice(
            "cart",
            &[("http", 8080)],
            &[("10.0.0.1", Some(true)), ("10.0.0.2", Some(true))],
        );
        for (e, name) in s.endpoints.iter_mut().flatten().zip(["a", "b"]) {
            e.target_ref = Some(ObjectReference {
                kind: Some("Pod".into()),
                name: Some(name.into()),
                ..Default::default()
            });
        }
        let key = ("shop".to_string(), "cart-abc".to_string());
        r.apply_slice(key.clone(), SliceInfo::read(&s));
        r.apply_proxy(pod("a"), proxy("cart", &[]));
        r.apply_proxy(pod("b"), proxy("cart", &[]));
        (r, h, key, s)
    }

    fn addrs(r: &Registry, h: &ServiceHost) -> Vec<String> {
        r.endpoints(h, 80).keys().map(ToString::to_string).collect()
    }

    #[test]
    fn a_withdrawn_pod_leaves_every_endpoint_at_once_and_returns_when_ready() {
        let (mut r, h, _, _) = withdrawable();
        assert_eq!(addrs(&r, &h), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert_eq!(
            r.addresses(&pod("a")),
            BTreeSet::from(["10.0.0.1".parse::<IpAddr>().expect("ip")])
        );
        let withdrawn = ProxyInfo {
            withdrawn: true,
            ..proxy("cart", &[])
        };
        // The Service's endpoints change, before any slice does.
        assert_eq!(
            r.apply_proxy(pod("a"), withdrawn.clone()),
            [Touched::Pod(pod("a")), Touched::Endpoints(h.clone())]
        );
        assert!(r.is_withdrawn(&pod("a")));
        assert_eq!(addrs(&r, &h), ["10.0.0.2:8080"]);
        // Its addresses are still known (who may still route to them).
        assert_eq!(r.addresses(&pod("a")).len(), 1);
        // Ready again, not deleting: it returns.
        assert_eq!(
            r.apply_proxy(pod("a"), proxy("cart", &[])),
            [Touched::Pod(pod("a")), Touched::Endpoints(h.clone())]
        );
        assert!(!r.is_withdrawn(&pod("a")));
        assert_eq!(addrs(&r, &h), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        // Gone from the watch: no longer withdrawn (nothing left to hold).
        r.apply_proxy(pod("b"), withdrawn);
        r.delete_proxy(&pod("b"));
        assert!(!r.is_withdrawn(&pod("b")));
    }

    #[test]
    fn a_slice_update_does_not_bring_a_withdrawn_pod_back() {
        let (mut r, h, key, mut s) = withdrawable();
        r.apply_proxy(
            pod("a"),
            ProxyInfo {
                withdrawn: true,
                ..proxy("cart", &[])
            },
        );
        // The slice changes (a third endpoint), still naming a ready
        // (terminating pods stay serving): a stays out.
        let mut third = s.endpoints.as_ref().expect("endpoints")[1].clone();
        third.addresses = vec!["10.0.0.3".into()];
        third.target_ref = None;
        s.endpoints.as_mut().expect("endpoints").push(third);
        assert_eq!(
            r.apply_slice(key.clone(), SliceInfo::read(&s)),
            [Touched::Endpoints(h.clone())]
        );
        assert_eq!(addrs(&r, &h), ["10.0.0.2:8080", "10.0.0.3:8080"]);
        // A slice deleted and created again: still out.
        r.delete_slice(&key);
        r.apply_slice(key, SliceInfo::read(&s));
        assert_eq!(addrs(&r, &h), ["10.0.0.2:8080", "10.0.0.3:8080"]);
    }

    #[test]
    fn declared_identities_parse_or_admit_none() {
        let mut svc = service("cart", &[(80, None, None)]);
        let read = |svc: &Service| ServiceInfo::read(svc).expect("read").1.identities;
        assert_eq!(read(&svc), None, "not declared");
        for (raw, want) in [
            ("cart, cart-v2", vec!["cart", "cart-v2"]),
            ("spiffe://cluster.local/ns/shop/sa/cart", vec![]),
            ("", vec![]),
        ] {
            svc.metadata.annotations = Some([(IDENTITIES.to_string(), raw.to_string())].into());
            let want: BTreeSet<String> = want.into_iter().map(str::to_string).collect();
            assert_eq!(read(&svc), Some(want), "{raw:?}");
        }
    }
}
