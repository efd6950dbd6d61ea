//! The Events a status change calls for: pure, so every transition is
//! unit-tested.

use remora_crds::{SidecarLifecycleStatus, condition};

/// A decision worth an Event on the resource, from a change of condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// The Events a status change calls for: each condition that turned True
/// or False since `prev` (a first status reports where it starts).
pub fn decisions(
    prev: Option<&SidecarLifecycleStatus>,
    next: &SidecarLifecycleStatus,
) -> Vec<Decision> {
    let mut out = Vec::new();
    for c in &next.conditions {
        let before = prev
            .and_then(|p| p.conditions.iter().find(|p| p.type_ == c.type_))
            .map(|p| p.status.as_str());
        if before == Some(c.status.as_str()) {
            continue;
        }
        let now_true = c.status == "True";
        let (warning, reason) = match (c.type_.as_str(), now_true) {
            (condition::ACCEPTED, true) => (false, "Accepted"),
            (condition::ACCEPTED, false) => (true, "InvalidSpec"),
            (condition::CONFLICTED, true) => (true, "Conflicted"),
            (condition::CONFLICTED, false) if before.is_some() => (false, "ConflictResolved"),
            (condition::RESTART_REQUIRED, true) => (true, "RestartRequired"),
            (condition::RESTART_REQUIRED, false) if before.is_some() => (false, "PodsRestarted"),
            _ => continue,
        };
        out.push(Decision {
            warning,
            reason,
            note: c.message.clone(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    fn status(conds: &[(&str, &str)]) -> SidecarLifecycleStatus {
        SidecarLifecycleStatus {
            observed_generation: Some(1),
            matched_pods: Some(0),
            conditions: conds
                .iter()
                .map(|(t, s)| Condition {
                    type_: (*t).into(),
                    status: (*s).into(),
                    reason: "R".into(),
                    message: format!("{t} is {s}"),
                    observed_generation: Some(1),
                    last_transition_time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
                })
                .collect(),
        }
    }

    #[test]
    fn first_status_reports_acceptance_and_problems_only() {
        let next = status(&[
            ("Accepted", "True"),
            ("Conflicted", "False"),
            ("Applied", "True"),
            ("RestartRequired", "False"),
        ]);
        let d = decisions(None, &next);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].reason, "Accepted");
        assert!(!d[0].warning);
    }

    #[test]
    fn transitions_become_events_and_steady_state_none() {
        let before = status(&[
            ("Accepted", "True"),
            ("Conflicted", "False"),
            ("RestartRequired", "False"),
        ]);
        let after = status(&[
            ("Accepted", "True"),
            ("Conflicted", "True"),
            ("RestartRequired", "True"),
        ]);
        let d = decisions(Some(&before), &after);
        let reasons: Vec<_> = d.iter().map(|d| d.reason).collect();
        assert_eq!(reasons, ["Conflicted", "RestartRequired"]);
        assert!(d.iter().all(|d| d.warning));
        assert!(decisions(Some(&after), &after).is_empty());
        let back = decisions(Some(&after), &before);
        let reasons: Vec<_> = back.iter().map(|d| d.reason).collect();
        assert_eq!(reasons, ["ConflictResolved", "PodsRestarted"]);
    }

    #[test]
    fn an_invalid_spec_is_a_warning() {
        let d = decisions(None, &status(&[("Accepted", "False")]));
        assert_eq!(d[0].reason, "InvalidSpec");
        assert!(d[0].warning);
        assert_eq!(d[0].note, "Accepted is False");
    }
}
