//! The upstream side: one TLS gRPC stream to the discovery server per Envoy
//! stream, with the pod's identity. Everything a connection needs is read
//! when it is made (the token, the trust bundle, the workload certificate),
//! since each of them rotates.

use std::path::PathBuf;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::certs::BundleReceiver;

/// The most one response from the server may weigh: a proxy's whole
/// configuration of one type (every cluster, say) comes in one.
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 pings on the upstream connection: a server gone without a word
/// (its node lost, a partition) fails the stream in seconds, not after
/// TCP's retransmission timeout, so the proxy reconnects to another replica.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(15);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("discovery token {path}: {reason}")]
    Token { path: PathBuf, reason: String },
    #[error("trust bundle for the discovery server: {0}")]
    Roots(String),
    #[error("--discovery-address {0:?} is not HOST:PORT")]
    Address(String),
    #[error("cannot connect to the discovery server {address}: {reason}")]
    Connect { address: String, reason: String },
    #[error("the discovery server refused the stream: {code:?}: {message}")]
    Refused { code: tonic::Code, message: String },
}

/// Where and how to reach the discovery server.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// `host:port`.
    pub address: String,
    /// The name the server's certificate must carry; default the host.
    pub server_name: Option<String>,
    /// A PEM file of roots that verify the server (`--ca-root-cert`).
    pub roots_file: Option<PathBuf>,
    /// The workload bundle: its roots verify the server too, and its
    /// certificate is the client certificate.
    pub bundles: Option<BundleReceiver>,
    /// The bearer token file.
    pub token_path: PathBuf,
    /// Reconnect backoff: first delay and cap (jittered, exponential).
    pub min_backoff: Duration,
    pub max_backoff: Duration,
}

impl UpstreamConfig {
    fn host(&self) -> Result<String, UpstreamError> {
        let bad = || UpstreamError::Address(self.address.clone());
        let (host, port) = self.address.rsplit_once(':').ok_or_else(bad)?;
        port.parse::<u16>().map_err(|_| bad())?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad());
        }
        Ok(host.to_string())
    }

    /// The same server's other replica at `address` (a pod's `IP:port`):
    /// dialled there, its certificate still verified under the name this
    /// one's is (the Service's), with the same credentials.
    pub fn for_replica(&self, address: std::net::SocketAddr) -> Result<Self, UpstreamError> {
        let name = match self.server_name.as_deref().filter(|n| !n.is_empty()) {
            Some(n) => n.to_string(),
            None => self.host()?,
        };
        Ok(Self {
            address: address.to_string(),
            server_name: Some(name),
            ..self.clone()
        })
    }

    /// Checks what can be checked before the first dial.
    pub fn check(&self) -> Result<(), UpstreamError> {
        self.host()?;
        if self.roots_file.is_none() && self.bundles.is_none() {
            return Err(UpstreamError::Roots(
                "none: set --ca-root-cert or a workload certificate source".into(),
            ));
        }
        Ok(())
    }

    async fn token(&self) -> Result<String, UpstreamError> {
        crate::token::read(&self.token_path)
            .await
            .map_err(|reason| UpstreamError::Token {
                path: self.token_path.clone(),
                reason,
            })
    }

    fn tls(&self, host: &str) -> Result<ClientTlsConfig, UpstreamError> {
        let mut roots = Vec::new();
        if let Some(f) = &self.roots_file {
            let pem = std::fs::read_to_string(f)
                .map_err(|e| UpstreamError::Roots(format!("{}: {e}", f.display())))?;
            roots.push(pem);
        }
        let bundle = self.bundles.as_ref().and_then(|b| b.borrow().clone());
        if let Some(b) = &bundle {
            roots.push(b.roots_pem.clone());
        }
        let roots =
            crate::certs::union_roots("discovery trust bundle", roots.iter().map(String::as_str))
                .map_err(|e| UpstreamError::Roots(e.to_string()))?;
        let name = self
            .server_name
            .as_deref()
            .filter(|n| !n.is_empty())
            .unwrap_or(host);
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(roots))
            .domain_name(name);
        // The pod's identity, when it has one: a server on the workload CA
        // authenticates the proxy by it.
        if let Some(b) = bundle {
            tls = tls.identity(Identity::from_pem(&b.chain_pem, &b.key_pem));
        }
        Ok(tls)
    }

    /// A client of the discovery server, and the stream's authorization.
    async fn client(
        &self,
    ) -> Result<
        (
            AggregatedDiscoveryServiceClient<Channel>,
            MetadataValue<Ascii>,
        ),
        UpstreamError,
    > {
        let host = self.host()?;
        let token = self.token().await?;
        let conn = |reason: String| UpstreamError::Connect {
            address: self.address.clone(),
            reason,
        };
        let ep = Endpoint::from_shared(format!("https://{}", self.address))
            .map_err(|e| conn(e.to_string()))?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .tls_config(self.tls(&host)?)
            .map_err(|e| conn(e.to_string()))?;
        let channel = ep.connect().await.map_err(|e| conn(source_chain(&e)))?;
        let client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(MAX_RESPONSE_BYTES);
        // The error never echoes the value: it is a credential.
        let auth = MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| {
            UpstreamError::Token {
                path: self.token_path.clone(),
                reason: "contains characters not allowed in a header".into(),
            }
        })?;
        Ok((client, auth))
    }

    /// Open one state-of-the-world ADS stream carrying `requests` up; the
    /// responses come back.
    pub async fn open(
        &self,
        requests: mpsc::Receiver<DiscoveryRequest>,
    ) -> Result<tonic::Streaming<DiscoveryResponse>, UpstreamError> {
        let (mut client, auth) = self.client().await?;
        let mut req = tonic::Request::new(ReceiverStream::new(requests));
        req.metadata_mut().insert("authorization", auth);
        let resp = client
            .stream_aggregated_resources(req)
            .await
            .map_err(refused)?;
        Ok(resp.into_inner())
    }

    /// Open one delta ADS stream carrying `requests` up.
    pub async fn open_delta(
        &self,
        requests: mpsc::Receiver<DeltaDiscoveryRequest>,
    ) -> Result<tonic::Streaming<DeltaDiscoveryResponse>, UpstreamError> {
        let (mut client, auth) = self.client().await?;
        let mut req = tonic::Request::new(ReceiverStream::new(requests));
        req.metadata_mut().insert("authorization", auth);
        let resp = client
            .delta_aggregated_resources(req)
            .await
            .map_err(|s| {
                let mut e = refused(s);
                if let UpstreamError::Refused {
                    code: tonic::Code::Unimplemented,
                    message,
                } = &mut e
                {
                    message.push_str(
                        " (a discovery server without delta xDS: upgrade it, or run the agent with --discovery-delta=false)",
                    );
                }
                e
            })?;
        Ok(resp.into_inner())
    }
}

fn refused(s: tonic::Status) -> UpstreamError {
    UpstreamError::Refused {
        code: s.code(),
        message: s.message().to_string(),
    }
}

/// An error with its causes: tonic's transport errors say little at the top.
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
