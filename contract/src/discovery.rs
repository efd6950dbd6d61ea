//! The discovery side of the pod contract: where the operator serves xDS,
//! how a sidecar names itself and authenticates, and how resources are
//! named. The discovery server (remora-operator) and the agent's xDS proxy
//! agree on these and on nothing else.

use std::fmt;
use std::str::FromStr;

/// The discovery server's gRPC port (TLS) on the operator's Service.
pub const PORT: u16 = 15010;
/// The Service port's name.
pub const PORT_NAME: &str = "grpc-xds";

/// The audience of the projected token a sidecar shows the discovery server
/// when the workload CA is off. Its own, so a token minted for the CA (or the
/// API server) cannot be replayed here, nor this one there.
pub const TOKEN_AUDIENCE: &str = "remora-discovery";
/// The projected token volume's file, beside the CA's in
/// [`crate::workload_ca::TOKEN_DIR`].
pub const TOKEN_FILE: &str = "remora-discovery-token";
/// The agent's default `--discovery-token-path`.
pub const TOKEN_PATH: &str = "/var/run/secrets/tokens/remora-discovery-token";

/// The Unix socket in the agent's run dir on which Envoy's ADS stream
/// reaches the agent's xDS proxy (mode 0600, like the SDS socket).
pub const PROXY_SOCKET: &str = "xds.sock";

/// The type URL of the resource that carries a pod's annotations to its
/// agent (`remora.v1.PodAnnotations` in remora-proto): the agent subscribes
/// to it on the stream it holds for Envoy and keeps it from Envoy.
pub const POD_ANNOTATIONS_TYPE: &str = "type.googleapis.com/remora.v1.PodAnnotations";

/// The type URL of the resource that tells a pod's agent how the
/// withdrawal of its pod's endpoints stands (`remora.v1.Withdrawal` in
/// remora-proto), the contract of confirmed removal (issue 30):
///
/// - when the pod starts deleting or stops being Ready, the discovery
///   server removes its addresses from every Service's endpoints at once
///   and waits for each proxy that held them (its last EDS response named
///   one) to ACK an EDS response without them;
/// - the pod's own agent (and no one else: as for
///   [`POD_ANNOTATIONS_TYPE`], the only resource of this type a stream is
///   sent is its own pod's, named `<namespace>/<pod>`) subscribes to this
///   type on the stream it holds for Envoy, and keeps it from Envoy;
/// - while the pod is withdrawn the resource is present: `expected`
///   proxies were waited for, of which `confirmed` ACKed a version without
///   the pod and `gone` ended their stream first; `pending` names (as
///   `<namespace>/<pod>`, sorted) at most [`MAX_WITHDRAWAL_PENDING_NAMES`]
///   of the others; `done` once none is pending, with
///   `last_confirmation_ms` from the withdrawal to the last confirmation.
///   It is updated as confirmations arrive (intermediate counts may be
///   debounced; `done` is sent at once);
/// - bounded: a proxy still pending when the pod's withdrawal timeout
///   (`remora.dev/withdrawal-timeout`, read by [`crate::overlay::withdrawal_timeout`])
///   has passed since the withdrawal is given up on: the resource turns
///   `done` and `timed_out`, `pending` naming those never confirmed, and
///   the server raises a Warning Event on the pod naming them;
/// - absent: the pod is not withdrawn (serving, or not known to this
///   replica yet); a pod Ready again has its withdrawal forgotten;
/// - per replica: every operator replica runs a discovery server, each
///   proxy holds its stream to one of them, and a replica counts only the
///   proxies on its own streams (a proxy is on one replica at a time, so
///   none is counted twice). The resource names in `replicas` the other
///   replicas serving now (the ready endpoints of the operator's Service
///   at [`PORT_NAME`], the answering replica left out, at most
///   [`MAX_DISCOVERY_REPLICAS`], as pod name and `IP:port`). The agent
///   opens a stream to each of them too, on the same terms as its main
///   one (its token, its workload certificate, the node id of its pod;
///   the server's certificate verified under the Service's name although
///   it dials the pod's address), subscribing to this type alone: such a
///   stream is never sent EDS, so never waited for. The pod counts as
///   confirmed only when every replica's resource is `done` (counts are
///   summed, `timed_out` if any timed out); a replica that cannot be
///   reached or has not withdrawn the pod is waited for within the same
///   bound, then named as such, never skipped; a replica no longer named
///   (it stopped serving: its proxies moved to the others) is no longer
///   waited for.
///
/// What the agent does with it: in discovery mode its drain (adaptive)
/// holds the app's SIGTERM until the resource is `done` at every replica,
/// bounded by the same timeout and by the drain deadline, then runs the
/// quiet period; if its stream is down when the drain starts, or no
/// withdrawal arrives soon after, it falls back to the quiet period alone
/// and says so (agent `drain.rs` and `withdrawal.rs`).
pub const WITHDRAWAL_TYPE: &str = "type.googleapis.com/remora.v1.Withdrawal";

/// The most proxies a `remora.v1.Withdrawal` names as pending: the counts
/// are whole, the names are for a human reading an Event or a log.
pub const MAX_WITHDRAWAL_PENDING_NAMES: usize = 32;

/// The most other replicas a `remora.v1.Withdrawal` names (the agent
/// opens a stream to each while its pod drains).
pub const MAX_DISCOVERY_REPLICAS: usize = 16;

/// Whether the discovery server sends annotation `key` to the pod's agent:
/// those the agent reads while it runs, nothing else of the pod.
pub fn sent_to_agent(key: &str) -> bool {
    key == crate::annotations::LIFECYCLE
        || key == crate::annotations::STOP
        || crate::annotations::PER_FIELD.contains(&key)
}

/// The most one discovery request may weigh, both at the server and at the
/// agent's proxy: a sidecar's requests name resources, they do not carry them.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// A sidecar's Envoy node id, in Istio's shape
/// (`sidecar~<ip>~<pod>.<namespace>~<namespace>.svc.<domain>`), so an
/// istiod-compatible server recognises it and ours can find the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeId {
    pub ip: String,
    pub pod: String,
    pub namespace: String,
    pub domain: String,
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            ip,
            pod,
            namespace,
            domain,
        } = self;
        write!(f, "sidecar~{ip}~{pod}.{namespace}~{namespace}.svc.{domain}")
    }
}

impl FromStr for NodeId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("node id {:?} {why}", crate::mode::short(s));
        let mut parts = s.split('~');
        let (Some("sidecar"), Some(ip), Some(pod_ns), Some(dns), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(bad("is not sidecar~IP~POD.NAMESPACE~NAMESPACE.svc.DOMAIN"));
        };
        let (pod, namespace) = pod_ns
            .rsplit_once('.')
            .ok_or_else(|| bad("names no namespace"))?;
        let domain = dns
            .strip_prefix(namespace)
            .and_then(|d| d.strip_prefix(".svc."))
            .ok_or_else(|| bad("has a DNS domain of another namespace"))?;
        if ip.is_empty() || pod.is_empty() || namespace.is_empty() || domain.is_empty() {
            return Err(bad("has an empty part"));
        }
        // As long as Kubernetes allows each (an IPv6 address in text, a DNS
        // subdomain, a DNS label, a DNS name): nothing longer is kept, so a
        // refusal that names a part echoes at most this much.
        if ip.len() > 45 || pod.len() > 253 || namespace.len() > 63 || domain.len() > 253 {
            return Err(bad(
                "has a part longer than Kubernetes allows (IP 45, pod 253, namespace 63, domain 253 bytes)",
            ));
        }
        Ok(Self {
            ip: ip.into(),
            pod: pod.into(),
            namespace: namespace.into(),
            domain: domain.into(),
        })
    }
}

/// A Service named in `remora.dev/outbound`: `name.namespace`,
/// `name.namespace.svc` or `name.namespace.svc.<domain>`. Whether it names a
/// Service that exists is the server's to say (`example.org` parses, as
/// Service `example` in namespace `org`: the server keeps such a host static
/// unless it knows the Service); a host that does not parse
/// (an IP, `localhost`, a name of one label or more than the shapes above)
/// is a static upstream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceHost {
    pub name: String,
    pub namespace: String,
}

impl ServiceHost {
    pub fn parse(host: &str, domain: &str) -> Option<Self> {
        if host.parse::<std::net::IpAddr>().is_ok() {
            return None;
        }
        let host = host.to_ascii_lowercase();
        let short = host
            .strip_suffix(&format!(".svc.{domain}"))
            .or_else(|| host.strip_suffix(".svc"))
            .unwrap_or(&host);
        let (name, namespace) = short.split_once('.')?;
        let label = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        (label(name) && label(namespace)).then(|| Self {
            name: name.into(),
            namespace: namespace.into(),
        })
    }

    /// `name.namespace.svc.<domain>`.
    pub fn fqdn(&self, domain: &str) -> String {
        format!("{}.{}.svc.{domain}", self.name, self.namespace)
    }
}

/// The name of the cluster (and of its load assignment) for a Service port,
/// in Istio's shape: `outbound|<port>||<fqdn>`.
pub fn cluster_name(fqdn: &str, port: u16) -> String {
    format!("outbound|{port}||{fqdn}")
}

/// `(fqdn, port)` back from a [`cluster_name`].
pub fn parse_cluster_name(name: &str) -> Option<(&str, u16)> {
    let rest = name.strip_prefix("outbound|")?;
    let (port, fqdn) = rest.split_once("||")?;
    Some((fqdn, port.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_id_round_trips_and_refuses_other_shapes() {
        let n = NodeId {
            ip: "10.0.0.7".into(),
            pod: "web-5f6d.x".into(),
            namespace: "shop".into(),
            domain: "cluster.local".into(),
        };
        let s = n.to_string();
        assert_eq!(s, "sidecar~10.0.0.7~web-5f6d.x.shop~shop.svc.cluster.local");
        assert_eq!(s.parse::<NodeId>(), Ok(n));
        for bad in [
            "",
            "router~1~a.b~b.svc.cluster.local",
            "sidecar~1~a.b~c.svc.cluster.local",
            "sidecar~1~ab~ab.svc.cluster.local",
            "sidecar~~a.b~b.svc.cluster.local",
            "sidecar~1~a.b~b.svc.cluster.local~more",
        ] {
            assert!(bad.parse::<NodeId>().is_err(), "{bad:?} parsed");
        }
        // Each part at Kubernetes' longest parses; one byte more does not,
        // and the refusal stays short however long the id.
        let (ip, pod, ns, domain) = (
            "1".repeat(45),
            "p".repeat(253),
            "n".repeat(63),
            "d".repeat(253),
        );
        let longest = format!("sidecar~{ip}~{pod}.{ns}~{ns}.svc.{domain}");
        assert!(longest.parse::<NodeId>().is_ok());
        for long in [
            format!("sidecar~{ip}1~{pod}.{ns}~{ns}.svc.{domain}"),
            format!("sidecar~{ip}~{pod}p.{ns}~{ns}.svc.{domain}"),
            format!("sidecar~{ip}~{pod}.{ns}n~{ns}n.svc.{domain}"),
            format!("sidecar~{ip}~{pod}.{ns}~{ns}.svc.{domain}d"),
            format!(
                "sidecar~1~{}.shop~shop.svc.cluster.local",
                "x".repeat(1 << 20)
            ),
        ] {
            let e = long.parse::<NodeId>().expect_err("too long");
            assert!(e.contains("longer than Kubernetes allows"), "{e}");
            assert!(e.len() < 1024, "{} bytes", e.len());
        }
    }

    #[test]
    fn service_hosts_in_every_shape_and_static_hosts_not() {
        let cart = Some(ServiceHost {
            name: "cart".into(),
            namespace: "shop".into(),
        });
        for h in [
            "cart.shop",
            "cart.shop.svc",
            "cart.shop.svc.cluster.local",
            "Cart.Shop",
        ] {
            assert_eq!(ServiceHost::parse(h, "cluster.local"), cart, "{h}");
        }
        for h in [
            "10.0.0.1",
            "::1",
            "localhost",
            "api.example.com",
            "cart.shop.svc.other.domain",
            "-x.shop",
            "cart.",
        ] {
            assert_eq!(ServiceHost::parse(h, "cluster.local"), None, "{h}");
        }
        let fqdn = ServiceHost {
            name: "cart".into(),
            namespace: "shop".into(),
        }
        .fqdn("cluster.local");
        assert_eq!(fqdn, "cart.shop.svc.cluster.local");
        let c = cluster_name(&fqdn, 80);
        assert_eq!(c, "outbound|80||cart.shop.svc.cluster.local");
        assert_eq!(parse_cluster_name(&c), Some((fqdn.as_str(), 80)));
        assert_eq!(parse_cluster_name("outbound|x||a"), None);
    }
}
