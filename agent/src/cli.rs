//! The helper subcommands: `wait` (postStart) and `drain` (preStop).

use std::time::Duration;

use tokio::time::Instant;

use crate::config::{DrainConfig, WaitConfig};
use crate::http_client::HttpClient;

/// Ask the readiness URL until it answers 200 (the agent holds each check
/// until it is ready, see [`crate::servers::HOLD_READY_PATH`]). Returns the
/// process status.
pub async fn wait(cfg: &WaitConfig) -> i32 {
    let client = HttpClient::new(cfg.check_timeout());
    let start = Instant::now();
    let deadline = start + cfg.timeout;
    let mut last: String;
    loop {
        // No check is held past the deadline.
        let hold = cfg
            .hold
            .min(deadline.saturating_duration_since(Instant::now()));
        match client.get(&cfg.url(hold)).await {
            Ok(r) if r.status == 200 => {
                eprintln!("remora-agent wait: ready after {:?}", start.elapsed());
                return 0;
            }
            Ok(r) => last = format!("{} {}", r.status, r.body.trim()),
            Err(e) => last = e.to_string(),
        }
        let next = Instant::now() + cfg.period;
        if next >= deadline {
            eprintln!(
                "remora-agent wait: not ready after {:?}; last answer: {last}",
                cfg.timeout
            );
            return 1;
        }
        tokio::time::sleep_until(next).await;
    }
}

/// Ask the agent to drain and wait for its report. Returns the process status.
/// The agent's admin token is read from its run dir: this helper runs in the
/// sidecar's container, as its user.
pub async fn drain(cfg: &DrainConfig) -> i32 {
    let token_file = cfg.run_dir.join(remora_contract::pod::ADMIN_TOKEN_FILE);
    let token = match std::fs::read_to_string(&token_file) {
        Ok(t) => t.trim().to_string(),
        Err(e) => {
            eprintln!(
                "remora-agent drain: cannot read the admin token {}: {e}",
                token_file.display()
            );
            return 1;
        }
    };
    let client = HttpClient::new(Duration::from_secs(1));
    let url = format!("{}/drain", cfg.admin_url().trim_end_matches('/'));
    match client.post_authorized(&url, &token, cfg.timeout).await {
        Ok(r) if r.status == 200 => {
            println!("{}", r.body.trim());
            0
        }
        Ok(r) => {
            eprintln!("remora-agent drain: {} {}", r.status, r.body.trim());
            1
        }
        Err(e) => {
            eprintln!("remora-agent drain: {e}");
            1
        }
    }
}
