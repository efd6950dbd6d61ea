//! Services outside the cluster, as the discovery server reads them, pure:
//! `ExternalService`s (hosts, ports, endpoints by address or by label) and
//! the `ExternalWorkload`s they select, who holds each host, and what a
//! change touches. Part of the [`super::registry::Registry`].
//!
//! Who may claim a host (the rule against hijacking, SECURITY.md):
//! - a host of Service shape (`name.namespace`, [`host_owner`]) only from
//!   that namespace or the operator's: a namespace admin cannot redirect
//!   what clients mean by another namespace's Service. A Service of that
//!   name, when it exists, always wins (see resources.rs); a cluster name
//!   (`*.svc`, `*.svc.*`) the CRD refuses outright;
//! - any other host from any namespace that may create ExternalServices;
//! - two claims of one host: the oldest ExternalService (creation time,
//!   then namespace and name) holds it, the other reports HostConflict.
//!
//! An endpoint with a ServiceAccount runs remora-agent with the workload
//! certificate of that ServiceAccount *of the ExternalService's namespace*,
//! so an ExternalService can pin only its own namespace's identities.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use remora_contract::discovery::ServiceHost;
use remora_crds::external::{
    ExternalProtocol, ExternalService, ExternalWorkload, MAX_ENDPOINTS, MAX_HOSTS, MAX_LABELS,
    MAX_PORTS, MAX_SELECTED, WorkloadEndpoint, host_owner,
};

/// (namespace, name) of an object.
pub type ObjKey = (String, String);

/// The key under which the proxies naming `host` depend on the
/// ExternalServices claiming it, in the same set as the Services they
/// depend on: the empty namespace, which no Service has.
pub fn external_key(host: &str) -> ServiceHost {
    ServiceHost {
        name: host.to_string(),
        namespace: String::new(),
    }
}

/// One port of an ExternalService.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalPort {
    pub port: u16,
    pub name: String,
    pub protocol: ExternalProtocol,
    /// The endpoints' port when their map does not name this one.
    pub target: u16,
}

/// One endpoint, from the ExternalService or an ExternalWorkload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalEndpoint {
    pub ip: IpAddr,
    /// Port name → port.
    pub ports: BTreeMap<String, u16>,
    /// It runs remora-agent with this ServiceAccount's certificate (of the
    /// ExternalService's namespace).
    pub service_account: Option<String>,
    /// Envoy's load-balancing weight (unset: 1).
    pub weight: Option<u32>,
}

/// What is known of one endpoint of an ExternalService port.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EndpointMeta {
    pub service_account: Option<String>,
    pub weight: Option<u32>,
}

impl ExternalEndpoint {
    /// `None` for an address that is not an IP (the CRD refuses those; an
    /// object written before a schema change may still carry one).
    fn read(e: &WorkloadEndpoint) -> Option<Self> {
        Some(Self {
            ip: e.address.parse().ok()?,
            ports: e
                .ports
                .iter()
                .take(MAX_PORTS)
                .filter_map(|(n, p)| Some((n.clone(), u16::try_from(*p).ok().filter(|p| *p > 0)?)))
                .collect(),
            service_account: e.service_account.clone().filter(|s| !s.is_empty()),
            // Out of range (the CRD refuses it): the default.
            weight: e
                .weight
                .and_then(|w| u32::try_from(w).ok())
                .filter(|w| *w > 0),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Endpoints(Vec<ExternalEndpoint>),
    /// The ExternalWorkloads of its namespace with all these labels.
    Selector(BTreeMap<String, String>),
}

/// An ExternalService as discovery reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalInfo {
    /// Creation time (Unix seconds): the oldest claim of a host holds it.
    pub created: i64,
    pub generation: Option<i64>,
    pub hosts: BTreeSet<String>,
    pub ports: Vec<ExternalPort>,
    pub source: Source,
    /// `None`: the default (as the agent's static clusters).
    pub connect_timeout: Option<std::time::Duration>,
}

impl ExternalInfo {
    /// Bounded as the CRD is: more hosts, ports or endpoints than it allows
    /// read as none, so an object stored before the bounds costs nothing.
    pub fn read(es: &ExternalService) -> Option<(ObjKey, Self)> {
        let key = (es.metadata.namespace.clone()?, es.metadata.name.clone()?);
        let spec = &es.spec;
        let hosts = if spec.hosts.len() > MAX_HOSTS {
            BTreeSet::new()
        } else {
            spec.hosts
                .iter()
                .map(|h| h.0.trim_end_matches('.').to_ascii_lowercase())
                .collect()
        };
        let ports = if spec.ports.len() > MAX_PORTS {
            Vec::new()
        } else {
            spec.ports
                .iter()
                .filter_map(|p| {
                    let port = u16::try_from(p.number).ok().filter(|p| *p > 0)?;
                    let target = match p.target_port {
                        Some(t) => u16::try_from(t).ok().filter(|t| *t > 0)?,
                        None => port,
                    };
                    Some(ExternalPort {
                        port,
                        name: p.name.clone(),
                        protocol: p.protocol,
                        target,
                    })
                })
                .collect()
        };
        let source = match (&spec.endpoints, &spec.workload_selector) {
            (Some(eps), _) if eps.len() <= MAX_ENDPOINTS => {
                Source::Endpoints(eps.iter().filter_map(ExternalEndpoint::read).collect())
            }
            (Some(_), _) => Source::Endpoints(Vec::new()),
            (None, Some(sel)) if sel.match_labels.len() <= MAX_LABELS => {
                Source::Selector(sel.match_labels.clone())
            }
            // Selects nothing (the CRD requires one of the two).
            (None, _) => Source::Endpoints(Vec::new()),
        };
        let created = es
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or(0, |t| t.0.as_second());
        Some((
            key,
            Self {
                created,
                generation: es.metadata.generation,
                hosts,
                ports,
                source,
                // One that does not parse (the CRD refuses it): the default.
                connect_timeout: spec.connect_timeout.as_ref().and_then(|d| d.parse().ok()),
            },
        ))
    }

    pub fn port(&self, port: u16) -> Option<&ExternalPort> {
        self.ports.iter().find(|p| p.port == port)
    }
}

/// An ExternalWorkload as discovery reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadInfo {
    pub endpoint: ExternalEndpoint,
    pub labels: BTreeMap<String, String>,
}

impl WorkloadInfo {
    /// `None` when it names no object or no IP; more labels than the CRD
    /// allows read as none (it is then selected by no selector but `{}`).
    pub fn read(w: &ExternalWorkload) -> Option<(ObjKey, Self)> {
        let key = (w.metadata.namespace.clone()?, w.metadata.name.clone()?);
        let labels = if w.spec.labels.len() > MAX_LABELS {
            BTreeMap::new()
        } else {
            w.spec.labels.clone()
        };
        Some((
            key,
            Self {
                endpoint: ExternalEndpoint::read(&w.spec.endpoint)?,
                labels,
            },
        ))
    }
}

/// Why an ExternalService does not hold one of its hosts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A host of Service shape of another namespace.
    NotOwned(String),
    /// Held by an older ExternalService.
    Conflict { host: String, holder: ObjKey },
}

/// What an ExternalService's status says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExternalState {
    pub generation: Option<i64>,
    pub refusals: Vec<Refusal>,
    /// Endpoints sent, over its ports.
    pub endpoints: usize,
}

/// The ExternalServices and ExternalWorkloads, and who holds each host.
#[derive(Debug, Default)]
pub struct Externals {
    /// The operator's namespace, whose ExternalServices may claim any host.
    pub mesh_namespace: Option<String>,
    services: BTreeMap<ObjKey, ExternalInfo>,
    workloads: BTreeMap<ObjKey, WorkloadInfo>,
    /// Host → the ExternalServices that may claim it, oldest first.
    claims: BTreeMap<String, BTreeSet<(i64, ObjKey)>>,
}

impl Externals {
    fn may_claim(&self, namespace: &str, host: &str) -> bool {
        match host_owner(host) {
            None => true,
            Some(owner) => owner == namespace || self.mesh_namespace.as_deref() == Some(namespace),
        }
    }

    pub fn apply_service(&mut self, key: ObjKey, info: ExternalInfo) -> Vec<ServiceHost> {
        if self.services.get(&key) == Some(&info) {
            return Vec::new();
        }
        let mut touched = self.delete_service(&key);
        for host in &info.hosts {
            if self.may_claim(&key.0, host) {
                self.claims
                    .entry(host.clone())
                    .or_default()
                    .insert((info.created, key.clone()));
            }
            push_new(&mut touched, external_key(host));
        }
        self.services.insert(key, info);
        touched
    }

    pub fn delete_service(&mut self, key: &ObjKey) -> Vec<ServiceHost> {
        let Some(old) = self.services.remove(key) else {
            return Vec::new();
        };
        old.hosts
            .iter()
            .map(|host| {
                if let Some(c) = self.claims.get_mut(host) {
                    c.remove(&(old.created, key.clone()));
                    if c.is_empty() {
                        self.claims.remove(host);
                    }
                }
                external_key(host)
            })
            .collect()
    }

    pub fn apply_workload(&mut self, key: ObjKey, info: WorkloadInfo) -> Vec<ServiceHost> {
        if self.workloads.get(&key) == Some(&info) {
            return Vec::new();
        }
        let mut touched = self.delete_workload(&key);
        for t in self.selecting(&key.0, &info.labels) {
            push_new(&mut touched, t);
        }
        self.workloads.insert(key, info);
        touched
    }

    pub fn delete_workload(&mut self, key: &ObjKey) -> Vec<ServiceHost> {
        let Some(old) = self.workloads.remove(key) else {
            return Vec::new();
        };
        self.selecting(&key.0, &old.labels)
    }

    /// The hosts of the ExternalServices of `namespace` selecting `labels`.
    fn selecting(&self, namespace: &str, labels: &BTreeMap<String, String>) -> Vec<ServiceHost> {
        let mut out = Vec::new();
        let of_ns = self
            .services
            .range((namespace.to_string(), String::new())..)
            .take_while(|(k, _)| k.0 == namespace);
        for (_, s) in of_ns {
            if let Source::Selector(sel) = &s.source
                && selects(sel, labels)
            {
                for h in &s.hosts {
                    push_new(&mut out, external_key(h));
                }
            }
        }
        out
    }

    /// The ExternalService holding `host`, if any.
    pub fn holder(&self, host: &str) -> Option<(&ObjKey, &ExternalInfo)> {
        let (_, key) = self.claims.get(host)?.first()?;
        self.services.get_key_value(key)
    }

    /// The endpoints of the ExternalService `key` for its port `port`, with
    /// the ServiceAccount each proves (if it runs remora-agent) and its weight.
    pub fn endpoints(&self, key: &ObjKey, port: u16) -> BTreeMap<SocketAddr, EndpointMeta> {
        let mut out = BTreeMap::new();
        let Some(s) = self.services.get(key) else {
            return out;
        };
        let Some(p) = s.port(port) else {
            return out;
        };
        let mut add = |e: &ExternalEndpoint| {
            let at = e.ports.get(&p.name).copied().unwrap_or(p.target);
            out.entry(SocketAddr::new(e.ip, at))
                .or_insert_with(|| EndpointMeta {
                    service_account: e.service_account.clone(),
                    weight: e.weight,
                });
        };
        match &s.source {
            Source::Endpoints(eps) => eps.iter().for_each(&mut add),
            Source::Selector(sel) => self
                .workloads
                .range((key.0.clone(), String::new())..)
                .take_while(|(k, _)| k.0 == key.0)
                .filter(|(_, w)| selects(sel, &w.labels))
                .take(MAX_SELECTED)
                .for_each(|(_, w)| add(&w.endpoint)),
        }
        out
    }

    /// Every ExternalService's key.
    pub fn keys(&self) -> impl Iterator<Item = &ObjKey> {
        self.services.keys()
    }

    /// What the status of ExternalService `key` says, `None` if unknown.
    pub fn state(&self, key: &ObjKey) -> Option<ExternalState> {
        let s = self.services.get(key)?;
        let refusals = s
            .hosts
            .iter()
            .filter_map(|h| {
                if !self.may_claim(&key.0, h) {
                    return Some(Refusal::NotOwned(h.clone()));
                }
                match self.holder(h) {
                    Some((holder, _)) if holder != key => Some(Refusal::Conflict {
                        host: h.clone(),
                        holder: holder.clone(),
                    }),
                    _ => None,
                }
            })
            .collect();
        let endpoints = s
            .ports
            .iter()
            .map(|p| self.endpoints(key, p.port).len())
            .sum();
        Some(ExternalState {
            generation: s.generation,
            refusals,
            endpoints,
        })
    }
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn push_new(v: &mut Vec<ServiceHost>, t: ServiceHost) {
    if !v.contains(&t) {
        v.push(t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::ObjectMeta;
    use remora_crds::WorkloadSelector;
    use remora_crds::external::{
        ExternalHost, ExternalPort as CrdPort, ExternalProtocol, ExternalServiceSpec,
        ExternalWorkloadSpec,
    };

    fn meta(ns: &str, name: &str, created_s: i64) -> ObjectMeta {
        ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            generation: Some(1),
            creation_timestamp: Some(Time(
                k8s_openapi::jiff::Timestamp::from_second(created_s).expect("time"),
            )),
            ..Default::default()
        }
    }

    fn service(
        ns: &str,
        name: &str,
        created_s: i64,
        hosts: &[&str],
        source: Source,
    ) -> ExternalService {
        let (endpoints, workload_selector) = match source {
            Source::Endpoints(eps) => (
                Some(
                    eps.iter()
                        .map(|e| WorkloadEndpoint {
                            address: e.ip.to_string(),
                            ports: e
                                .ports
                                .iter()
                                .map(|(n, p)| (n.clone(), i32::from(*p)))
                                .collect(),
                            service_account: e.service_account.clone(),
                            weight: e.weight.map(i64::from),
                        })
                        .collect(),
                ),
                None,
            ),
            Source::Selector(sel) => (None, Some(WorkloadSelector { match_labels: sel })),
        };
        ExternalService {
            metadata: meta(ns, name, created_s),
            spec: ExternalServiceSpec {
                hosts: hosts.iter().map(|h| ExternalHost(h.to_string())).collect(),
                ports: vec![
                    CrdPort {
                        number: 443,
                        name: "https".into(),
                        protocol: ExternalProtocol::Tls,
                        target_port: None,
                    },
                    CrdPort {
                        number: 80,
                        name: "http".into(),
                        protocol: ExternalProtocol::Http,
                        target_port: Some(8080),
                    },
                ],
                endpoints,
                workload_selector,
                connect_timeout: None,
            },
            status: None,
        }
    }

    fn ep(ip: &str, ports: &[(&str, u16)], sa: Option<&str>) -> ExternalEndpoint {
        ExternalEndpoint {
            ip: ip.parse().expect("ip"),
            ports: ports.iter().map(|(n, p)| (n.to_string(), *p)).collect(),
            service_account: sa.map(str::to_string),
            weight: None,
        }
    }

    fn apply(x: &mut Externals, es: &ExternalService) -> Vec<ServiceHost> {
        let (k, i) = ExternalInfo::read(es).expect("read");
        x.apply_service(k, i)
    }

    fn key(ns: &str, name: &str) -> ObjKey {
        (ns.into(), name.into())
    }

    fn addrs(m: &BTreeMap<SocketAddr, EndpointMeta>) -> Vec<String> {
        m.keys().map(ToString::to_string).collect()
    }

    #[test]
    fn endpoints_by_address_at_their_named_or_target_port() {
        let mut x = Externals::default();
        let es = service(
            "shop",
            "api",
            1,
            &["api.example.com"],
            Source::Endpoints(vec![
                ep("192.0.2.1", &[("https", 8443)], Some("api")),
                ep("192.0.2.2", &[], None),
            ]),
        );
        assert_eq!(apply(&mut x, &es), [external_key("api.example.com")]);
        assert_eq!(apply(&mut x, &es), [], "unchanged");
        let (k, _) = x.holder("api.example.com").expect("held");
        let k = k.clone();
        let tls = x.endpoints(&k, 443);
        assert_eq!(addrs(&tls), ["192.0.2.1:8443", "192.0.2.2:443"]);
        assert_eq!(
            tls.values()
                .next()
                .and_then(|m| m.service_account.as_deref()),
            Some("api")
        );
        assert_eq!(
            addrs(&x.endpoints(&k, 80)),
            ["192.0.2.1:8080", "192.0.2.2:8080"]
        );
        assert!(x.endpoints(&k, 81).is_empty(), "no such port");
        assert_eq!(x.state(&k).map(|s| s.endpoints), Some(4));
        assert_eq!(x.delete_service(&k), [external_key("api.example.com")]);
        assert!(x.holder("api.example.com").is_none());
    }

    #[test]
    fn workloads_are_selected_by_label_in_the_namespace_only() {
        let mut x = Externals::default();
        let sel = Source::Selector([("app".to_string(), "vm".to_string())].into());
        apply(&mut x, &service("shop", "vm", 1, &["vm.example.com"], sel));
        let wl = |ns: &str, name: &str, ip: &str, app: &str| ExternalWorkload {
            metadata: meta(ns, name, 1),
            spec: ExternalWorkloadSpec {
                endpoint: WorkloadEndpoint {
                    address: ip.into(),
                    service_account: Some("vm".into()),
                    ..Default::default()
                },
                labels: [("app".to_string(), app.to_string())].into(),
            },
        };
        let touch = |x: &mut Externals, w: &ExternalWorkload| {
            let (k, i) = WorkloadInfo::read(w).expect("read");
            x.apply_workload(k, i)
        };
        let host = external_key("vm.example.com");
        assert_eq!(
            touch(&mut x, &wl("shop", "vm-1", "192.0.2.7", "vm")),
            vec![host.clone()]
        );
        assert_eq!(touch(&mut x, &wl("shop", "db-1", "192.0.2.8", "db")), []);
        // Another namespace's workload is not its endpoint.
        assert_eq!(touch(&mut x, &wl("evil", "vm-2", "192.0.2.9", "vm")), []);
        let k = key("shop", "vm");
        assert_eq!(addrs(&x.endpoints(&k, 443)), ["192.0.2.7:443"]);
        // Relabelled out of the selector: the host is touched, the endpoint goes.
        assert_eq!(
            touch(&mut x, &wl("shop", "vm-1", "192.0.2.7", "db")),
            vec![host]
        );
        assert!(x.endpoints(&k, 443).is_empty());
        assert_eq!(x.state(&k).map(|s| s.endpoints), Some(0));
        // Not an IP: not an endpoint.
        assert!(WorkloadInfo::read(&wl("shop", "x", "vm.example.com", "vm")).is_none());
    }

    #[test]
    fn a_namespace_cannot_claim_another_namespaces_service_host() {
        let mut x = Externals {
            mesh_namespace: Some("remora-system".into()),
            ..Default::default()
        };
        let to = |ip: &str| Source::Endpoints(vec![ep(ip, &[], None)]);
        // The attack: evil claims shop's Service name.
        apply(
            &mut x,
            &service(
                "evil",
                "steal",
                1,
                &["cart.shop", "x.example.com"],
                to("192.0.2.66"),
            ),
        );
        assert!(x.holder("cart.shop").is_none());
        assert_eq!(
            x.state(&key("evil", "steal")).map(|s| s.refusals),
            Some(vec![Refusal::NotOwned("cart.shop".into())])
        );
        // Its own namespace and the operator's may.
        apply(
            &mut x,
            &service("shop", "cart", 2, &["cart.shop"], to("192.0.2.1")),
        );
        assert_eq!(
            x.holder("cart.shop").map(|(k, _)| k.clone()),
            Some(key("shop", "cart"))
        );
        apply(
            &mut x,
            &service("remora-system", "m", 3, &["db.corp"], to("192.0.2.2")),
        );
        assert!(x.holder("db.corp").is_some());
    }

    #[test]
    fn the_oldest_claim_holds_a_host() {
        let mut x = Externals::default();
        let to = |ip: &str| Source::Endpoints(vec![ep(ip, &[], None)]);
        apply(
            &mut x,
            &service("b", "late", 20, &["api.example.com"], to("192.0.2.2")),
        );
        apply(
            &mut x,
            &service("a", "early", 10, &["api.example.com"], to("192.0.2.1")),
        );
        assert_eq!(
            x.holder("api.example.com").map(|(k, _)| k.clone()),
            Some(key("a", "early"))
        );
        assert_eq!(
            x.state(&key("b", "late")).map(|s| s.refusals),
            Some(vec![Refusal::Conflict {
                host: "api.example.com".into(),
                holder: key("a", "early")
            }])
        );
        assert_eq!(
            x.state(&key("a", "early")).map(|s| s.refusals),
            Some(vec![])
        );
        // The holder gone, the next takes the host.
        x.delete_service(&key("a", "early"));
        assert_eq!(
            x.holder("api.example.com").map(|(k, _)| k.clone()),
            Some(key("b", "late"))
        );
    }

    #[test]
    fn oversized_input_reads_as_nothing() {
        let many: Vec<String> = (0..=MAX_HOSTS)
            .map(|i| format!("h{i}.example.com"))
            .collect();
        let hosts: Vec<&str> = many.iter().map(String::as_str).collect();
        let es = service("shop", "big", 1, &hosts, Source::Endpoints(vec![]));
        assert!(ExternalInfo::read(&es).expect("read").1.hosts.is_empty());
        let eps = vec![ep("192.0.2.1", &[], None); MAX_ENDPOINTS + 1];
        let es = service("shop", "big", 1, &["a.example.com"], Source::Endpoints(eps));
        assert_eq!(
            ExternalInfo::read(&es).expect("read").1.source,
            Source::Endpoints(vec![])
        );
    }
}
