//! remora-operator: `serve` (webhook), `inject` (offline), `crds`.

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use remora_crds::SidecarMode;
use remora_inject::offline::{OfflineOptions, inject_stream, parse_lifecycle};
use remora_operator::flags::{ProxyArgs, ServeArgs};

// The webhook allocates and frees many small JSON values per request.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "remora-operator",
    version,
    about = "Remora's operator: the sidecar injection webhook, the controllers and the CAs"
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
    // Freed review bodies go back to the OS at once, not a second later.
    remora_operator::alloc::purge_freed_memory_at_once();
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
            if let Err(e) = args.check() {
                // Like clap's own refusals: usage error, exit 2.
                use clap::CommandFactory;
                Cli::command()
                    .error(clap::error::ErrorKind::ArgumentConflict, e)
                    .exit();
            }
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
            let r = rt.block_on(remora_operator::app::serve(*args));
            // Whatever is still running (after a second signal, say) is
            // not waited for.
            rt.shutdown_background();
            match r {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %e, "remora-operator failed");
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
