//! Logging: `tracing` with JSON (or text) output and a level that can be
//! changed at runtime through the admin port.

use std::sync::Arc;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::reload;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::LogFormat;

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid log filter {filter:?}: {reason}")]
    Filter { filter: String, reason: String },
    #[error("cannot change the log level: {0}")]
    Reload(String),
}

/// Changes the active log filter.
#[derive(Clone)]
pub struct LogLevelHandle {
    set: Arc<dyn Fn(EnvFilter) -> Result<(), String> + Send + Sync>,
}

impl std::fmt::Debug for LogLevelHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LogLevelHandle")
    }
}

impl LogLevelHandle {
    pub fn set(&self, filter: &str) -> Result<(), TelemetryError> {
        let f = parse_filter(filter)?;
        (self.set)(f).map_err(TelemetryError::Reload)
    }
}

fn parse_filter(filter: &str) -> Result<EnvFilter, TelemetryError> {
    EnvFilter::try_new(filter).map_err(|e| TelemetryError::Filter {
        filter: filter.to_string(),
        reason: e.to_string(),
    })
}

/// Install the global subscriber (logs go to stderr, Envoy's to its own).
pub fn init(filter: &str, format: LogFormat) -> Result<LogLevelHandle, TelemetryError> {
    let (layer, handle) = reload::Layer::new(parse_filter(filter)?);
    let registry = tracing_subscriber::registry().with(layer);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    // `try_init` fails only when a subscriber is already set (tests): keep that one.
    let _ = match format {
        LogFormat::Json => registry
            .with(fmt.json().flatten_event(true).with_current_span(false))
            .try_init(),
        LogFormat::Text => registry.with(fmt).try_init(),
    };
    Ok(LogLevelHandle {
        set: Arc::new(move |f| handle.reload(f).map_err(|e| e.to_string())),
    })
}
