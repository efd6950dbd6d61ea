//! A sidecar's INBOUND listeners, decided once for the two places that build
//! them: the agent's static bootstrap (JSON, static mode) and the discovery
//! server (protobuf, served over LDS/CDS when discovery is on). Both render
//! [`Inbound`] and [`InboundTls`] with these names, addresses and timeouts,
//! so the agent's drain (`drain_listeners?inboundonly`), its metrics (the
//! `inbound_<port>` stat prefix) and its SDS secrets see the same listener
//! whichever of them made it.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::traffic::InboundSpec;

/// Where an inbound listener binds: every address of the pod.
pub const LISTEN_ADDRESS: &str = "0.0.0.0";
/// Where the app is reached: on loopback, in the pod.
pub const APP_ADDRESS: &str = "127.0.0.1";
/// The route's virtual host.
pub const VIRTUAL_HOST: &str = "app";
/// The app cluster's connect timeout.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The HTTP connection manager's idle timeout: Envoy's default, stated
/// (the drain cuts idle connections sooner, see the agent's `idle_close`).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
/// The HTTP connection manager's `drain_timeout`: between the decision to
/// close an idle connection and the close (for HTTP/2 the gap between the
/// two GOAWAYs).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(1);
/// The names of the two filter chains of a permissive listener.
pub const MESH_CHAIN: &str = "mesh-mtls";
pub const PLAINTEXT_CHAIN: &str = "plaintext";

/// One inbound listener: `0.0.0.0:port` to the app on `127.0.0.1:app_port`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Inbound {
    pub port: u16,
    pub app_port: u16,
}

impl Inbound {
    /// The listener's name and stat prefix (`inbound_<port>`).
    pub fn name(&self) -> String {
        format!("inbound_{}", self.port)
    }

    /// The app's cluster (`inbound|<app port>`).
    pub fn cluster(&self) -> String {
        format!("inbound|{}", self.app_port)
    }
}

/// The listeners of `specs`, an entry without a port on `default_port`;
/// `Err(port)` for a port listed twice.
pub fn resolve(specs: &[InboundSpec], default_port: u16) -> Result<Vec<Inbound>, u16> {
    let mut seen = BTreeSet::new();
    specs
        .iter()
        .map(|s| {
            let port = s.port.unwrap_or(default_port);
            if seen.insert(port) {
                Ok(Inbound {
                    port,
                    app_port: s.app_port,
                })
            } else {
                Err(port)
            }
        })
        .collect()
}

/// TLS on the inbound listeners.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum InboundTls {
    /// Plain text only.
    #[default]
    None,
    /// Every connection is mTLS with the workload certificate
    /// (`remora.dev/inbound-tls`, `--inbound-tls`); with `sans`, a client
    /// must carry one of them.
    Required { sans: Vec<String> },
    /// The mesh's mTLS for a ClientHello offering
    /// [`crate::mesh::MTLS_ALPN`] (which only a Remora client's sidecar
    /// sends), plain text otherwise, so clients without a sidecar keep
    /// working: the workload CA is wired and inbound TLS was not asked.
    Permissive,
}

impl InboundTls {
    /// The rule, in one place: `required` is `remora.dev/inbound-tls`
    /// (`None`: not asked, else the SANs allowed, empty for any), `ca_wired`
    /// whether the sidecar has the workload CA.
    pub fn of(required: Option<Vec<String>>, ca_wired: bool) -> Self {
        match (required, ca_wired) {
            (Some(sans), _) => Self::Required { sans },
            (None, true) => Self::Permissive,
            (None, false) => Self::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_ports_and_duplicates() {
        let specs: Vec<InboundSpec> = ["8080", "9000:9090"]
            .iter()
            .map(|s| s.parse().expect("spec"))
            .collect();
        let got = resolve(&specs, 15006).expect("resolves");
        assert_eq!(
            got,
            [
                Inbound {
                    port: 15006,
                    app_port: 8080
                },
                Inbound {
                    port: 9000,
                    app_port: 9090
                }
            ]
        );
        assert_eq!(got[0].name(), "inbound_15006");
        assert_eq!(got[1].cluster(), "inbound|9090");
        let twice: Vec<InboundSpec> = ["8080", "15006:8081"]
            .iter()
            .map(|s| s.parse().expect("spec"))
            .collect();
        assert_eq!(resolve(&twice, 15006), Err(15006));
    }

    #[test]
    fn tls_rule() {
        assert_eq!(InboundTls::of(None, false), InboundTls::None);
        assert_eq!(InboundTls::of(None, true), InboundTls::Permissive);
        let strict = InboundTls::Required {
            sans: vec!["spiffe://td/x".into()],
        };
        assert_eq!(
            InboundTls::of(Some(vec!["spiffe://td/x".into()]), true),
            strict
        );
        assert_eq!(
            InboundTls::of(Some(vec![]), false),
            InboundTls::Required { sans: vec![] }
        );
    }
}
