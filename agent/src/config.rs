//! Command line and environment of `remora-agent`: one struct per subcommand,
//! built once at start (clap, every `run` flag also read from `REMORA_<FLAG>`).

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, FromArgMatches, Parser, Subcommand, ValueEnum};
use remora_contract::traffic::{InboundSpec, OutboundSpec};
use remora_contract::{DrainMode, defaults, duration, env, pod, value};
use serde::Serialize;

/// Errors found after clap has parsed the command line (aliases, cross-field checks).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid value {value:?} for {name}: {reason}")]
    Invalid {
        name: String,
        value: String,
        reason: String,
    },
}

#[derive(Debug, Parser)]
#[command(
    name = "remora-agent",
    version,
    about = "Remora's in-pod agent: bootstraps, supervises and drains Envoy"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate Envoy's bootstrap, start and supervise Envoy, drain it on termination.
    #[command(visible_alias = "proxy")]
    Run(Box<RunConfig>),
    /// Block until the agent reports ready (postStart helper).
    Wait(WaitConfig),
    /// Ask the running agent to drain and block until it has (preStop helper).
    Drain(DrainConfig),
    /// Print the version.
    Version,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    Json,
    Text,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeyType {
    EcdsaP256,
    Rsa2048,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DrainStrategy {
    /// Envoy encourages clients to go away gradually over the drain time.
    Gradual,
    /// Envoy tells every client to go away at once.
    Immediate,
}

impl DrainStrategy {
    pub fn as_envoy_arg(self) -> &'static str {
        match self {
            Self::Gradual => "gradual",
            Self::Immediate => "immediate",
        }
    }
}

/// The pod's `spec.restartPolicy`, as Kubernetes spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
pub enum PodRestartPolicy {
    #[value(name = "Always")]
    Always,
    #[value(name = "OnFailure")]
    OnFailure,
    #[value(name = "Never")]
    Never,
}

impl PodRestartPolicy {
    /// Whether a pod with this policy can complete (and so its sidecar may
    /// be stopped for good).
    pub fn can_complete(policy: Option<Self>) -> bool {
        matches!(policy, Some(Self::Never | Self::OnFailure))
    }
}

/// `PORT=SPIFFE_ID` of `--outbound-tls`: the contract's, so the agent and
/// the operator's check of `remora.dev/outbound-tls` agree.
pub use remora_contract::traffic::OutboundTlsSpec;

/// Everything `remora-agent run` is configured with.
#[derive(Debug, Clone, Args, Serialize)]
pub struct RunConfig {
    // ---- Envoy process ----
    /// Envoy binary (a path, or a name looked up on PATH).
    #[arg(long, env = "REMORA_ENVOY_BIN", default_value = "envoy")]
    pub envoy_bin: PathBuf,
    /// Directory for the generated bootstrap, the SDS socket and the base-id file.
    #[arg(long, env = env::RUN_DIR, default_value = pod::RUN_DIR)]
    pub run_dir: PathBuf,
    /// Envoy worker threads.
    #[arg(long, env = env::CONCURRENCY, default_value_t = defaults::CONCURRENCY,
          value_parser = value::parse_concurrency)]
    pub concurrency: u32,
    /// Envoy's log level (trace, debug, info, warning, error, critical, off).
    #[arg(long, env = env::LOG_LEVEL, default_value = defaults::LOG_LEVEL.as_str())]
    pub log_level: String,
    /// Envoy component log levels, e.g. `upstream:debug,config:info`.
    #[arg(long, env = "REMORA_COMPONENT_LOG_LEVEL")]
    pub component_log_level: Option<String>,
    /// The agent's own log filter (tracing EnvFilter syntax); adjustable at runtime.
    #[arg(long, env = "REMORA_AGENT_LOG_LEVEL", default_value = "info")]
    pub agent_log_level: String,
    /// The agent's log format.
    #[arg(long, env = "REMORA_LOG_FORMAT", value_enum, default_value = "json")]
    pub log_format: LogFormat,
    /// Fixed Envoy base id; default: a free one chosen by Envoy and kept for hot restarts.
    #[arg(long, env = "REMORA_BASE_ID")]
    pub base_id: Option<u32>,

    // ---- Lifecycle ----
    /// How long Envoy's listeners drain (Envoy `--drain-time-s`).
    #[arg(long, env = env::DRAIN_DURATION, value_parser = duration::parse, default_value = defaults::DRAIN_DURATION)]
    #[serde(with = "duration_text")]
    pub drain_duration: Duration,
    /// Envoy's drain strategy. Immediate: once the drain starts every inbound
    /// response carries `connection: close` and HTTP/2 clients get GOAWAY, so
    /// keep-alive clients pinned to this pod leave while it still serves;
    /// gradual spreads that over the whole drain duration (45 s), too late
    /// for a pod that stops within seconds.
    #[arg(
        long,
        env = "REMORA_DRAIN_STRATEGY",
        value_enum,
        default_value = "immediate"
    )]
    pub drain_strategy: DrainStrategy,
    /// How long the old Envoy lives after a hot restart (Envoy `--parent-shutdown-time-s`).
    #[arg(long, env = "REMORA_PARENT_SHUTDOWN_DURATION", value_parser = duration::parse, default_value = "60s")]
    #[serde(with = "duration_text")]
    pub parent_shutdown_duration: Duration,
    /// On termination, wait this long after draining starts (unless exit-on-zero).
    /// Given without --drain-mode, the drain is fixed: the duration is honoured.
    /// Alias: TERMINATION_DRAIN_DURATION_SECONDS.
    #[arg(long, env = env::TERMINATION_DRAIN_DURATION, value_parser = duration::parse, default_value = defaults::TERMINATION_DRAIN_DURATION)]
    #[serde(with = "duration_text")]
    pub termination_drain_duration: Duration,
    /// On termination, exit as soon as no downstream connection is left (after the minimum).
    /// Alias: EXIT_ON_ZERO_ACTIVE_CONNECTIONS.
    #[arg(long, env = env::EXIT_ON_ZERO_ACTIVE_CONNECTIONS,
          default_value_t = defaults::EXIT_ON_ZERO_ACTIVE_CONNECTIONS, value_parser = value::parse_bool,
          num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub exit_on_zero_active_connections: bool,
    /// With exit-on-zero: always drain at least this long. Alias: MINIMUM_DRAIN_DURATION.
    #[arg(long, env = env::MINIMUM_DRAIN_DURATION, value_parser = duration::parse, default_value = defaults::MINIMUM_DRAIN_DURATION)]
    #[serde(with = "duration_text")]
    pub minimum_drain_duration: Duration,
    /// How a drain ends: adaptive (when the pod is no longer used, see
    /// --quiet-period) or fixed (--termination-drain-duration, or exit-on-zero).
    /// Default: adaptive, or fixed when a termination drain duration is given.
    #[arg(long, env = env::DRAIN_MODE, value_parser = parse_drain_mode, default_value = defaults::DRAIN_MODE.as_str())]
    pub drain_mode: DrainMode,
    /// Adaptive drain: no new connection or request for this long, and none in
    /// flight, ends it.
    #[arg(long, env = env::QUIET_PERIOD, value_parser = duration::parse, default_value = defaults::QUIET_PERIOD)]
    #[serde(with = "duration_text")]
    pub quiet_period: Duration,
    /// Adaptive drain in discovery mode: wait at most this long (within the
    /// drain deadline) for every proxy that routed to the pod to confirm it
    /// no longer does, before the quiet period runs.
    #[arg(long, env = env::WITHDRAWAL_TIMEOUT, value_parser = duration::parse, default_value = defaults::WITHDRAWAL_TIMEOUT)]
    #[serde(with = "duration_text")]
    pub withdrawal_timeout: Duration,
    /// Where to put the app containers' preStop helper and the file telling
    /// it how to reach this agent (an emptyDir the operator mounts read-only
    /// into the app containers); unset: no app hook.
    #[arg(long, env = env::HOOK_DIR)]
    pub hook_dir: Option<PathBuf>,
    /// The app hook helper copied into --hook-dir; default: `remora-prestop`
    /// next to this executable.
    #[arg(long, env = "REMORA_PRESTOP_HELPER")]
    pub prestop_helper: Option<PathBuf>,
    /// The pod's restartPolicy: `remora.dev/stop` is obeyed only when the pod
    /// can complete (Never, OnFailure); unset counts as Always.
    #[arg(long, env = env::POD_RESTART_POLICY, value_enum)]
    pub pod_restart_policy: Option<PodRestartPolicy>,
    /// Hard upper bound of a drain, from its start to Envoy stopped (the operator
    /// derives it from terminationGracePeriodSeconds).
    #[arg(long, env = env::DRAIN_DEADLINE, value_parser = duration::parse, default_value = defaults::DRAIN_DEADLINE)]
    #[serde(with = "duration_text")]
    pub drain_deadline: Duration,
    /// How often Envoy's counters are read during a drain (exit-on-zero's
    /// wait for the last connection reads at least every 10 ms).
    #[arg(long, env = "REMORA_DRAIN_POLL_INTERVAL", value_parser = duration::parse, default_value = "50ms")]
    #[serde(with = "duration_text")]
    pub drain_poll_interval: Duration,
    /// Grace between SIGTERM and SIGKILL when Envoy is stopped.
    #[arg(long, env = "REMORA_ENVOY_STOP_GRACE", value_parser = duration::parse, default_value = "5s")]
    #[serde(with = "duration_text")]
    pub envoy_stop_grace: Duration,
    /// Abnormal Envoy exits tolerated within `--restart-window` before the agent gives up.
    #[arg(long, env = "REMORA_MAX_RESTARTS", default_value_t = 5)]
    pub max_restarts: u32,
    /// The window `--max-restarts` counts over.
    #[arg(long, env = "REMORA_RESTART_WINDOW", value_parser = duration::parse, default_value = "5m")]
    #[serde(with = "duration_text")]
    pub restart_window: Duration,
    /// First restart delay; doubles on each restart inside the window.
    #[arg(long, env = "REMORA_RESTART_BACKOFF", value_parser = duration::parse, default_value = "200ms")]
    #[serde(with = "duration_text")]
    pub restart_backoff: Duration,
    /// Downward-API file of the pod's annotations (live lifecycle overrides).
    #[arg(
        long,
        env = env::ANNOTATIONS_FILE,
        default_value = pod::ANNOTATIONS_FILE
    )]
    pub annotations_file: PathBuf,

    // ---- Envoy configuration ----
    /// xDS server (host:port, TLS) for ADS; empty means static mode. Envoy's
    /// ADS stream goes to the agent's proxy on `<run-dir>/xds.sock`, which
    /// holds the one stream to this address.
    #[arg(long, env = env::DISCOVERY_ADDRESS)]
    pub discovery_address: Option<String>,
    /// The name the discovery server's certificate must carry; default the
    /// host of --discovery-address.
    #[arg(long, env = env::DISCOVERY_SERVER_NAME)]
    pub discovery_server_name: Option<String>,
    /// The bearer token (JWT) shown to the discovery server, read on every
    /// (re)connect since the kubelet rotates it.
    #[arg(long, env = env::DISCOVERY_TOKEN_PATH, default_value = remora_contract::discovery::TOKEN_PATH)]
    pub discovery_token_path: PathBuf,
    /// Envoy's ADS is delta xDS (`DELTA_GRPC`); false: state of the world,
    /// for a discovery server without delta (see the xDS proxy's bootstrap).
    #[arg(long, env = "REMORA_DISCOVERY_DELTA", default_value_t = true, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub discovery_delta: bool,
    /// Static mode: an inbound listener `PORT:APP_PORT` (or `APP_PORT` on --inbound-port).
    #[arg(long, env = env::INBOUND, value_delimiter = ',')]
    pub inbound: Vec<InboundSpec>,
    /// Default port of an inbound listener given as `--inbound APP_PORT`.
    #[arg(long, env = "REMORA_INBOUND_PORT", default_value_t = pod::INBOUND_PORT)]
    pub inbound_port: u16,
    /// Static mode: an outbound listener `PORT:HOST:PORT` for the app's calls out.
    #[arg(long, env = env::OUTBOUND, value_delimiter = ',')]
    pub outbound: Vec<OutboundSpec>,
    /// Terminate mTLS on the inbound listeners with the workload certificate from SDS.
    #[arg(long, env = "REMORA_INBOUND_TLS", default_value_t = false,
          num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub inbound_tls: bool,
    /// With --inbound-tls: accept only clients whose certificate has one of these SANs.
    #[arg(long, env = "REMORA_INBOUND_TLS_SAN", value_delimiter = ',')]
    pub inbound_tls_san: Vec<String>,
    /// Static mode: `PORT=SPIFFE_ID`: the --outbound listener on PORT originates
    /// mTLS (workload certificate from SDS) and accepts only an upstream
    /// presenting SPIFFE_ID.
    #[arg(long, env = env::OUTBOUND_TLS, value_delimiter = ',')]
    pub outbound_tls: Vec<OutboundTlsSpec>,
    /// A JSON or YAML file deep-merged (RFC 7386) over the generated bootstrap.
    #[arg(long, env = "REMORA_BOOTSTRAP_OVERRIDE")]
    pub bootstrap_override: Option<PathBuf>,

    // ---- Certificates (SDS) ----
    /// File mode: directory with cert-chain.pem, key.pem, root-cert.pem.
    #[arg(long, env = "REMORA_CERT_DIR")]
    pub cert_dir: Option<PathBuf>,
    /// CA mode: address of an Istio-compatible CA (host:port).
    #[arg(long, env = "REMORA_CA_ADDRESS")]
    pub ca_address: Option<String>,
    /// CA mode: the name the CA's certificate must carry; default the host
    /// of --ca-address (set it when dialling the CA by IP, with no cluster DNS).
    #[arg(long, env = remora_contract::env::CA_SERVER_NAME)]
    pub ca_server_name: Option<String>,
    /// CA mode: PEM bundle that verifies the CA's serving certificate.
    #[arg(long, env = "REMORA_CA_ROOT_CERT")]
    pub ca_root_cert: Option<PathBuf>,
    /// CA mode: the bearer token (JWT) file, read on every call.
    #[arg(
        long,
        env = "REMORA_TOKEN_PATH",
        default_value = "/var/run/secrets/tokens/remora-token"
    )]
    pub token_path: PathBuf,
    /// SPIFFE trust domain of the workload identity.
    #[arg(long, env = "REMORA_TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
    /// Requested certificate lifetime.
    #[arg(long, env = "REMORA_CERT_TTL", value_parser = duration::parse, default_value = "24h")]
    #[serde(with = "duration_text")]
    pub cert_ttl: Duration,
    /// Key algorithm of the workload key.
    #[arg(
        long,
        env = "REMORA_KEY_TYPE",
        value_enum,
        default_value = "ecdsa-p256"
    )]
    pub key_type: KeyType,
    /// CA mode: also write the issued files atomically here, for apps that want them.
    #[arg(long, env = "REMORA_OUTPUT_CERTS")]
    pub output_certs: Option<PathBuf>,
    /// CA mode: cluster id sent as `ClusterID` metadata.
    #[arg(long, env = "REMORA_CLUSTER_ID", default_value = "Kubernetes")]
    pub cluster_id: String,
    /// SDS socket; default `<run-dir>/sds.sock`.
    #[arg(long, env = "REMORA_SDS_SOCKET")]
    pub sds_socket: Option<PathBuf>,

    // ---- Ports ----
    #[arg(long, env = "REMORA_ENVOY_ADMIN_PORT", default_value_t = pod::ENVOY_ADMIN_PORT)]
    pub envoy_admin_port: u16,
    /// Agent admin (metrics, quitquitquit, drain, debug): always on 127.0.0.1.
    #[arg(long, env = env::ADMIN_PORT, default_value_t = pod::AGENT_ADMIN_PORT)]
    pub admin_port: u16,
    /// Health (`/healthz/ready`, `/healthz/live`) port.
    #[arg(long, env = env::HEALTH_PORT, default_value_t = pod::HEALTH_PORT)]
    pub health_port: u16,
    /// Address the health port binds to.
    #[arg(long, env = "REMORA_HEALTH_ADDRESS", default_value_t = IpAddr::V4(Ipv4Addr::UNSPECIFIED))]
    pub health_address: IpAddr,
    /// Envoy's Prometheus stats listener port.
    #[arg(long, env = "REMORA_STATS_PORT", default_value_t = pod::STATS_PORT)]
    pub stats_port: u16,

    // ---- Identity (downward API) ----
    #[arg(long, env = env::POD_NAME, default_value = "")]
    pub pod_name: String,
    #[arg(long, env = env::POD_NAMESPACE, default_value = "")]
    pub pod_namespace: String,
    #[arg(long, env = env::SERVICE_ACCOUNT, default_value = "")]
    pub service_account: String,
    #[arg(long, env = env::INSTANCE_IP, default_value = "")]
    pub instance_ip: String,
}

/// Durations in `/debug/config` are written in the grammar they are given in.
mod duration_text {
    use std::time::Duration;
    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&remora_contract::duration::format(*d))
    }
}

/// Istio's pilot-agent names, accepted so manifests move over unchanged.
/// Each is used only when neither the flag nor its `REMORA_` variable was given.
const ISTIO_ALIASES: &[(&str, &str)] = &[
    (
        "exit_on_zero_active_connections",
        env::istio::EXIT_ON_ZERO_ACTIVE_CONNECTIONS,
    ),
    ("minimum_drain_duration", env::istio::MINIMUM_DRAIN_DURATION),
    (
        "termination_drain_duration",
        env::istio::TERMINATION_DRAIN_DURATION_SECONDS,
    ),
];

impl RunConfig {
    /// Apply Istio's environment aliases and cross-field checks. `env` is the
    /// process environment as a lookup (so tests need no `set_var`).
    pub fn finish(
        mut self,
        matches: &ArgMatches,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let given = |field: &str| {
            !matches!(
                matches.value_source(field),
                None | Some(ValueSource::DefaultValue)
            )
        };
        let mut termination_given = given("termination_drain_duration");
        let mut exit_on_zero_given = given("exit_on_zero_active_connections");
        for (field, var) in ISTIO_ALIASES {
            if given(field) {
                continue;
            }
            let Some(raw) = env(var) else { continue };
            let invalid = |reason: String| ConfigError::Invalid {
                name: var.to_string(),
                value: raw.clone(),
                reason,
            };
            match *field {
                "exit_on_zero_active_connections" => {
                    self.exit_on_zero_active_connections =
                        value::parse_bool(&raw).map_err(&invalid)?;
                    exit_on_zero_given = true;
                }
                "minimum_drain_duration" => {
                    self.minimum_drain_duration =
                        duration::parse(&raw).map_err(|e| invalid(e.to_string()))?;
                }
                "termination_drain_duration" => {
                    // Istio's variable is whole seconds; a duration string is accepted too.
                    self.termination_drain_duration =
                        duration::parse_seconds(&raw).map_err(|e| invalid(e.to_string()))?;
                    termination_given = true;
                }
                _ => {}
            }
        }
        let mode_given = given("drain_mode").then_some(self.drain_mode);
        let exit_on_zero = exit_on_zero_given.then_some(self.exit_on_zero_active_connections);
        if let Some(m) = DrainMode::asked(mode_given, termination_given, exit_on_zero) {
            self.drain_mode = m;
        }
        if self.drain_poll_interval.is_zero() {
            return Err(ConfigError::Invalid {
                name: "--drain-poll-interval".into(),
                value: "0s".into(),
                reason: "must be positive".into(),
            });
        }
        self.check_outbound_tls()?;
        if self.drain_duration.as_secs() == 0 && !self.drain_duration.is_zero() {
            // Envoy takes whole seconds; round sub-second drains up rather than to zero.
            self.drain_duration = Duration::from_secs(1);
        }
        Ok(self)
    }

    /// Each `--outbound-tls` port is an `--outbound` listener's, and named once.
    fn check_outbound_tls(&self) -> Result<(), ConfigError> {
        let mut seen = std::collections::BTreeSet::new();
        for spec in &self.outbound_tls {
            let invalid = |reason: &str| ConfigError::Invalid {
                name: "--outbound-tls".into(),
                value: format!("{}={}", spec.port, spec.spiffe_id),
                reason: reason.into(),
            };
            if !self.outbound.iter().any(|o| o.port == spec.port) {
                return Err(invalid("the port is not one of an --outbound listener"));
            }
            if !seen.insert(spec.port) {
                return Err(invalid("the port is given more than once"));
            }
            // The discovery server's clusters carry no client TLS yet: refused
            // rather than sent in plain text.
            if self.discovery().is_some() {
                return Err(invalid(
                    "not yet carried with --discovery-address (the discovery server's clusters have no TLS yet); drop one of them",
                ));
            }
        }
        Ok(())
    }

    /// The SPIFFE ID the upstream of the outbound listener on `port` must present.
    pub fn outbound_tls_id(&self, port: u16) -> Option<&str> {
        self.outbound_tls
            .iter()
            .find(|s| s.port == port)
            .map(|s| s.spiffe_id.as_str())
    }

    /// Where the SDS socket lives.
    pub fn sds_socket_path(&self) -> PathBuf {
        self.sds_socket
            .clone()
            .unwrap_or_else(|| self.run_dir.join("sds.sock"))
    }

    /// What Envoy's overload manager reads to close idle connections in a drain.
    pub fn drain_pressure_path(&self) -> PathBuf {
        self.run_dir.join(crate::envoy::idle_close::FILE)
    }

    /// The discovery mode's proxy socket, Envoy's ADS endpoint.
    pub fn xds_socket_path(&self) -> PathBuf {
        self.run_dir.join(remora_contract::discovery::PROXY_SOCKET)
    }

    /// Whether Envoy gets its listeners and clusters from a discovery server.
    pub fn discovery(&self) -> Option<&str> {
        self.discovery_address.as_deref().filter(|a| !a.is_empty())
    }

    /// The token file of the admin actions ([`pod::ADMIN_TOKEN_FILE`]).
    pub fn admin_token_path(&self) -> PathBuf {
        self.run_dir.join(pod::ADMIN_TOKEN_FILE)
    }

    /// The app hook helper to copy into --hook-dir.
    pub fn prestop_helper_path(&self) -> Option<PathBuf> {
        self.prestop_helper.clone().or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(|d| d.join(pod::HOOK_HELPER)))
        })
    }

    /// Where the generated bootstrap is written.
    pub fn bootstrap_path(&self) -> PathBuf {
        self.run_dir.join("envoy-bootstrap.json")
    }

    /// The configuration as `/debug/config` shows it: nothing secret is in it
    /// (the token is a path, read at use), but the pass keeps it that way.
    pub fn redacted(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or(serde_json::Value::Null);
        if let Some(obj) = v.as_object_mut() {
            for key in obj.keys().cloned().collect::<Vec<_>>() {
                if is_secret_key(&key) {
                    obj.insert(key, serde_json::Value::String("<redacted>".into()));
                }
            }
        }
        v
    }
}

fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    (k.contains("token") && !k.ends_with("_path"))
        || k.contains("password")
        || k.contains("secret")
        || k.ends_with("_key")
}

fn parse_drain_mode(s: &str) -> Result<DrainMode, String> {
    s.parse()
}

/// `remora-agent wait`.
#[derive(Debug, Clone, Args)]
pub struct WaitConfig {
    /// Give up after this long (exit 1).
    #[arg(long, value_parser = duration::parse, default_value = "60s")]
    pub timeout: Duration,
    /// How long the agent holds each check open, answering the moment it is
    /// ready (the default URL only).
    #[arg(long, value_parser = duration::parse, default_value = "1s")]
    pub hold: Duration,
    /// Time between checks (the first one is immediate); a check the agent
    /// holds is answered as it becomes ready.
    #[arg(long, value_parser = duration::parse, default_value = "200ms")]
    pub period: Duration,
    /// Timeout of a single check, beyond its hold.
    #[arg(long, value_parser = duration::parse, default_value = "1s")]
    pub request_timeout: Duration,
    /// Readiness URL to poll, as is; default: the agent's admin port on
    /// loopback, which holds each check (`--hold`).
    #[arg(long, env = "REMORA_WAIT_URL")]
    pub url: Option<String>,
    /// Admin port of the agent in this container (the hook runs with its env).
    #[arg(long, env = env::ADMIN_PORT, default_value_t = pod::AGENT_ADMIN_PORT)]
    pub admin_port: u16,
}

impl WaitConfig {
    /// The URL of a check the agent holds up to `hold` (`--url` as is).
    pub fn url(&self, hold: Duration) -> String {
        self.url.clone().unwrap_or_else(|| {
            format!(
                "http://127.0.0.1:{}{}?wait={}ms",
                self.admin_port,
                crate::servers::HOLD_READY_PATH,
                hold.as_millis()
            )
        })
    }

    /// The longest one check may take: its hold and the request timeout.
    pub fn check_timeout(&self) -> Duration {
        self.hold.saturating_add(self.request_timeout)
    }
}

/// `remora-agent drain`.
#[derive(Debug, Clone, Args)]
pub struct DrainConfig {
    /// Give up waiting after this long (the agent goes on draining).
    #[arg(long, value_parser = duration::parse, default_value = "120s")]
    pub timeout: Duration,
    /// The agent's admin URL; default: its admin port on loopback.
    #[arg(long, env = "REMORA_ADMIN_URL")]
    pub admin_url: Option<String>,
    /// Admin port of the agent in this container (the hook runs with its env).
    #[arg(long, env = env::ADMIN_PORT, default_value_t = pod::AGENT_ADMIN_PORT)]
    pub admin_port: u16,
    /// The agent's run dir, where it keeps the admin token this helper presents.
    #[arg(long, env = env::RUN_DIR, default_value = pod::RUN_DIR)]
    pub run_dir: PathBuf,
}

impl DrainConfig {
    pub fn admin_url(&self) -> String {
        self.admin_url
            .clone()
            .unwrap_or_else(|| format!("http://127.0.0.1:{}", self.admin_port))
    }
}

/// Parse the process's command line; on error clap prints the culprit and exits 2.
pub fn parse_cli() -> Result<Command, ConfigError> {
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    match cli.command {
        Command::Run(cfg) => {
            let sub = matches
                .subcommand_matches("run")
                .or_else(|| matches.subcommand_matches("proxy"))
                .unwrap_or(&matches);
            let cfg = cfg.finish(sub, |k| std::env::var(k).ok())?;
            Ok(Command::Run(Box::new(cfg)))
        }
        other => Ok(other),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `remora-agent run` with these flags and this environment (also used by
    /// other modules' tests).
    pub(crate) fn run(args: &[&str], env: &[(&str, &str)]) -> Result<RunConfig, String> {
        let mut argv = vec!["remora-agent", "run"];
        argv.extend_from_slice(args);
        let m = Cli::command()
            .try_get_matches_from(argv)
            .map_err(|e| e.to_string())?;
        let cli = Cli::from_arg_matches(&m).map_err(|e| e.to_string())?;
        let Command::Run(cfg) = cli.command else {
            unreachable!()
        };
        let sub = m.subcommand_matches("run").expect("run");
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        cfg.finish(sub, |k| {
            env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        })
        .map_err(|e| e.to_string())
    }

    #[test]
    fn durations_follow_the_contract_grammar_and_bound() {
        let c = run(
            &["--drain-duration", "1m30s", "--drain-deadline", "24h"],
            &[],
        )
        .expect("in the grammar");
        assert_eq!(c.drain_duration, Duration::from_secs(90));
        assert_eq!(c.drain_deadline, duration::MAX);
        for (flag, value, says) in [
            ("--drain-duration", "30", "30s"),
            ("--drain-deadline", "2562047788015215h30m2s", "24h"),
            ("--termination-drain-duration", "0.5", "45s"),
        ] {
            let err = run(&[flag, value], &[]).unwrap_err();
            assert!(err.contains(flag) && err.contains(says), "{err}");
        }
        let err = run(&[], &[("TERMINATION_DRAIN_DURATION_SECONDS", "99999999")]).unwrap_err();
        assert!(
            err.contains("TERMINATION_DRAIN_DURATION_SECONDS") && err.contains("24h"),
            "{err}"
        );
    }

    #[test]
    fn defaults_match_design() {
        let c = run(&[], &[]).expect("defaults parse");
        assert_eq!(c.envoy_admin_port, 15000);
        assert_eq!(c.admin_port, 15020);
        assert_eq!(c.health_port, 15021);
        assert_eq!(c.stats_port, 15090);
        assert_eq!(c.drain_duration, Duration::from_secs(45));
        assert_eq!(c.parent_shutdown_duration, Duration::from_secs(60));
        assert_eq!(c.termination_drain_duration, Duration::from_secs(5));
        assert_eq!(c.minimum_drain_duration, Duration::from_secs(5));
        assert!(!c.exit_on_zero_active_connections);
        assert_eq!(c.run_dir, PathBuf::from("/var/run/remora"));
        assert_eq!(
            c.sds_socket_path(),
            PathBuf::from("/var/run/remora/sds.sock")
        );
        assert_eq!(c.trust_domain, "cluster.local");
    }

    #[test]
    fn istio_aliases_apply_only_when_flag_absent() {
        let env = [
            ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true"),
            ("MINIMUM_DRAIN_DURATION", "12s"),
            ("TERMINATION_DRAIN_DURATION_SECONDS", "9"),
        ];
        let c = run(&[], &env).expect("aliases parse");
        assert!(c.exit_on_zero_active_connections);
        assert_eq!(c.minimum_drain_duration, Duration::from_secs(12));
        assert_eq!(c.termination_drain_duration, Duration::from_secs(9));

        let c = run(
            &[
                "--termination-drain-duration",
                "2s",
                "--exit-on-zero-active-connections=false",
            ],
            &env,
        )
        .expect("flags parse");
        assert_eq!(c.termination_drain_duration, Duration::from_secs(2));
        assert!(!c.exit_on_zero_active_connections);
    }

    /// An explicit termination drain duration is honoured (Istio's `0s`
    /// means exit at once), unless a drain mode is given as well.
    #[test]
    fn a_given_termination_drain_duration_makes_the_drain_fixed() {
        assert_eq!(
            run(&[], &[]).expect("defaults").drain_mode,
            DrainMode::Adaptive
        );
        // Exit-on-zero is the fixed drain's too: turned on by the flag or
        // Istio's variable, it asks for it; turned off, it asks for nothing.
        for (args, env, mode) in [
            (
                &["--exit-on-zero-active-connections=true"][..],
                &[][..],
                DrainMode::Fixed,
            ),
            (
                &[],
                &[("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true")][..],
                DrainMode::Fixed,
            ),
            (
                &["--exit-on-zero-active-connections=false"][..],
                &[][..],
                DrainMode::Adaptive,
            ),
        ] {
            let c = run(args, env).expect("parses");
            assert_eq!(c.drain_mode, mode, "{args:?} {env:?}");
        }
        for (args, env) in [
            (&["--termination-drain-duration", "0s"][..], &[][..]),
            (&[], &[("TERMINATION_DRAIN_DURATION_SECONDS", "0")][..]),
        ] {
            let c = run(args, env).expect("parses");
            assert_eq!(
                (c.drain_mode, c.termination_drain_duration),
                (DrainMode::Fixed, Duration::ZERO),
                "{args:?} {env:?}"
            );
        }
        let c = run(
            &[
                "--termination-drain-duration",
                "0s",
                "--drain-mode",
                "Adaptive",
            ],
            &[],
        )
        .expect("parses");
        assert_eq!(c.drain_mode, DrainMode::Adaptive);
    }

    #[test]
    fn bad_alias_is_named() {
        let err = run(&[], &[("MINIMUM_DRAIN_DURATION", "forever")]).unwrap_err();
        assert!(err.contains("MINIMUM_DRAIN_DURATION"), "{err}");
    }

    #[test]
    fn bad_flag_names_the_flag() {
        let err = run(&["--drain-duration", "soon"], &[]).unwrap_err();
        assert!(err.contains("--drain-duration"), "{err}");
        let err = run(&["--inbound", "x:1"], &[]).unwrap_err();
        assert!(err.contains("--inbound"), "{err}");
    }

    #[test]
    fn outbound_tls_names_an_outbound_port_once_with_a_spiffe_id() {
        let id = "spiffe://cluster.local/ns/shop/sa/cart";
        let c = run(
            &[
                "--outbound=15001:cart:80,15002:db:5432",
                &format!("--outbound-tls=15001={id}"),
            ],
            &[],
        )
        .expect("valid");
        assert_eq!(c.outbound_tls_id(15001), Some(id));
        assert_eq!(c.outbound_tls_id(15002), None);
        assert_eq!(c.redacted()["outbound_tls"][0]["spiffe_id"], id);

        for (args, says) in [
            (
                vec!["--outbound=15001:a:80", "--outbound-tls=15001"],
                "PORT=SPIFFE_ID",
            ),
            (
                vec!["--outbound=15001:a:80", "--outbound-tls=x=spiffe://a/b"],
                "port",
            ),
            (
                vec!["--outbound=15001:a:80", "--outbound-tls=15001=https://a/b"],
                "SPIFFE",
            ),
            (
                vec!["--outbound=15001:a:80", "--outbound-tls=15001=spiffe://"],
                "SPIFFE",
            ),
            (
                vec!["--outbound=15001:a:80", "--outbound-tls=15002=spiffe://a/b"],
                "--outbound listener",
            ),
            (
                vec![
                    "--outbound=15001:a:80",
                    "--outbound-tls=15001=spiffe://a/b,15001=spiffe://a/c",
                ],
                "more than once",
            ),
            (
                vec![
                    "--outbound=15001:a:80",
                    "--outbound-tls=15001=spiffe://a/b",
                    "--discovery-address=xds:15010",
                ],
                "--discovery-address",
            ),
        ] {
            let err = run(&args, &[]).unwrap_err();
            assert!(
                err.contains("--outbound-tls") && err.contains(says),
                "{args:?}: {err}"
            );
        }
    }

    #[test]
    fn helpers_follow_the_ports_of_their_container() {
        let cli =
            Cli::try_parse_from(["remora-agent", "wait", "--admin-port", "17020"]).expect("parses");
        let Command::Wait(w) = cli.command else {
            unreachable!()
        };
        assert_eq!(w.url(w.hold), "http://127.0.0.1:17020/ready?wait=1000ms");
        assert_eq!(w.check_timeout(), Duration::from_secs(2));
        let cli = Cli::try_parse_from(["remora-agent", "drain", "--admin-port", "17020"])
            .expect("parses");
        let Command::Drain(d) = cli.command else {
            unreachable!()
        };
        assert_eq!(d.admin_url(), "http://127.0.0.1:17020");
    }

    #[test]
    fn pod_restart_policy_says_whether_the_pod_can_complete() {
        for (args, can) in [
            (vec![], false),
            (vec!["--pod-restart-policy", "Always"], false),
            (vec!["--pod-restart-policy", "Never"], true),
            (vec!["--pod-restart-policy", "OnFailure"], true),
        ] {
            let c = run(&args, &[]).expect("valid");
            assert_eq!(
                PodRestartPolicy::can_complete(c.pod_restart_policy),
                can,
                "{args:?}"
            );
        }
        let err = run(&["--pod-restart-policy", "Sometimes"], &[]).unwrap_err();
        assert!(err.contains("--pod-restart-policy"), "{err}");
    }

    #[test]
    fn redaction_hides_secret_like_keys() {
        assert!(is_secret_key("bearer_token"));
        assert!(!is_secret_key("token_path"));
        assert!(is_secret_key("private_key"));
        let c = run(&[], &[]).expect("defaults");
        let v = c.redacted();
        assert_eq!(v["token_path"], "/var/run/secrets/tokens/remora-token");
        assert_eq!(v["drain_duration"], "45s");
    }
}
