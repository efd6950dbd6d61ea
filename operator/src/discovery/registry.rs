//! What the discovery server knows of the cluster, pure: Services (their
//! ports and what protocol each speaks), the ready endpoints of each
//! Service port (from its EndpointSlices), and the proxies (injected pods:
//! IP, ServiceAccount, `remora.dev/outbound`). Fed change by change from
//! the shared watches; each change says what it touched, so the server
//! recomputes only the proxies that depend on it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use remora_contract::discovery::ServiceHost;

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
        Some((host, Self { ports }))
    }

    pub fn port(&self, port: u16) -> Option<&ServicePort> {
        self.ports.iter().find(|p| p.port == port)
    }
}

/// One EndpointSlice, as discovery reads it: its ready addresses and its
/// ports by name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SliceInfo {
    pub service: Option<ServiceHost>,
    /// Port name (empty for unnamed) → target port.
    pub ports: BTreeMap<String, u16>,
    pub ready: BTreeSet<IpAddr>,
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
        let ready = if endpoints.len() > MAX_SLICE_ENDPOINTS {
            BTreeSet::new()
        } else {
            endpoints
                .iter()
                // No condition is ready: the API's "unknown" means serve it.
                .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
                .flat_map(|e| e.addresses.iter().filter_map(|a| a.parse().ok()))
                .collect()
        };
        Self {
            service,
            ports,
            ready,
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
    /// The annotations its agent reads while it runs
    /// ([`remora_contract::discovery::sent_to_agent`]).
    pub agent_annotations: BTreeMap<String, String>,
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
                agent_annotations: agent_annotations(pod),
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

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
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
    proxies: BTreeMap<PodKey, ProxyInfo>,
}

impl Registry {
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

    pub fn apply_proxy(&mut self, key: PodKey, info: ProxyInfo) -> Option<Touched> {
        if self.proxies.get(&key) == Some(&info) {
            return None;
        }
        self.proxies.insert(key.clone(), info);
        Some(Touched::Pod(key))
    }

    pub fn delete_proxy(&mut self, key: &PodKey) -> Option<Touched> {
        self.proxies.remove(key)?;
        Some(Touched::Pod(key.clone()))
    }

    pub fn service(&self, host: &ServiceHost) -> Option<&ServiceInfo> {
        self.services.get(host)
    }

    pub fn proxy(&self, key: &PodKey) -> Option<&ProxyInfo> {
        self.proxies.get(key)
    }

    /// The ready endpoints of `host`'s port `port`: each ready address of
    /// its slices at the target port of the slice port of the same name.
    pub fn endpoints(&self, host: &ServiceHost, port: u16) -> BTreeSet<SocketAddr> {
        let Some(sp) = self.services.get(host).and_then(|s| s.port(port)) else {
            return BTreeSet::new();
        };
        self.by_service
            .get(host)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.get(k))
            .filter_map(|s| s.ports.get(&sp.name).map(|p| (s, *p)))
            .flat_map(|(s, p)| s.ready.iter().map(move |ip| SocketAddr::new(*ip, p)))
            .collect()
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
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(eps, ["10.0.0.1:8080", "10.0.0.2:8080"]);
        let db: Vec<String> = r
            .endpoints(&h, 9000)
            .iter()
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
}
