//! Thin entry point: parse the command line, init telemetry, build, run.

use std::process::ExitCode;

use remora_agent::config::{Command, parse_cli};
use remora_agent::{app, cli, telemetry};

fn main() -> ExitCode {
    let cmd = match parse_cli() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("remora-agent: {e}");
            return ExitCode::from(2);
        }
    };
    // One thread: small, and Envoy's parent-death signal follows the thread
    // that spawned it, which must live as long as the agent.
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("remora-agent: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = match cmd {
        Command::Version => {
            println!("remora-agent {}", env!("CARGO_PKG_VERSION"));
            0
        }
        Command::Wait(w) => rt.block_on(cli::wait(&w)),
        Command::Drain(d) => rt.block_on(cli::drain(&d)),
        Command::Run(cfg) => {
            let log = match telemetry::init(&cfg.agent_log_level, cfg.log_format) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("remora-agent: --agent-log-level: {e}");
                    return ExitCode::from(2);
                }
            };
            rt.block_on(async move {
                match app::build(*cfg, log).await {
                    Ok(app) => match app.run().await {
                        Ok(reason) => {
                            tracing::info!(?reason, code = reason.code(), "remora-agent exiting");
                            reason.code()
                        }
                        Err(e) => {
                            eprintln!("remora-agent: {e}");
                            1
                        }
                    },
                    Err(e) => {
                        eprintln!("remora-agent: {e}");
                        1
                    }
                }
            })
        }
    };
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
