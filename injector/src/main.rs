//! remora-injector: `serve` (webhook), `inject` (offline), `crds`.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use remora_crds::SidecarMode;
use remora_injector::config::ChartDefaults;
use remora_injector::offline::{OfflineOptions, inject_stream, parse_lifecycle};
use remora_injector::server::{AppState, Metrics, router, serve_tls};
use remora_injector::tls::ReloadingCert;
use remora_injector::webhook::Injector;

// The webhook allocates and frees many small JSON values per request.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "remora-injector",
    version,
    about = "Remora's sidecar injector and operator"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the mutating webhook (HTTPS) against the cluster.
    Serve(Box<ServeArgs>),
    /// Inject workloads of a YAML stream offline (GitOps): YAML in, YAML out.
    Inject(InjectArgs),
    /// Print the CRD YAML.
    Crds,
}

#[derive(Debug, clap::Args)]
struct ProxyArgs {
    /// The sidecar image (it must provide `remora-agent` on PATH).
    #[arg(
        long,
        env = "REMORA_PROXY_IMAGE",
        default_value = "ghcr.io/remora/remora-agent:latest"
    )]
    proxy_image: String,
    /// imagePullPolicy of the sidecar.
    #[arg(
        long,
        env = "REMORA_PROXY_IMAGE_PULL_POLICY",
        default_value = "IfNotPresent"
    )]
    proxy_image_pull_policy: String,
}

impl ProxyArgs {
    fn chart(&self, mode: SidecarMode) -> ChartDefaults {
        ChartDefaults {
            image: self.proxy_image.clone(),
            image_pull_policy: self.proxy_image_pull_policy.clone(),
            mode,
            ..ChartDefaults::default()
        }
    }
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address of the HTTPS listener.
    #[arg(long, env = "REMORA_LISTEN", default_value = "0.0.0.0:9443")]
    listen: SocketAddr,
    /// PEM serving certificate chain; reloaded when it changes.
    #[arg(
        long,
        env = "REMORA_TLS_CERT",
        default_value = "/etc/remora/tls/tls.crt"
    )]
    tls_cert: PathBuf,
    /// PEM private key of the serving certificate.
    #[arg(
        long,
        env = "REMORA_TLS_KEY",
        default_value = "/etc/remora/tls/tls.key"
    )]
    tls_key: PathBuf,
    /// How often the certificate files are checked for a change.
    #[arg(long, env = "REMORA_CERT_RELOAD_INTERVAL", value_parser = remora_agent::config::parse_duration, default_value = "10s")]
    cert_reload_interval: Duration,
    /// The operator's namespace: a SidecarLifecycle without selector there is the cluster default.
    #[arg(long, env = "POD_NAMESPACE", default_value = "remora-system")]
    operator_namespace: String,
    /// Largest AdmissionReview body read.
    #[arg(long, env = "REMORA_MAX_REQUEST_BYTES", default_value_t = 8 << 20)]
    max_request_bytes: usize,
    /// Mode when no SidecarLifecycle or annotation says.
    #[arg(long, env = "REMORA_DEFAULT_MODE", default_value = "Auto")]
    default_mode: SidecarMode,
    /// How long to wait for the first listing of the cluster before serving.
    #[arg(long, env = "REMORA_SYNC_TIMEOUT", value_parser = remora_agent::config::parse_duration, default_value = "30s")]
    sync_timeout: Duration,
    /// Make and share our own CA and serving certificate (in --tls-secret)
    /// and patch its CA into --webhook-config, instead of reading --tls-cert/--tls-key.
    #[arg(long, env = "REMORA_SELF_SIGNED", default_value_t = false, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    self_signed: bool,
    /// Secret (in the operator's namespace) holding the self-managed CA and certificate.
    #[arg(long, env = "REMORA_TLS_SECRET", default_value = "remora-injector-tls")]
    tls_secret: String,
    /// Service name the API server calls the webhook by (the certificate's names).
    #[arg(long, env = "REMORA_SERVICE_NAME", default_value = "remora-injector")]
    service_name: String,
    /// MutatingWebhookConfiguration whose caBundle is kept current.
    #[arg(long, env = "REMORA_WEBHOOK_CONFIG", default_value = "remora-injector")]
    webhook_config: String,
    /// Where the self-managed certificate files are written (a writable emptyDir).
    #[arg(
        long,
        env = "REMORA_SELF_SIGNED_DIR",
        default_value = "/var/run/remora-injector/tls"
    )]
    self_signed_dir: PathBuf,
    /// How often SidecarLifecycle statuses are recomputed; 0 turns the status controller off.
    #[arg(long, env = "REMORA_STATUS_INTERVAL", value_parser = remora_agent::config::parse_duration, default_value = "15s")]
    status_interval: Duration,
    /// Ask the Legacy sidecar of a Job's pod to stop once its apps have terminated.
    #[arg(long, env = "REMORA_STOP_COMPLETED_JOBS", default_value_t = true, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    stop_completed_jobs: bool,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "REMORA_LOG_LEVEL", default_value = "info")]
    log_level: String,
    #[command(flatten)]
    proxy: ProxyArgs,
}

#[derive(Debug, clap::Args)]
struct InjectArgs {
    /// Input file, or `-` for standard input.
    #[arg(short = 'f', long = "filename")]
    file: String,
    /// Sidecar mode, over --config; a pod's own annotation still wins.
    #[arg(long)]
    mode: Option<SidecarMode>,
    /// A SidecarLifecycle (YAML) to apply over the defaults.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Whether the target cluster runs native sidecars (decides Auto).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    native_sidecars: bool,
    #[command(flatten)]
    proxy: ProxyArgs,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Crds => match remora_crds::crd_yaml() {
            Ok(y) => {
                print!("{y}");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Inject(args) => match inject(args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Serve(args) => {
            init_tracing(&args.log_level);
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the runtime: {e}");
                    return std::process::ExitCode::FAILURE;
                }
            };
            match rt.block_on(serve(*args)) {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = format!("{e:#}"), "remora-injector failed");
                    std::process::ExitCode::FAILURE
                }
            }
        }
    }
}

fn init_tracing(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn inject(args: InjectArgs) -> anyhow::Result<()> {
    let input = if args.file == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input")?;
        s
    } else {
        std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file))?
    };
    let lifecycle = match &args.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Some(parse_lifecycle(&text)?)
        }
        None => None,
    };
    let opts = OfflineOptions {
        chart: args.proxy.chart(SidecarMode::Auto),
        lifecycle,
        mode: args.mode,
        native_sidecars: args.native_sidecars,
    };
    let (out, report) = inject_stream(&input, &opts)?;
    for w in &report.warnings {
        eprintln!("warning: {w}");
    }
    std::io::stdout()
        .lock()
        .write_all(out.as_bytes())
        .context("writing the output")?;
    Ok(())
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let (cert_path, key_path) = if args.self_signed {
        let bundle = remora_injector::ca::ensure_secret(
            &client,
            &args.operator_namespace,
            &args.tls_secret,
            &args.service_name,
        )
        .await?;
        tokio::spawn(remora_injector::ca::keep_ca_bundle(
            client.clone(),
            args.webhook_config.clone(),
            bundle.ca_pem.clone(),
            Duration::from_secs(60),
        ));
        remora_injector::ca::write_files(&args.self_signed_dir, &bundle)?
    } else {
        (args.tls_cert.clone(), args.tls_key.clone())
    };
    let cert = ReloadingCert::load(cert_path, key_path)?;
    let _reloader = cert.spawn_reloader(args.cert_reload_interval);
    let tls = Arc::new(cert.server_config()?);
    let status_period = (!args.status_interval.is_zero()).then_some(args.status_interval);
    let jobs_shutdown = tokio_util::sync::CancellationToken::new();
    let jobs = args.stop_completed_jobs.then(|| {
        tokio::spawn(remora_injector::jobs::run(
            client.clone(),
            jobs_shutdown.clone(),
        ))
    });
    let view = remora_injector::cluster::start(
        client,
        args.proxy.chart(args.default_mode),
        &args.operator_namespace,
        args.sync_timeout,
        status_period,
    )
    .await?;
    let state = Arc::new(AppState {
        injector: Injector {
            chart: args.proxy.chart(args.default_mode),
            operator_namespace: args.operator_namespace.clone(),
            view: Arc::new(view),
        },
        metrics: Metrics::new(),
        max_body_bytes: args.max_request_bytes,
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    tracing::info!(listen = %args.listen, "remora-injector serving");
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let shutdown = async move {
        tokio::select! {
            () = shutdown => {},
            _ = term.recv() => {},
        }
    };
    let served = serve_tls(listener, tls, router(state), shutdown).await;
    jobs_shutdown.cancel();
    if let Some(j) = jobs
        // Reconciles in flight finish; bounded so that exit never waits long.
        && let Ok(Ok(Err(e))) = tokio::time::timeout(Duration::from_secs(5), j).await
    {
        tracing::warn!(error = %e, "sidecar-stop controller failed");
    }
    served?;
    Ok(())
}
