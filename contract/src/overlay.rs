//! The per-field overlay of lifecycle settings, read from a pod's
//! annotations. The operator's effective config and the agent's live drain
//! settings both apply an [`Overlay`] built here, through
//! [`Overlay::apply_drain`], so a value means the same on both sides: what
//! one refuses, the other refuses with the same words.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::lifecycle::LifecycleAnnotation;
use crate::{DrainMode, LogLevel, SidecarMode, annotations, duration, value};

/// Settings a pod's annotations override; `None` keeps the weaker layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overlay {
    pub mode: Option<SidecarMode>,
    pub hold_application_until_proxy_starts: Option<bool>,
    pub startup_timeout: Option<Duration>,
    pub drain_duration: Option<Duration>,
    pub termination_drain_duration: Option<Duration>,
    pub exit_on_zero_active_connections: Option<bool>,
    pub minimum_drain_duration: Option<Duration>,
    pub drain_mode: Option<DrainMode>,
    pub quiet_period: Option<Duration>,
    pub withdrawal_timeout: Option<Duration>,
    /// Only in `remora.dev/lifecycle`: the operator derives it.
    pub drain_deadline: Option<Duration>,
    pub concurrency: Option<u32>,
    pub log_level: Option<LogLevel>,
}

/// The drain settings a running sidecar takes live, borrowed from whichever
/// struct holds them (the operator's effective config, the agent's drain
/// settings), so that both sides apply an overlay with one function.
#[derive(Debug)]
pub struct DrainFields<'a> {
    pub drain_duration: &'a mut Duration,
    pub termination_drain_duration: &'a mut Duration,
    pub exit_on_zero_active_connections: &'a mut bool,
    pub minimum_drain_duration: &'a mut Duration,
    pub drain_mode: &'a mut DrainMode,
    pub quiet_period: &'a mut Duration,
    pub withdrawal_timeout: &'a mut Duration,
    /// `None` for the operator: it derives the deadline from the pod's
    /// grace period.
    pub drain_deadline: Option<&'a mut Duration>,
}

/// A value that was refused, and where it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct Problem {
    /// The annotation key, or `remora.dev/lifecycle` and the JSON field.
    pub field: String,
    pub reason: String,
}

impl Overlay {
    /// The per-field keys `remora.dev/<kebab-case-field>`. A bad value is
    /// reported and skipped; the others still apply.
    pub fn from_annotations(ann: &BTreeMap<String, String>) -> (Self, Vec<Problem>) {
        let mut problems = Vec::new();
        let read = |key: &str| ann.get(key).map(|raw| (key.to_string(), raw.as_str()));
        let mut o = Self::default();
        macro_rules! field {
            ($slot:expr, $key:expr, $parse:expr) => {
                if let Some((field, raw)) = read($key) {
                    match $parse(raw) {
                        Ok(v) => $slot = Some(v),
                        Err(e) => problems.push(Problem {
                            field,
                            reason: e.to_string(),
                        }),
                    }
                }
            };
        }
        field!(o.mode, annotations::MODE, str::parse::<SidecarMode>);
        field!(
            o.hold_application_until_proxy_starts,
            annotations::HOLD_APPLICATION_UNTIL_PROXY_STARTS,
            value::parse_bool
        );
        field!(
            o.startup_timeout,
            annotations::STARTUP_TIMEOUT,
            duration::parse
        );
        field!(
            o.drain_duration,
            annotations::DRAIN_DURATION,
            duration::parse
        );
        field!(
            o.termination_drain_duration,
            annotations::TERMINATION_DRAIN_DURATION,
            duration::parse
        );
        field!(
            o.exit_on_zero_active_connections,
            annotations::EXIT_ON_ZERO_ACTIVE_CONNECTIONS,
            value::parse_bool
        );
        field!(
            o.minimum_drain_duration,
            annotations::MINIMUM_DRAIN_DURATION,
            duration::parse
        );
        field!(
            o.drain_mode,
            annotations::DRAIN_MODE,
            str::parse::<DrainMode>
        );
        field!(o.quiet_period, annotations::QUIET_PERIOD, duration::parse);
        field!(
            o.withdrawal_timeout,
            annotations::WITHDRAWAL_TIMEOUT,
            duration::parse
        );
        field!(
            o.concurrency,
            annotations::CONCURRENCY,
            value::parse_concurrency
        );
        field!(o.log_level, annotations::LOG_LEVEL, str::parse::<LogLevel>);
        o.drain_mode = DrainMode::asked(
            o.drain_mode,
            o.termination_drain_duration.is_some(),
            o.exit_on_zero_active_connections,
        );
        (o, problems)
    }

    /// The lifecycle the operator wrote (`remora.dev/lifecycle`).
    pub fn from_lifecycle(l: &LifecycleAnnotation) -> (Self, Vec<Problem>) {
        let mut problems = Vec::new();
        let mut dur = |name: &str, v: &Option<String>| {
            let raw = v.as_deref()?;
            duration::parse(raw)
                .map_err(|e| {
                    problems.push(Problem {
                        field: format!("{} {name}", annotations::LIFECYCLE),
                        reason: e.to_string(),
                    })
                })
                .ok()
        };
        let mut o = Self::default();
        if let Some(s) = &l.startup {
            o.hold_application_until_proxy_starts = s.hold_application_until_proxy_starts;
            o.startup_timeout = dur("startup.timeout", &s.timeout);
        }
        if let Some(s) = &l.shutdown {
            o.drain_duration = dur("shutdown.drainDuration", &s.drain_duration);
            o.termination_drain_duration = dur(
                "shutdown.terminationDrainDuration",
                &s.termination_drain_duration,
            );
            o.exit_on_zero_active_connections = s.exit_on_zero_active_connections;
            o.minimum_drain_duration =
                dur("shutdown.minimumDrainDuration", &s.minimum_drain_duration);
            o.drain_mode = DrainMode::asked(
                s.drain_mode,
                o.termination_drain_duration.is_some(),
                o.exit_on_zero_active_connections,
            );
            o.quiet_period = dur("shutdown.quietPeriod", &s.quiet_period);
            o.withdrawal_timeout = dur("shutdown.withdrawalTimeout", &s.withdrawal_timeout);
        }
        o.drain_deadline = dur("drainDeadline", &l.drain_deadline);
        (o, problems)
    }

    /// What a running sidecar reads: `remora.dev/lifecycle`, then the
    /// per-field keys over it.
    pub fn from_pod_annotations(ann: &BTreeMap<String, String>) -> (Self, Vec<Problem>) {
        let (mut o, mut problems) = match ann.get(annotations::LIFECYCLE) {
            None => (Self::default(), Vec::new()),
            Some(raw) => match serde_json::from_str::<LifecycleAnnotation>(raw) {
                Ok(l) => Self::from_lifecycle(&l),
                Err(e) => (
                    Self::default(),
                    vec![Problem {
                        field: annotations::LIFECYCLE.to_string(),
                        reason: e.to_string(),
                    }],
                ),
            },
        };
        let (fields, more) = Self::from_annotations(ann);
        o = o.then(fields);
        problems.extend(more);
        (o, problems)
    }

    /// Set each drain field this overlay carries; the others keep theirs.
    pub fn apply_drain(&self, to: DrainFields<'_>) {
        fn set<T: Copy>(slot: &mut T, v: Option<T>) {
            if let Some(v) = v {
                *slot = v;
            }
        }
        set(to.drain_duration, self.drain_duration);
        set(
            to.termination_drain_duration,
            self.termination_drain_duration,
        );
        set(
            to.exit_on_zero_active_connections,
            self.exit_on_zero_active_connections,
        );
        set(to.minimum_drain_duration, self.minimum_drain_duration);
        set(to.drain_mode, self.drain_mode);
        set(to.quiet_period, self.quiet_period);
        set(to.withdrawal_timeout, self.withdrawal_timeout);
        if let Some(slot) = to.drain_deadline {
            set(slot, self.drain_deadline);
        }
    }

    /// `stronger` over `self`, field by field.
    pub fn then(self, stronger: Self) -> Self {
        Self {
            mode: stronger.mode.or(self.mode),
            hold_application_until_proxy_starts: stronger
                .hold_application_until_proxy_starts
                .or(self.hold_application_until_proxy_starts),
            startup_timeout: stronger.startup_timeout.or(self.startup_timeout),
            drain_duration: stronger.drain_duration.or(self.drain_duration),
            termination_drain_duration: stronger
                .termination_drain_duration
                .or(self.termination_drain_duration),
            exit_on_zero_active_connections: stronger
                .exit_on_zero_active_connections
                .or(self.exit_on_zero_active_connections),
            minimum_drain_duration: stronger
                .minimum_drain_duration
                .or(self.minimum_drain_duration),
            drain_mode: stronger.drain_mode.or(self.drain_mode),
            quiet_period: stronger.quiet_period.or(self.quiet_period),
            withdrawal_timeout: stronger.withdrawal_timeout.or(self.withdrawal_timeout),
            drain_deadline: stronger.drain_deadline.or(self.drain_deadline),
            concurrency: stronger.concurrency.or(self.concurrency),
            log_level: stronger.log_level.or(self.log_level),
        }
    }
}

/// How long the discovery server waits for the proxies that routed to a
/// withdrawn pod (confirmed removal), read from the pod's annotations as
/// its agent reads them ([`Overlay::from_pod_annotations`]): the built-in
/// default when they do not say (a bad value is the agent's to report), and
/// never past the drain deadline they state, as the agent's wait never is.
pub fn withdrawal_timeout(ann: &BTreeMap<String, String>) -> Duration {
    let (o, _) = Overlay::from_pod_annotations(ann);
    // The contract's own test parses every default.
    let bound = o.withdrawal_timeout.unwrap_or_else(|| {
        duration::parse(crate::defaults::WITHDRAWAL_TIMEOUT).unwrap_or_default()
    });
    o.drain_deadline.map_or(bound, |d| bound.min(d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use remora_test_support::maps::string_map as ann;

    #[test]
    fn every_per_field_key_is_read() {
        let a = ann(&[
            (annotations::MODE, "native"),
            (annotations::HOLD_APPLICATION_UNTIL_PROXY_STARTS, "false"),
            (annotations::STARTUP_TIMEOUT, "2m"),
            (annotations::DRAIN_DURATION, "30s"),
            (annotations::TERMINATION_DRAIN_DURATION, "7s"),
            (annotations::EXIT_ON_ZERO_ACTIVE_CONNECTIONS, "true"),
            (annotations::MINIMUM_DRAIN_DURATION, "1s"),
            (annotations::DRAIN_MODE, "fixed"),
            (annotations::QUIET_PERIOD, "500ms"),
            (annotations::WITHDRAWAL_TIMEOUT, "2s"),
            (annotations::CONCURRENCY, "4"),
            (annotations::LOG_LEVEL, "debug"),
        ]);
        assert_eq!(a.len(), annotations::PER_FIELD.len());
        let (o, problems) = Overlay::from_annotations(&a);
        assert!(problems.is_empty(), "{problems:?}");
        let s = Duration::from_secs;
        assert_eq!(
            o,
            Overlay {
                mode: Some(SidecarMode::Native),
                hold_application_until_proxy_starts: Some(false),
                startup_timeout: Some(s(120)),
                drain_duration: Some(s(30)),
                termination_drain_duration: Some(s(7)),
                exit_on_zero_active_connections: Some(true),
                minimum_drain_duration: Some(s(1)),
                drain_mode: Some(DrainMode::Fixed),
                quiet_period: Some(Duration::from_millis(500)),
                withdrawal_timeout: Some(s(2)),
                drain_deadline: None,
                concurrency: Some(4),
                log_level: Some(LogLevel::Debug),
            }
        );
    }

    /// A termination drain duration alone asks for a fixed drain, in the
    /// per-field keys and in `remora.dev/lifecycle`; a mode given beside it wins.
    #[test]
    fn a_termination_drain_duration_alone_asks_for_a_fixed_drain() {
        let alone = ann(&[(annotations::TERMINATION_DRAIN_DURATION, "0s")]);
        assert_eq!(
            Overlay::from_annotations(&alone).0.drain_mode,
            Some(DrainMode::Fixed)
        );
        let both = ann(&[
            (annotations::TERMINATION_DRAIN_DURATION, "0s"),
            (annotations::DRAIN_MODE, "adaptive"),
        ]);
        assert_eq!(
            Overlay::from_annotations(&both).0.drain_mode,
            Some(DrainMode::Adaptive)
        );
        let json = ann(&[(
            annotations::LIFECYCLE,
            r#"{"shutdown":{"terminationDrainDuration":"0s"}}"#,
        )]);
        assert_eq!(
            Overlay::from_pod_annotations(&json).0.drain_mode,
            Some(DrainMode::Fixed)
        );
        let quiet = ann(&[(annotations::QUIET_PERIOD, "1s")]);
        assert_eq!(Overlay::from_annotations(&quiet).0.drain_mode, None);
        // Exit-on-zero on is the fixed drain's setting too; off asks for nothing.
        for (value, mode) in [("true", Some(DrainMode::Fixed)), ("false", None)] {
            let eoz = ann(&[(annotations::EXIT_ON_ZERO_ACTIVE_CONNECTIONS, value)]);
            assert_eq!(
                Overlay::from_annotations(&eoz).0.drain_mode,
                mode,
                "{value}"
            );
            let json = ann(&[(
                annotations::LIFECYCLE,
                &format!(r#"{{"shutdown":{{"exitOnZeroActiveConnections":{value}}}}}"#),
            )]);
            assert_eq!(
                Overlay::from_pod_annotations(&json).0.drain_mode,
                mode,
                "{value}"
            );
        }
    }

    #[test]
    fn bad_values_are_named_and_skipped() {
        let a = ann(&[
            (annotations::DRAIN_DURATION, "30"),
            (annotations::TERMINATION_DRAIN_DURATION, "9999h"),
            (annotations::CONCURRENCY, "100000"),
            (annotations::MINIMUM_DRAIN_DURATION, "2s"),
        ]);
        let (o, problems) = Overlay::from_annotations(&a);
        assert_eq!(o.minimum_drain_duration, Some(Duration::from_secs(2)));
        assert_eq!(o.drain_duration, None);
        let text: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert_eq!(text.len(), 3, "{text:?}");
        assert!(text[0].starts_with(annotations::DRAIN_DURATION) && text[0].contains("30s"));
        assert!(text[1].contains("24h"), "names the bound: {}", text[1]);
    }

    #[test]
    fn per_field_keys_win_over_the_json() {
        let a = ann(&[
            (
                annotations::LIFECYCLE,
                r#"{"shutdown":{"terminationDrainDuration":"2s","minimumDrainDuration":"1s"},"drainDeadline":"50s"}"#,
            ),
            (annotations::MINIMUM_DRAIN_DURATION, "3s"),
        ]);
        let (o, problems) = Overlay::from_pod_annotations(&a);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(o.termination_drain_duration, Some(Duration::from_secs(2)));
        assert_eq!(o.minimum_drain_duration, Some(Duration::from_secs(3)));
        assert_eq!(o.drain_deadline, Some(Duration::from_secs(50)));
    }

    #[test]
    fn apply_drain_sets_what_the_overlay_carries() {
        let s = Duration::from_secs;
        let (mut drain, mut termination, mut exit, mut minimum) = (s(45), s(5), false, s(5));
        let (mut mode, mut quiet, mut deadline) = (DrainMode::Adaptive, s(3), s(25));
        let mut withdrawal = s(5);
        let o = Overlay {
            termination_drain_duration: Some(s(7)),
            exit_on_zero_active_connections: Some(true),
            drain_mode: Some(DrainMode::Fixed),
            drain_deadline: Some(s(50)),
            withdrawal_timeout: Some(s(1)),
            // Not a drain setting: untouched.
            startup_timeout: Some(s(1)),
            ..Overlay::default()
        };
        o.apply_drain(DrainFields {
            drain_duration: &mut drain,
            termination_drain_duration: &mut termination,
            exit_on_zero_active_connections: &mut exit,
            minimum_drain_duration: &mut minimum,
            drain_mode: &mut mode,
            quiet_period: &mut quiet,
            withdrawal_timeout: &mut withdrawal,
            drain_deadline: Some(&mut deadline),
        });
        assert_eq!(
            (drain, termination, exit, minimum, mode, quiet, deadline),
            (s(45), s(7), true, s(5), DrainMode::Fixed, s(3), s(50))
        );
        assert_eq!(withdrawal, s(1));
    }

    #[test]
    fn a_huge_deadline_in_the_json_is_refused() {
        let a = ann(&[(
            annotations::LIFECYCLE,
            r#"{"drainDeadline":"2562047788015215h30m2s"}"#,
        )]);
        let (o, problems) = Overlay::from_pod_annotations(&a);
        assert_eq!(o.drain_deadline, None);
        assert!(
            problems[0].to_string().contains("drainDeadline"),
            "{problems:?}"
        );
    }

    #[test]
    fn the_servers_withdrawal_bound_is_the_agents_within_the_deadline() {
        let s = Duration::from_secs;
        assert_eq!(withdrawal_timeout(&ann(&[])), s(5), "the default");
        let json = |t: &str, d: &str| {
            format!(r#"{{"shutdown":{{"withdrawalTimeout":"{t}"}},"drainDeadline":"{d}"}}"#)
        };
        let both = ann(&[
            (annotations::LIFECYCLE, &json("8s", "25s")),
            (annotations::WITHDRAWAL_TIMEOUT, "2s"),
        ]);
        assert_eq!(withdrawal_timeout(&both), s(2), "the per-field key wins");
        let json_only = ann(&[(annotations::LIFECYCLE, &json("8s", "25s"))]);
        assert_eq!(withdrawal_timeout(&json_only), s(8));
        let past = ann(&[(annotations::LIFECYCLE, &json("40s", "25s"))]);
        assert_eq!(withdrawal_timeout(&past), s(25), "within the deadline");
        let bad = ann(&[(annotations::WITHDRAWAL_TIMEOUT, "soon")]);
        assert_eq!(
            withdrawal_timeout(&bad),
            s(5),
            "a bad value keeps the default"
        );
    }

    proptest! {
        #[test]
        fn no_value_panics_and_every_accepted_duration_is_bounded(
            key in proptest::sample::select(annotations::PER_FIELD.to_vec()),
            raw in any::<String>(),
            json in any::<String>(),
        ) {
            let a = ann(&[(key, raw.as_str()), (annotations::LIFECYCLE, json.as_str())]);
            let (o, _) = Overlay::from_pod_annotations(&a);
            for d in [o.startup_timeout, o.drain_duration, o.termination_drain_duration,
                      o.minimum_drain_duration, o.drain_deadline,
                      o.withdrawal_timeout].into_iter().flatten() {
                prop_assert!(d <= duration::MAX);
            }
        }
    }
}
