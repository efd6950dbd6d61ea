//! CA mode: a [`CertSource`] that gets the workload certificate from a
//! client of Istio's `IstioCertificateService/CreateCertificate`. This file
//! wires the parts together:
//! - [`csr`](super::csr): a fresh key and CSR per issuance, URI SAN
//!   `spiffe://<trust-domain>/ns/<ns>/sa/<sa>`;
//! - [`ca_client`](super::ca_client): the gRPC call;
//! - [`renewal`](super::renewal): when to call again, and the backoff after a
//!   failure while the current certificate keeps being served;
//! - [`roots`](super::roots): following the `--ca-root-cert` file, which
//!   verifies the CA and prompts a call when it changes, but never adds a
//!   root trusted for peers;
//! - [`output`](super::output): the bundle served and the files for apps.
//!
//! `ROOTCA` is what the CA said over its verified connection: the trust
//! bundle of its answer (every root the mesh trusts, old and new during a
//! rotation; response metadata `x-remora-trust-bundle-bin`) and the root at
//! the end of its chain.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::csr::Identity;
use super::renewal::{RenewPolicy, run_renewal};
use super::roots::{DEFAULT_ROOT_POLL, RootFollowingIssuer, watch_trust_roots};
use super::{BundleSender, CertError, CertSource, union_roots};
use crate::config::RunConfig;

/// CA mode as a [`CertSource`].
#[derive(Debug, Clone)]
pub struct CaSource {
    pub address: String,
    /// The name the CA's certificate is checked against (`--ca-server-name`).
    pub server_name: Option<String>,
    /// The trust bundle as read at start (`--ca-root-cert`).
    pub ca_root_pem: Option<String>,
    /// The file to follow for new roots; `None`: the start's stay.
    pub ca_root_cert: Option<PathBuf>,
    /// How often `ca_root_cert` is read.
    pub root_poll: Duration,
    pub token_path: PathBuf,
    pub cluster_id: String,
    pub identity: Identity,
    pub policy: RenewPolicy,
    pub output_dir: Option<PathBuf>,
}

impl CaSource {
    pub fn from_config(address: &str, cfg: &RunConfig) -> Result<Self, CertError> {
        // Unreadable or not PEM at start: a configuration error, as there
        // are no earlier roots to keep.
        let ca_root_pem = match &cfg.ca_root_cert {
            Some(p) => Some(union_roots(
                "--ca-root-cert",
                [super::file::read(p)?.as_str()],
            )?),
            None => None,
        };
        let or_default = |s: &str| {
            if s.is_empty() {
                "default".to_string()
            } else {
                s.to_string()
            }
        };
        Ok(Self {
            address: address.to_string(),
            server_name: cfg.ca_server_name.clone().filter(|n| !n.is_empty()),
            ca_root_pem,
            ca_root_cert: cfg.ca_root_cert.clone(),
            root_poll: DEFAULT_ROOT_POLL,
            token_path: cfg.token_path.clone(),
            cluster_id: cfg.cluster_id.clone(),
            identity: Identity {
                trust_domain: cfg.trust_domain.clone(),
                namespace: or_default(&cfg.pod_namespace),
                service_account: or_default(&cfg.service_account),
                key_type: cfg.key_type,
                ttl: cfg.cert_ttl,
            },
            policy: RenewPolicy::default(),
            output_dir: cfg.output_certs.clone(),
        })
    }
}

impl CertSource for CaSource {
    fn describe(&self) -> String {
        format!("CA at {}", self.address)
    }

    fn run(
        self: Box<Self>,
        out: BundleSender,
        cancel: CancellationToken,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let initial = self.ca_root_pem.as_deref().map(Arc::<str>::from);
            let (tx, roots) = watch::channel(initial);
            let issuer = match RootFollowingIssuer::new(
                &self.address,
                self.server_name.clone(),
                roots.clone(),
                self.token_path.clone(),
                self.cluster_id.clone(),
            ) {
                Ok(i) => i,
                Err(e) => {
                    // A config error does not fix itself: report it and wait for shutdown.
                    out.fail("CA", &e.into());
                    cancel.cancelled().await;
                    return;
                }
            };
            let watcher = {
                let (out, cancel) = (out.clone(), cancel.clone());
                let (file, poll) = (self.ca_root_cert.clone(), self.root_poll);
                async move {
                    match file {
                        Some(path) => {
                            watch_trust_roots(path, poll, tx, out, cancel).await;
                        }
                        // Dropping the sender tells the renewal loop no change comes.
                        None => drop(tx),
                    }
                }
            };
            let renewal = run_renewal(
                issuer,
                self.identity,
                self.policy,
                roots,
                self.output_dir,
                out,
                cancel,
            );
            tokio::join!(watcher, renewal);
        })
    }
}
