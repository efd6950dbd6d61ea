//! Every `remora.dev/*` key on pods, namespaces and pod templates.

/// Namespace or pod label selecting injection: `enabled` on a namespace,
/// `"true"` on a pod; `"false"` on the pod always wins.
pub const INJECT_LABEL: &str = "remora.dev/inject";

/// What every Remora annotation starts with: a reader that keeps only these
/// keeps all it reads.
pub const PREFIX: &str = "remora.dev/";
/// What the operator did, as JSON ([`crate::lifecycle::SidecarStatus`]).
pub const STATUS: &str = "remora.dev/status";
/// The effective lifecycle as JSON ([`crate::lifecycle::LifecycleAnnotation`]),
/// written by the operator, patched by the controller, read live by the agent.
pub const LIFECYCLE: &str = "remora.dev/lifecycle";
/// Set by the operator on a Legacy-mode Job pod whose apps have all
/// terminated: the sidecar stops Envoy and exits 0. Its presence is the
/// request; the value ([`crate::lifecycle::StopRequest`]) is informational.
pub const STOP: &str = "remora.dev/stop";
/// Pod-template annotation that rolls a workload; its value is the restart
/// hash the new pods get.
pub const RESTARTED_FOR: &str = "remora.dev/restarted-for";
/// Static-mode inbound listeners, `PORT:APP_PORT,...` (the agent's `--inbound`).
pub const INBOUND: &str = "remora.dev/inbound";
/// Static-mode outbound listeners, `PORT:HOST:PORT,...` (the agent's `--outbound`).
pub const OUTBOUND: &str = "remora.dev/outbound";
/// `"false"` on a pod: no certificate from the operator's workload CA (no CA
/// address, token or trust bundle), even when the chart enables the CA.
pub const WORKLOAD_CA: &str = "remora.dev/workload-ca";
/// Static-mode inbound mTLS (the agent's `--inbound-tls`): `"true"`, or the
/// SPIFFE identities allowed to call, comma-separated (`--inbound-tls-san`).
pub const INBOUND_TLS: &str = "remora.dev/inbound-tls";
/// Static-mode outbound mTLS, `PORT=SPIFFE_ID,...` (the agent's
/// `--outbound-tls`): the outbound listener on PORT originates mTLS and
/// accepts only a server presenting that identity.
pub const OUTBOUND_TLS: &str = "remora.dev/outbound-tls";
/// On a Service: the ServiceAccounts (of its namespace) whose pods may serve
/// it, `sa1,sa2`. With the workload CA and discovery on, a client's sidecar
/// is sent only endpoints whose pods run under one of them and have a
/// Remora sidecar wired to the CA, and accepts only those identities in the
/// mTLS handshake (secure naming). A value that does not parse
/// ([`crate::mesh::parse_identities`]) admits no endpoint. Without it, the
/// identities are those of the meshed pods behind the Service's
/// EndpointSlices, and endpoints without a meshed sidecar are reached in
/// plain text.
pub const IDENTITIES: &str = "remora.dev/identities";

// Per-field overrides, `remora.dev/<kebab-case-field>`: the strongest layer.
pub const MODE: &str = "remora.dev/sidecar-mode";
pub const HOLD_APPLICATION_UNTIL_PROXY_STARTS: &str =
    "remora.dev/hold-application-until-proxy-starts";
pub const STARTUP_TIMEOUT: &str = "remora.dev/startup-timeout";
pub const DRAIN_DURATION: &str = "remora.dev/drain-duration";
pub const TERMINATION_DRAIN_DURATION: &str = "remora.dev/termination-drain-duration";
pub const EXIT_ON_ZERO_ACTIVE_CONNECTIONS: &str = "remora.dev/exit-on-zero-active-connections";
pub const MINIMUM_DRAIN_DURATION: &str = "remora.dev/minimum-drain-duration";
pub const DRAIN_MODE: &str = "remora.dev/drain-mode";
pub const QUIET_PERIOD: &str = "remora.dev/quiet-period";
pub const WITHDRAWAL_TIMEOUT: &str = "remora.dev/withdrawal-timeout";
pub const CONCURRENCY: &str = "remora.dev/concurrency";
pub const LOG_LEVEL: &str = "remora.dev/log-level";

/// The per-field keys, in the order [`crate::overlay::Overlay`] reads them.
pub const PER_FIELD: [&str; 12] = [
    MODE,
    HOLD_APPLICATION_UNTIL_PROXY_STARTS,
    STARTUP_TIMEOUT,
    DRAIN_DURATION,
    TERMINATION_DRAIN_DURATION,
    EXIT_ON_ZERO_ACTIVE_CONNECTIONS,
    MINIMUM_DRAIN_DURATION,
    DRAIN_MODE,
    QUIET_PERIOD,
    WITHDRAWAL_TIMEOUT,
    CONCURRENCY,
    LOG_LEVEL,
];
