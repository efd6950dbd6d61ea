//! The flags of `remora-operator` (clap): what the process is told at
//! start, each also read from an env var. What they mean for the sidecar's
//! config is resolved in [`remora_inject::resolve`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use remora_crds::SidecarMode;

use crate::leader::{self, LeaderConfig};
use crate::pki::workload_ca::roots;
use remora_inject::resolve::{ChartDefaults, WorkloadCaWiring};

#[derive(Debug, Clone, clap::Args)]
pub struct ProxyArgs {
    /// The sidecar image (it must provide `remora-agent` on PATH).
    #[arg(
        long,
        env = "REMORA_PROXY_IMAGE",
        default_value = "ghcr.io/remora/remora-agent:latest"
    )]
    pub proxy_image: String,
    /// imagePullPolicy of the sidecar.
    #[arg(
        long,
        env = "REMORA_PROXY_IMAGE_PULL_POLICY",
        default_value = "IfNotPresent"
    )]
    pub proxy_image_pull_policy: String,
}

impl ProxyArgs {
    pub fn chart(&self, mode: SidecarMode) -> ChartDefaults {
        ChartDefaults {
            image: self.proxy_image.clone(),
            image_pull_policy: self.proxy_image_pull_policy.clone(),
            mode,
            ..ChartDefaults::default()
        }
    }
}

/// `<n>s`, `<n>m`, `<n>h` or `<n>d`, up to [`crate::pki::webhook_cert::MAX_VALIDITY`]:
/// certificate lifetimes are longer than the contract's durations allow.
pub fn parse_validity(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let (n, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{t:?}: expected <number><s|m|h|d>"))?;
    let per = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{t:?}: the unit must be s, m, h or d")),
    };
    let secs = n
        .checked_mul(per)
        .filter(|s| *s > 0 && *s <= crate::pki::webhook_cert::MAX_VALIDITY.as_secs())
        .ok_or_else(|| {
            format!(
                "{t:?}: must be more than 0 and at most {}d",
                crate::pki::webhook_cert::MAX_VALIDITY.as_secs() / 86_400
            )
        })?;
    Ok(Duration::from_secs(secs))
}

fn parse_serving_validity(text: &str) -> Result<Duration, String> {
    let d = parse_validity(text)?;
    if d < crate::pki::webhook_cert::MIN_SERVING_VALIDITY {
        return Err(format!(
            "{text:?}: must be at least {}s",
            crate::pki::webhook_cert::MIN_SERVING_VALIDITY.as_secs()
        ));
    }
    Ok(d)
}

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address of the HTTPS listener.
    #[arg(long, env = "REMORA_LISTEN", default_value = "0.0.0.0:9443")]
    pub listen: SocketAddr,
    /// PEM serving certificate chain; reloaded when it changes.
    #[arg(
        long,
        env = "REMORA_TLS_CERT",
        default_value = "/etc/remora/tls/tls.crt"
    )]
    pub tls_cert: PathBuf,
    /// PEM private key of the serving certificate.
    #[arg(
        long,
        env = "REMORA_TLS_KEY",
        default_value = "/etc/remora/tls/tls.key"
    )]
    pub tls_key: PathBuf,
    /// How often the certificate files are checked for a change.
    #[arg(long, env = "REMORA_CERT_RELOAD_INTERVAL", value_parser = remora_contract::duration::parse, default_value = "10s")]
    pub cert_reload_interval: Duration,
    /// The operator's namespace: a SidecarLifecycle without selector there is
    /// the cluster default; the leader Lease lives there too.
    #[arg(long, env = "POD_NAMESPACE", default_value = "remora-system")]
    pub operator_namespace: String,
    /// Largest AdmissionReview body read. The API server takes request
    /// bodies of at most 3 MiB, and a Pod CREATE review carries the object
    /// once: 4 MiB leaves room for the review's envelope and JSON growth.
    #[arg(long, env = "REMORA_MAX_REQUEST_BYTES", default_value_t = 4 << 20)]
    pub max_request_bytes: usize,
    /// Memory the reviews in progress may hold together (each counts four
    /// times the body bytes received so far; one client address may hold a
    /// quarter); a review that finds none within 2 s gets a 503.
    #[arg(long, env = "REMORA_REVIEW_MEMORY_BUDGET", default_value_t = crate::webhook::server::DEFAULT_REVIEW_MEMORY_BUDGET)]
    pub review_memory_budget: usize,
    /// Mode when no SidecarLifecycle or annotation says.
    #[arg(long, env = "REMORA_DEFAULT_MODE", default_value = "Auto")]
    pub default_mode: SidecarMode,
    /// How long to wait for the first listing of the cluster before serving.
    #[arg(long, env = "REMORA_SYNC_TIMEOUT", value_parser = remora_contract::duration::parse, default_value = "30s")]
    pub sync_timeout: Duration,
    /// Make and share our own CA and serving certificate (in --tls-secret)
    /// and patch its CA into --webhook-config, instead of reading --tls-cert/--tls-key.
    #[arg(long, env = "REMORA_SELF_SIGNED", default_value_t = false, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub self_signed: bool,
    /// Secret (in the operator's namespace) holding the self-managed CA and certificate.
    #[arg(long, env = "REMORA_TLS_SECRET", default_value = "remora-operator-tls")]
    pub tls_secret: String,
    /// Service name the API server calls the webhook by (the certificate's names).
    #[arg(long, env = "REMORA_SERVICE_NAME", default_value = "remora-operator")]
    pub service_name: String,
    /// MutatingWebhookConfiguration whose caBundle is kept current.
    #[arg(long, env = "REMORA_WEBHOOK_CONFIG", default_value = "remora-operator")]
    pub webhook_config: String,
    /// Lifetime of the self-managed CA (`<n>s|m|h|d`, at least
    /// --serving-cert-validity); rotated at two thirds of it, with old and
    /// new roots both in the caBundle meanwhile (operator README).
    #[arg(long, env = "REMORA_CA_VALIDITY", value_parser = parse_validity, default_value = "365d")]
    pub ca_validity: Duration,
    /// Lifetime of the self-managed serving certificate (`<n>s|m|h|d`, at
    /// least 30s); renewed from the stored CA at two thirds of it.
    #[arg(long, env = "REMORA_SERVING_CERT_VALIDITY", value_parser = parse_serving_validity, default_value = "90d")]
    pub serving_cert_validity: Duration,
    /// Longest time between two reads of the self-managed Secret (a replica
    /// picks up another's renewal within it).
    #[arg(long, env = "REMORA_TLS_SECRET_RESYNC", value_parser = remora_contract::duration::parse, default_value = "60s")]
    pub tls_secret_resync: Duration,
    /// Where the self-managed certificate files are written (a writable emptyDir).
    #[arg(
        long,
        env = "REMORA_SELF_SIGNED_DIR",
        default_value = "/var/run/remora-operator/tls"
    )]
    pub self_signed_dir: PathBuf,
    /// Run the SidecarLifecycle controller (status, live retuning, rollouts)
    /// while leader.
    #[arg(long, env = "REMORA_CONTROLLER", default_value_t = true, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub controller: bool,
    /// Ask the Legacy sidecar of a Job's pod to stop once its apps have
    /// terminated (while leader).
    #[arg(long, env = "REMORA_STOP_COMPLETED_JOBS", default_value_t = true, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub stop_completed_jobs: bool,
    /// Roll the workloads of SidecarLifecycles with rolloutPolicy Automatic
    /// (needs get and patch on Deployments, StatefulSets and DaemonSets).
    /// Off: they report RestartRequired with reason AutomaticRolloutsDisabled.
    #[arg(long, env = "REMORA_AUTOMATIC_ROLLOUTS", default_value_t = false, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub automatic_rollouts: bool,
    /// Minimum time between two automatic rollouts (rolloutPolicy Automatic), cluster-wide.
    #[arg(long, env = "REMORA_ROLLOUT_INTERVAL", value_parser = remora_contract::duration::parse, default_value = "30s")]
    pub rollout_interval: Duration,
    /// Requests per second the leader's controllers may make to the API
    /// server (status, pod patches, Events, rollouts; not watches).
    #[arg(long, env = "REMORA_KUBE_API_QPS", default_value_t = crate::controllers::lifecycle::DEFAULT_QPS,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub kube_api_qps: u32,
    /// Requests the controllers may make at once above --kube-api-qps.
    #[arg(long, env = "REMORA_KUBE_API_BURST", default_value_t = crate::controllers::lifecycle::DEFAULT_BURST,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub kube_api_burst: u32,
    /// Run the controller only while holding the leader Lease; false: this
    /// replica always runs it (one replica only).
    #[arg(long, env = "REMORA_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub leader_elect: bool,
    /// Name of the leader Lease (in the operator's namespace).
    #[arg(long, env = "REMORA_LEASE_NAME", default_value = leader::DEFAULT_LEASE_NAME)]
    pub lease_name: String,
    /// This replica's name in the Lease; default: hostname and a random suffix.
    #[arg(long, env = "POD_NAME")]
    pub leader_identity: Option<String>,
    /// How long the others respect a Lease that stopped being renewed.
    #[arg(long, env = "REMORA_LEASE_DURATION", value_parser = remora_contract::duration::parse, default_value = "15s")]
    pub lease_duration: Duration,
    /// The leader steps down when it could not renew for this long
    /// (shorter than --lease-duration).
    #[arg(long, env = "REMORA_RENEW_DEADLINE", value_parser = remora_contract::duration::parse, default_value = "10s")]
    pub renew_deadline: Duration,
    /// Pause between attempts to acquire or renew the Lease.
    #[arg(long, env = "REMORA_RETRY_PERIOD", value_parser = remora_contract::duration::parse, default_value = "2s")]
    pub retry_period: Duration,
    /// After SIGTERM: how long in-flight admissions and the leader-only work
    /// get to finish before they are cut off.
    #[arg(long, env = "REMORA_SHUTDOWN_GRACE", value_parser = remora_contract::duration::parse, default_value = "10s")]
    pub shutdown_grace: Duration,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "REMORA_LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    #[command(flatten)]
    pub proxy: ProxyArgs,
    #[command(flatten)]
    pub workload_ca: WorkloadCaArgs,
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
}

/// The discovery server (Envoy's ADS), served by every replica when
/// enabled. Off by default while it is built up in steps.
#[derive(Debug, Clone, clap::Args)]
pub struct DiscoveryArgs {
    /// Serve xDS to the sidecars. Needs --workload-ca in this step: its
    /// serving certificate is the discovery server's.
    #[arg(id = "discovery_enabled", long = "discovery", env = "REMORA_DISCOVERY", default_value_t = false, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub enabled: bool,
    /// Where the discovery server (gRPC over TLS) listens.
    #[arg(
        id = "discovery_listen",
        long = "discovery-listen",
        env = "REMORA_DISCOVERY_LISTEN",
        default_value = "0.0.0.0:15010"
    )]
    pub listen: SocketAddr,
    /// Changes are pushed once none came for this long (not yet measured).
    #[arg(long = "discovery-debounce-quiet", env = "REMORA_DISCOVERY_DEBOUNCE_QUIET",
          value_parser = remora_contract::duration::parse, default_value = "100ms")]
    pub debounce_quiet: Duration,
    /// ... and at the latest this long after the first (not yet measured).
    #[arg(long = "discovery-debounce-max", env = "REMORA_DISCOVERY_DEBOUNCE_MAX",
          value_parser = remora_contract::duration::parse, default_value = "1s")]
    pub debounce_max: Duration,
    /// Pushes (recompute and send) at once across all streams, as Istio's
    /// PILOT_PUSH_THROTTLE; the others wait their turn.
    #[arg(long = "discovery-push-throttle", env = "REMORA_DISCOVERY_PUSH_THROTTLE",
          default_value_t = crate::discovery::push::DEFAULT_PUSH_THROTTLE)]
    pub push_throttle: usize,
    /// The cluster's DNS domain: Service hosts are `name.ns.svc.<domain>`.
    #[arg(
        long = "cluster-domain",
        env = "REMORA_CLUSTER_DOMAIN",
        default_value = "cluster.local"
    )]
    pub cluster_domain: String,
}

impl DiscoveryArgs {
    fn check(&self, workload_ca: bool) -> Result<(), String> {
        if !self.enabled {
            return Ok(());
        }
        if !workload_ca {
            return Err("--discovery needs --workload-ca: the discovery server serves with the workload CA's certificate".into());
        }
        if self.debounce_quiet.is_zero() || self.debounce_quiet > self.debounce_max {
            return Err(format!(
                "--discovery-debounce-quiet ({:?}) must be more than 0 and at most --discovery-debounce-max ({:?})",
                self.debounce_quiet, self.debounce_max
            ));
        }
        if self.push_throttle == 0 {
            return Err("--discovery-push-throttle must be at least 1".into());
        }
        Ok(())
    }
}

/// The workload CA (Istio's CA protocol): served by every replica when
/// enabled, and given to every injected sidecar that does not opt out.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkloadCaArgs {
    /// Serve the workload CA and wire it into injected sidecars.
    #[arg(long = "workload-ca", env = "REMORA_WORKLOAD_CA", default_value_t = false, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub enabled: bool,
    /// Where the CA's gRPC server (TLS) listens.
    #[arg(
        id = "workload_ca_listen",
        long = "workload-ca-listen",
        env = "REMORA_WORKLOAD_CA_LISTEN",
        default_value = "0.0.0.0:15012"
    )]
    pub listen: SocketAddr,
    /// The address sidecars dial (`host:port`); default
    /// `<--service-name>.<operator namespace>.svc:15012`.
    #[arg(long = "workload-ca-address", env = "REMORA_WORKLOAD_CA_ADDRESS")]
    pub address: Option<String>,
    /// SPIFFE trust domain of every workload identity.
    #[arg(long, env = "REMORA_TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
    /// Lifetime sidecars request (their `--cert-ttl`).
    #[arg(long = "workload-cert-ttl", env = "REMORA_WORKLOAD_CERT_TTL", value_parser = parse_validity, default_value = "24h")]
    pub cert_ttl: Duration,
    /// The longest lifetime the CA grants; longer requests get this.
    #[arg(long = "workload-cert-max-ttl", env = "REMORA_WORKLOAD_CERT_MAX_TTL", value_parser = parse_validity, default_value = "48h")]
    pub cert_max_ttl: Duration,
    /// Lifetime of a signing root; the next one is staged at two thirds of it.
    #[arg(long = "workload-ca-root-validity", env = "REMORA_WORKLOAD_CA_ROOT_VALIDITY", value_parser = parse_validity, default_value = "365d")]
    pub root_validity: Duration,
    /// How long a trust-bundle change takes to reach every pod (the
    /// kubelet's ConfigMap refresh, and the agent's call to the CA it
    /// prompts): a staged root signs only this long after the leader has
    /// seen it into every namespace's bundle, a retired one leaves the
    /// bundle this long after the last certificate it signed has expired,
    /// and a replica that has not read the signing Secret for this long
    /// stops signing.
    #[arg(long = "workload-ca-settle", env = "REMORA_WORKLOAD_CA_SETTLE", value_parser = parse_validity, default_value = "2m")]
    pub settle: Duration,
    /// Secret (in the operator's namespace) with the signing roots.
    #[arg(long = "workload-ca-secret", env = "REMORA_WORKLOAD_CA_SECRET", default_value = remora_contract::workload_ca::SIGNING_SECRET)]
    pub secret: String,
    /// Other Services (in the operator's namespace) that route to the CA:
    /// its certificate also carries their names. Sidecars injected before
    /// the operator was renamed dial the Service `<release>-injector`.
    #[arg(
        long = "workload-ca-service-alias",
        env = "REMORA_WORKLOAD_CA_SERVICE_ALIASES",
        value_delimiter = ','
    )]
    pub service_aliases: Vec<String>,
    /// Certificate requests served at once; more wait (bounded by the
    /// connection limit and a request timeout).
    #[arg(long = "workload-ca-max-in-flight", env = "REMORA_WORKLOAD_CA_MAX_IN_FLIGHT", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_in_flight: u32,
}

impl WorkloadCaArgs {
    /// What injected sidecars are told of the CA, `None` when it is off.
    pub fn wiring(&self, service_name: &str, operator_namespace: &str) -> Option<WorkloadCaWiring> {
        self.enabled.then(|| WorkloadCaWiring {
            address: self.sidecar_address(service_name, operator_namespace),
            server_name: None,
            trust_domain: self.trust_domain.clone(),
            // The agent reads --cert-ttl in the contract's grammar, bounded by
            // its MAX: a longer request would stop the sidecar from starting,
            // and the CA grants at most its own maximum anyway.
            cert_ttl: self.cert_ttl.min(remora_contract::duration::MAX),
            discovery: None,
        })
    }

    /// The root rotation timings.
    pub fn root_policy(&self) -> roots::Policy {
        roots::Policy {
            validity: self.root_validity,
            settle: self.settle,
            overlap: self.cert_max_ttl.saturating_add(self.settle),
        }
    }

    /// How often each replica reads the signing Secret: often enough that a
    /// step is taken well within the settle time.
    pub fn keeper_period(&self) -> Duration {
        (self.settle / 6).clamp(Duration::from_secs(1), Duration::from_secs(30))
    }

    /// The address injected sidecars dial.
    pub fn sidecar_address(&self, service_name: &str, operator_namespace: &str) -> String {
        self.address
            .clone()
            .filter(|a| !a.is_empty())
            .unwrap_or_else(|| {
                format!(
                    "{service_name}.{operator_namespace}.svc:{}",
                    remora_contract::workload_ca::PORT
                )
            })
    }

    /// Lifetimes against each other; the message names the flags.
    pub fn check(&self) -> Result<(), String> {
        if !self.enabled {
            return Ok(());
        }
        if self.cert_max_ttl < self.cert_ttl {
            return Err(format!(
                "--workload-cert-max-ttl ({:?}) must be at least --workload-cert-ttl ({:?})",
                self.cert_max_ttl, self.cert_ttl
            ));
        }
        // The sidecar's --cert-ttl takes the contract's durations (up to 24h).
        if self.cert_ttl < Duration::from_secs(60) || self.cert_ttl > remora_contract::duration::MAX
        {
            return Err(format!(
                "--workload-cert-ttl must be within 60s and {:?}",
                remora_contract::duration::MAX
            ));
        }
        // The kubelet refreshes a ConfigMap volume within about a minute: a
        // shorter settle would let a new root sign before pods trust it.
        if self.settle < Duration::from_secs(60) {
            return Err(format!(
                "--workload-ca-settle ({:?}) must be at least 60s",
                self.settle
            ));
        }
        // A root must outlive every certificate it signs plus a rotation's
        // overlap, or leaves would outlive their issuer.
        let needed = self
            .cert_max_ttl
            .saturating_add(self.settle)
            .saturating_mul(3);
        if self.root_validity < needed {
            return Err(format!(
                "--workload-ca-root-validity ({:?}) must be at least 3 x (--workload-cert-max-ttl + --workload-ca-settle) = {needed:?}",
                self.root_validity
            ));
        }
        Ok(())
    }
}

impl ServeArgs {
    /// What clap cannot check flag by flag: the self-managed certificate's
    /// lifetimes against each other and against the pickup intervals. The
    /// message names the flags.
    pub fn check(&self) -> Result<(), String> {
        self.workload_ca.check()?;
        self.discovery.check(self.workload_ca.enabled)?;
        if !self.self_signed {
            return Ok(());
        }
        if self.ca_validity < self.serving_cert_validity {
            return Err(format!(
                "--ca-validity ({:?}) must be at least --serving-cert-validity ({:?})",
                self.ca_validity, self.serving_cert_validity
            ));
        }
        if self.tls_secret_resync.is_zero() || self.cert_reload_interval.is_zero() {
            return Err(
                "--tls-secret-resync and --cert-reload-interval must be more than 0".into(),
            );
        }
        // Every replica must have read and loaded a renewal before the old
        // certificate ends: a third of its life covers both intervals.
        let pickup = self
            .tls_secret_resync
            .saturating_add(self.cert_reload_interval);
        let third = self.serving_cert_validity / 3;
        if third <= pickup {
            return Err(format!(
                "--serving-cert-validity {:?} leaves a third ({third:?}) that does not cover --tls-secret-resync + --cert-reload-interval ({pickup:?})",
                self.serving_cert_validity
            ));
        }
        Ok(())
    }

    /// The election settings these flags give.
    pub fn leader_config(&self) -> LeaderConfig {
        let identity = self
            .leader_identity
            .clone()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(leader::default_identity);
        LeaderConfig {
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
            stop_timeout: self.shutdown_grace,
            ..LeaderConfig::new(&self.lease_name, &self.operator_namespace, &identity)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_is_off_by_default_and_needs_the_workload_ca() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            ca: WorkloadCaArgs,
            #[command(flatten)]
            discovery: DiscoveryArgs,
        }
        let check = |args: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
                .expect("flags parse");
            (
                cli.discovery.enabled,
                cli.discovery.check(cli.ca.enabled),
                cli.discovery,
            )
        };
        let (on, ok, d) = check(&[]);
        assert!(!on && ok.is_ok());
        assert_eq!(d.listen.port(), remora_contract::discovery::PORT);
        assert_eq!(
            (d.debounce_quiet, d.debounce_max),
            (Duration::from_millis(100), Duration::from_secs(1))
        );
        let (_, e, _) = check(&["--discovery"]);
        assert!(e.expect_err("needs the CA").contains("--workload-ca"));
        assert!(check(&["--discovery", "--workload-ca"]).1.is_ok());
        let (_, e, _) = check(&[
            "--discovery",
            "--workload-ca",
            "--discovery-debounce-quiet",
            "2s",
        ]);
        assert!(
            e.expect_err("quiet > max")
                .contains("--discovery-debounce-max")
        );
        assert_eq!(d.push_throttle, 100);
        let (_, e, _) = check(&[
            "--discovery",
            "--workload-ca",
            "--discovery-push-throttle",
            "0",
        ]);
        assert!(
            e.expect_err("no push at all")
                .contains("--discovery-push-throttle")
        );
    }

    #[test]
    fn workload_ca_wiring_from_the_serve_flags() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            ca: WorkloadCaArgs,
        }
        let wiring = |args: &[&str]| {
            let cli = Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
                .expect("flags parse");
            cli.ca.wiring("remora-operator", "ops")
        };
        assert_eq!(wiring(&[]), None, "off by default");
        assert_eq!(
            wiring(&["--workload-ca"]),
            Some(WorkloadCaWiring {
                address: "remora-operator.ops.svc:15012".into(),
                server_name: None,
                trust_domain: "cluster.local".into(),
                cert_ttl: Duration::from_secs(24 * 3600),
                discovery: None,
            })
        );
        let w = wiring(&[
            "--workload-ca=true",
            "--workload-ca-address",
            "ca.example:443",
            "--trust-domain",
            "mesh.example",
            "--workload-cert-ttl",
            "2d",
            "--workload-cert-max-ttl",
            "3d",
        ])
        .expect("on");
        assert_eq!(w.address, "ca.example:443");
        assert_eq!(w.trust_domain, "mesh.example");
        assert_eq!(
            w.cert_ttl,
            remora_contract::duration::MAX,
            "bounded by what the agent reads"
        );
    }
}
