//! The enums both sides name: the sidecar mode and Envoy's log level.

use serde::{Deserialize, Serialize};

/// How the sidecar is injected (`spec.mode`, `remora.dev/sidecar-mode`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SidecarMode {
    /// Native where the cluster supports it, else Legacy.
    #[default]
    Auto,
    /// The sidecar is the first regular container.
    Legacy,
    /// The sidecar is an init container with `restartPolicy: Always`.
    Native,
}

impl SidecarMode {
    pub const ALL: [Self; 3] = [Self::Auto, Self::Legacy, Self::Native];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "Auto",
            Self::Legacy => "Legacy",
            Self::Native => "Native",
        }
    }
}

impl std::fmt::Display for SidecarMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SidecarMode {
    type Err = String;
    /// Case-insensitive, surrounding whitespace ignored.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        Self::ALL
            .into_iter()
            .find(|m| m.as_str().eq_ignore_ascii_case(t))
            .ok_or_else(|| format!("{:?} is not a mode (Auto, Legacy, Native)", short(t)))
    }
}

/// How a drain ends (`spec.shutdown.drainMode`, `remora.dev/drain-mode`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DrainMode {
    /// End when the pod has stopped being used: no new connection or request
    /// (inbound or outbound) for the quiet period and none in flight, bounded
    /// by the drain deadline. Follows the load balancer's real lag instead of
    /// guessing it.
    #[default]
    Adaptive,
    /// End after `terminationDrainDuration`, or with
    /// `exitOnZeroActiveConnections` when no connection is left (Istio's model).
    Fixed,
}

impl DrainMode {
    pub const ALL: [Self; 2] = [Self::Adaptive, Self::Fixed];

    /// The mode one layer of settings (flags, a `SidecarLifecycle`, the
    /// pod's annotations) asks for: its own, or [`Self::Fixed`] when it sets
    /// one of the fixed drain's own settings and no mode: a termination
    /// drain duration, or exit-on-zero-active-connections on. Only a fixed
    /// drain reads them, so setting one alone means wanting it: Istio's
    /// `terminationDrainDuration: 0s` and `EXIT_ON_ZERO_ACTIVE_CONNECTIONS`
    /// are honoured as given, not turned into the adaptive quiet period.
    pub fn asked(
        mode: Option<Self>,
        sets_termination_drain_duration: bool,
        exit_on_zero_active_connections: Option<bool>,
    ) -> Option<Self> {
        let sets_fixed =
            sets_termination_drain_duration || exit_on_zero_active_connections == Some(true);
        mode.or(sets_fixed.then_some(Self::Fixed))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Adaptive => "Adaptive",
            Self::Fixed => "Fixed",
        }
    }
}

impl std::fmt::Display for DrainMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DrainMode {
    type Err = String;
    /// Case-insensitive, surrounding whitespace ignored.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        Self::ALL
            .into_iter()
            .find(|m| m.as_str().eq_ignore_ascii_case(t))
            .ok_or_else(|| format!("{:?} is not a drain mode (Adaptive, Fixed)", short(t)))
    }
}

/// Envoy's log level (`spec.proxy.logLevel`, `remora.dev/log-level`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warning,
    Error,
    Critical,
    Off,
}

impl LogLevel {
    pub const ALL: [Self; 7] = [
        Self::Trace,
        Self::Debug,
        Self::Info,
        Self::Warning,
        Self::Error,
        Self::Critical,
        Self::Off,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Trace => "trace",
            Self::Debug => "debug",
            Self::Info => "info",
            Self::Warning => "warning",
            Self::Error => "error",
            Self::Critical => "critical",
            Self::Off => "off",
        }
    }
}

impl std::fmt::Display for LogLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LogLevel {
    type Err = String;
    /// Exact lowercase names, as Envoy's `--log-level` takes them; surrounding
    /// whitespace ignored.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        Self::ALL
            .into_iter()
            .find(|l| l.as_str() == t)
            .ok_or_else(|| {
                format!(
                    "{:?} is not a log level (trace, debug, info, warning, error, critical, off)",
                    short(t)
                )
            })
    }
}

/// Input echoed in an error, cut to a readable length.
pub(crate) fn short(s: &str) -> String {
    s.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_serde_and_from_str() {
        for m in SidecarMode::ALL {
            assert_eq!(serde_json::to_value(m).ok(), Some(m.as_str().into()));
            assert_eq!(m.as_str().to_lowercase().parse::<SidecarMode>(), Ok(m));
        }
        for l in LogLevel::ALL {
            assert_eq!(serde_json::to_value(l).ok(), Some(l.as_str().into()));
            assert_eq!(l.as_str().parse::<LogLevel>(), Ok(l));
        }
        for m in DrainMode::ALL {
            assert_eq!(serde_json::to_value(m).ok(), Some(m.as_str().into()));
            assert_eq!(m.as_str().to_uppercase().parse::<DrainMode>(), Ok(m));
        }
        assert!("gradual".parse::<DrainMode>().is_err());
        assert!("loud".parse::<LogLevel>().is_err());
        assert!("Sidecar".parse::<SidecarMode>().is_err());
    }
}
