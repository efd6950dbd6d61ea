//! Environment variables of the sidecar container: the agent reads each
//! `run` flag from `REMORA_<FLAG>`; the operator sets the ones it resolves.

pub const POD_NAME: &str = "POD_NAME";
pub const POD_NAMESPACE: &str = "POD_NAMESPACE";
pub const SERVICE_ACCOUNT: &str = "SERVICE_ACCOUNT";
pub const INSTANCE_IP: &str = "INSTANCE_IP";

pub const CONCURRENCY: &str = "REMORA_CONCURRENCY";
pub const LOG_LEVEL: &str = "REMORA_LOG_LEVEL";
pub const DRAIN_DURATION: &str = "REMORA_DRAIN_DURATION";
pub const TERMINATION_DRAIN_DURATION: &str = "REMORA_TERMINATION_DRAIN_DURATION";
pub const EXIT_ON_ZERO_ACTIVE_CONNECTIONS: &str = "REMORA_EXIT_ON_ZERO_ACTIVE_CONNECTIONS";
pub const MINIMUM_DRAIN_DURATION: &str = "REMORA_MINIMUM_DRAIN_DURATION";
pub const DRAIN_MODE: &str = "REMORA_DRAIN_MODE";
pub const QUIET_PERIOD: &str = "REMORA_QUIET_PERIOD";
pub const WITHDRAWAL_TIMEOUT: &str = "REMORA_WITHDRAWAL_TIMEOUT";
/// Where the agent puts the app containers' preStop helper and its
/// endpoint file ([`crate::pod::HOOK_DIR`]); unset: no app hook.
pub const HOOK_DIR: &str = "REMORA_HOOK_DIR";
/// The pod's `restartPolicy`: `remora.dev/stop` is obeyed only when the pod
/// can complete (Never, OnFailure).
pub const POD_RESTART_POLICY: &str = "REMORA_POD_RESTART_POLICY";
pub const DRAIN_DEADLINE: &str = "REMORA_DRAIN_DEADLINE";
pub const RUN_DIR: &str = "REMORA_RUN_DIR";
pub const ANNOTATIONS_FILE: &str = "REMORA_ANNOTATIONS_FILE";
pub const INBOUND: &str = "REMORA_INBOUND";
pub const OUTBOUND: &str = "REMORA_OUTBOUND";
pub const INBOUND_TLS: &str = "REMORA_INBOUND_TLS";
pub const INBOUND_TLS_SAN: &str = "REMORA_INBOUND_TLS_SAN";
pub const OUTBOUND_TLS: &str = "REMORA_OUTBOUND_TLS";
pub const CA_ADDRESS: &str = "REMORA_CA_ADDRESS";
pub const CA_SERVER_NAME: &str = "REMORA_CA_SERVER_NAME";
pub const CA_ROOT_CERT: &str = "REMORA_CA_ROOT_CERT";
pub const TOKEN_PATH: &str = "REMORA_TOKEN_PATH";
pub const TRUST_DOMAIN: &str = "REMORA_TRUST_DOMAIN";
pub const CERT_TTL: &str = "REMORA_CERT_TTL";
pub const DISCOVERY_ADDRESS: &str = "REMORA_DISCOVERY_ADDRESS";
pub const DISCOVERY_SERVER_NAME: &str = "REMORA_DISCOVERY_SERVER_NAME";
pub const DISCOVERY_TOKEN_PATH: &str = "REMORA_DISCOVERY_TOKEN_PATH";
pub const HEALTH_PORT: &str = "REMORA_HEALTH_PORT";
pub const ADMIN_PORT: &str = "REMORA_ADMIN_PORT";

/// Istio pilot-agent's names, accepted by the agent when neither the flag
/// nor its `REMORA_` variable is given, so manifests move over unchanged.
pub mod istio {
    pub const EXIT_ON_ZERO_ACTIVE_CONNECTIONS: &str = "EXIT_ON_ZERO_ACTIVE_CONNECTIONS";
    pub const MINIMUM_DRAIN_DURATION: &str = "MINIMUM_DRAIN_DURATION";
    /// Whole seconds (or a duration): see [`crate::duration::parse_seconds`].
    pub const TERMINATION_DRAIN_DURATION_SECONDS: &str = "TERMINATION_DRAIN_DURATION_SECONDS";
}
