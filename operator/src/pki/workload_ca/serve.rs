//! The CA's gRPC server: [`crate::grpc_server`] with this replica's
//! serving certificate (swapped in place when the root changes) and the
//! CA's service and metrics.

use std::sync::Arc;

use remora_proto::istio::v1::auth::istio_certificate_service_server::IstioCertificateServiceServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use crate::grpc_server::{Limits, ServeError};

use super::authn::Authenticate;
use super::service::CaService;
use super::{Metrics, ServingCert};

/// A CSR is a few KiB; nothing legitimate comes near this.
const MAX_MESSAGE_BYTES: usize = 64 * 1024;

impl crate::grpc_server::Refusals for Metrics {
    fn request_refused(&self, reason: &'static str) {
        self.refused(reason);
    }
    fn connection_refused(&self, reason: &'static str) {
        Metrics::connection_refused(self, reason);
    }
}

/// Serve `service` on `listener` until `token`, then close every
/// connection gracefully (a GOAWAY; requests in flight finish within the
/// request timeout) and return once all are closed.
pub async fn serve<A: Authenticate>(
    listener: TcpListener,
    service: CaService<A>,
    limits: Limits,
    token: CancellationToken,
) -> Result<(), ServeError> {
    let certs = Arc::new(ServingCert(service.authority.clone()));
    let metrics = service.metrics.clone();
    let svc = IstioCertificateServiceServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    crate::grpc_server::serve(
        "workload CA",
        listener,
        tonic::service::Routes::new(svc),
        certs,
        limits,
        metrics,
        token,
    )
    .await
}
