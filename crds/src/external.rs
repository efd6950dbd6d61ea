//! Services outside the cluster, after Istio's ServiceEntry and
//! WorkloadEntry: an `ExternalService` names hosts and ports and says where
//! they are served, by address or by `ExternalWorkload`s selected by label
//! (a VM, say, possibly running remora-agent). The discovery server turns a
//! host named in `remora.dev/outbound` into a cluster of those endpoints.
//!
//! The schema bounds every list; CEL says what it alone cannot (exactly one
//! source of endpoints, addresses that are IPs, port names that exist,
//! hosts that are not the cluster's own Service names). Who may claim which
//! host is the discovery server's rule ([`host_owner`]), since CEL cannot
//! see the object's namespace.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use crate::WorkloadSelector;

/// Hosts of one ExternalService.
pub const MAX_HOSTS: usize = 16;
/// Ports of one ExternalService, and of one endpoint's port map.
pub const MAX_PORTS: usize = 16;
/// Addresses listed in one ExternalService.
pub const MAX_ENDPOINTS: usize = 64;
/// Labels of one ExternalWorkload (and of a selector).
pub const MAX_LABELS: usize = 64;
/// ExternalWorkloads one ExternalService takes (the first by name): more
/// would let one label cost every proxy that names the host.
pub const MAX_SELECTED: usize = 256;

/// Spec of an `ExternalService`.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[kube(
    group = "remora.dev",
    version = "v1alpha1",
    kind = "ExternalService",
    plural = "externalservices",
    singular = "externalservice",
    shortname = "xsvc",
    category = "remora",
    namespaced,
    status = "ExternalServiceStatus",
    derive = "PartialEq",
    derive = "Default",
    doc = "ExternalService names a service outside the cluster (hosts, ports with their protocol) and where it is served: listed addresses, or the ExternalWorkloads of its namespace its workloadSelector matches. A pod reaches it through its sidecar by naming one of its hosts in remora.dev/outbound.",
    printcolumn(name = "Hosts", type_ = "string", json_path = ".spec.hosts"),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Endpoints",
        type_ = "integer",
        description = "Endpoints the discovery server sends",
        json_path = ".status.endpoints"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(
    "has(self.endpoints) != has(self.workloadSelector)"
).message("set exactly one of endpoints and workloadSelector"))]
#[x_kube(validation = kube::core::Rule::new(
    "!has(self.endpoints) || self.endpoints.all(e, !has(e.ports) || e.ports.all(n, self.ports.exists(p, p.name == n)))"
).message("an endpoint's ports must name ports of spec.ports"))]
pub struct ExternalServiceSpec {
    /// The DNS names clients use for it (`api.example.com`), lowercase, with
    /// at least one dot. A cluster Service's name (`*.svc`, `*.svc.*`) is
    /// refused: Services are served from the cluster. A name of Service
    /// shape (`name.namespace`) is taken only from an ExternalService of that
    /// namespace (or of the operator's).
    #[schemars(length(min = 1, max = 16))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub hosts: Vec<ExternalHost>,
    /// The ports clients call (`HOST:number` in remora.dev/outbound).
    #[schemars(length(min = 1, max = 16))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["number"]))]
    #[x_kube(validation = kube::core::Rule::new(
        "self.all(p, self.exists_one(q, q.name == p.name))"
    ).message("port names must be unique"))]
    pub ports: Vec<ExternalPort>,
    /// Where it is served, by address. Exactly one of endpoints and
    /// workloadSelector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub endpoints: Option<Vec<WorkloadEndpoint>>,
    /// Where it is served: the ExternalWorkloads of this namespace whose
    /// labels match (the first 256 by name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_selector: Option<WorkloadSelector>,
    /// How long the sidecar waits for a connection to an endpoint, in the
    /// duration grammar of every Remora resource. Envoy takes only more
    /// than 0s: a 0s the schema lets through is refused by each proxy
    /// that names the service, which keeps its previous configuration and
    /// raises a Warning Event on its pod naming Envoy's error. Default: 1s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect_timeout: Option<crate::DurationString>,
}

/// A DNS name of an ExternalService.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(transparent)]
pub struct ExternalHost(pub String);

/// Lowercase DNS labels, at least two.
pub const HOST_PATTERN: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+$";
pub const HOST_MAX_LEN: usize = 253;

impl JsonSchema for ExternalHost {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        "ExternalHost".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": HOST_PATTERN,
            "maxLength": HOST_MAX_LEN,
            "x-kubernetes-validations": [{
                "rule": "!self.endsWith('.svc') && !self.contains('.svc.')",
                "message": "a cluster Service's name is served from its Service: name the Service in remora.dev/outbound instead",
            }]
        })
    }
}

/// The namespace whose Service a host of Service shape names (`name.ns`),
/// the only namespace besides the operator's from which an ExternalService
/// may claim it; `None` for any other host (3 labels or more), which any
/// namespace may claim. The one rule, used by the discovery server.
pub fn host_owner(host: &str) -> Option<&str> {
    let (name, ns) = host.split_once('.')?;
    (!name.is_empty() && !ns.is_empty() && !ns.contains('.')).then_some(ns)
}

/// One port of an ExternalService.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalPort {
    /// The port clients call.
    #[schemars(range(min = 1, max = 65535))]
    pub number: i32,
    /// Its name, which endpoints' port maps use.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,
    /// What it speaks: HTTP, HTTP2 and GRPC are proxied per request (HTTP/1.1,
    /// h2c and gRPC alike), TCP and TLS (the app's own) per connection.
    pub protocol: ExternalProtocol,
    /// The endpoints' port when their port map does not name this port.
    /// Default: number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub target_port: Option<i32>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum ExternalProtocol {
    #[default]
    Http,
    Http2,
    Grpc,
    Tcp,
    Tls,
}

impl ExternalProtocol {
    /// Whether the sidecar proxies it per request (else per connection).
    pub fn is_http(self) -> bool {
        matches!(self, Self::Http | Self::Http2 | Self::Grpc)
    }
}

/// One endpoint: an address, its ports by name, and the identity it proves
/// when it runs remora-agent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadEndpoint {
    /// An IPv4 or IPv6 address (no DNS name: use a static `HOST:PORT` in
    /// remora.dev/outbound for those).
    #[schemars(length(max = 45))]
    #[x_kube(validation = kube::core::Rule::new("isIP(self)").message("must be an IPv4 or IPv6 address"))]
    pub address: String,
    /// Port name → the port this endpoint serves it on. A port not named
    /// here is served on its targetPort.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 16))]
    #[x_kube(validation = kube::core::Rule::new(
        "self.all(n, self[n] >= 1 && self[n] <= 65535)"
    ).message("ports must be between 1 and 65535"))]
    pub ports: BTreeMap<String, i32>,
    /// The ServiceAccount (of this object's namespace) whose workload
    /// certificate the endpoint's remora-agent presents: it is then reached
    /// over the mesh's mTLS and must prove that identity. Unset: plain text,
    /// or the app's own TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub service_account: Option<String>,
    /// Its share of the calls against the other endpoints of the same
    /// service (Envoy's load-balancing weight). Default: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4294967295_i64))]
    pub weight: Option<i64>,
}

/// Spec of an `ExternalWorkload`: one endpoint outside the cluster, which
/// ExternalServices of its namespace select by its labels.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "remora.dev",
    version = "v1alpha1",
    kind = "ExternalWorkload",
    plural = "externalworkloads",
    singular = "externalworkload",
    shortname = "xwl",
    category = "remora",
    namespaced,
    derive = "PartialEq",
    derive = "Default",
    doc = "ExternalWorkload is one endpoint outside the cluster (a VM, possibly running remora-agent): its address, ports, labels and identity. ExternalServices of its namespace select it by label.",
    printcolumn(name = "Address", type_ = "string", json_path = ".spec.address"),
    printcolumn(
        name = "ServiceAccount",
        type_ = "string",
        json_path = ".spec.serviceAccount"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ExternalWorkloadSpec {
    #[serde(flatten)]
    pub endpoint: WorkloadEndpoint,
    /// What ExternalServices' workloadSelectors match.
    #[serde(default)]
    #[schemars(extend("maxProperties" = 64))]
    pub labels: BTreeMap<String, String>,
}

/// Observed state of an `ExternalService`, written by the operator's leader
/// (server-side apply).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalServiceStatus {
    /// The metadata.generation these conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// How many endpoints the discovery server sends for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<i32>,
    /// Accepted (its hosts are its to claim: reasons Accepted,
    /// HostNotOwned, HostConflict), Resolved (it has endpoints: reasons
    /// EndpointsFound, NoEndpoints).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Condition types and reasons of `ExternalService.status`.
pub mod condition {
    pub const ACCEPTED: &str = "Accepted";
    pub const RESOLVED: &str = "Resolved";
    /// Accepted=True.
    pub const REASON_ACCEPTED: &str = "Accepted";
    /// Accepted=False: a host of Service shape names another namespace.
    pub const HOST_NOT_OWNED: &str = "HostNotOwned";
    /// Accepted=False: an older ExternalService claims the host.
    pub const HOST_CONFLICT: &str = "HostConflict";
    pub const ENDPOINTS_FOUND: &str = "EndpointsFound";
    pub const NO_ENDPOINTS: &str = "NoEndpoints";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_shaped_hosts_are_owned_by_their_namespace() {
        assert_eq!(host_owner("cart.shop"), Some("shop"));
        assert_eq!(host_owner("example.org"), Some("org"));
        assert_eq!(host_owner("api.example.com"), None);
        assert_eq!(host_owner("localhost"), None);
    }

    #[test]
    fn protocols_proxied_per_request() {
        assert!(ExternalProtocol::Grpc.is_http());
        assert!(!ExternalProtocol::Tls.is_http());
    }
}
