//! Protobuf services Remora speaks that are not Envoy's own.
//!
//! - [`istio::v1::auth`]: Istio's CA service
//!   `istio.v1.auth.IstioCertificateService/CreateCertificate` (client and
//!   server stubs), used by the agent's CA certificate source and by test CAs.
//! - [`remora::v1`]: what the discovery server tells an agent about its pod
//!   on the ADS stream ([`remora::v1::PodAnnotations`], [`remora::v1::Withdrawal`]).

pub mod istio {
    pub mod v1 {
        pub mod auth {
            #![allow(clippy::all, clippy::pedantic, missing_docs)]
            tonic::include_proto!("istio.v1.auth");
        }
    }
}

pub mod remora {
    pub mod v1 {
        #![allow(clippy::all, clippy::pedantic, missing_docs)]
        tonic::include_proto!("remora.v1");
    }
}
