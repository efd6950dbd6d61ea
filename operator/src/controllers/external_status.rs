//! The status of ExternalServices, on the leader: what the discovery
//! registry makes of each (Accepted: its hosts are its own; Resolved: it
//! has endpoints), written by server-side apply whenever a pushed batch
//! changes it, and only then.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Resource};
use remora_crds::external::{ExternalService, ExternalServiceStatus, condition};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::cluster::watch::SharedWatch;
use crate::discovery::external::{ExternalState, Refusal};
use crate::discovery::push::Discovery;
use crate::identity::FIELD_MANAGER;

/// How soon a failed write is tried again when nothing else changes.
const RETRY: Duration = Duration::from_secs(10);

/// The status `state` says, keeping the transition times of `previous`
/// for conditions whose status did not change. Pure.
pub fn status(
    state: &ExternalState,
    previous: Option<&ExternalServiceStatus>,
    now: &Time,
) -> ExternalServiceStatus {
    let generation = state.generation.unwrap_or_default();
    let cond = |type_: &str, ok: bool, reason: &str, message: String| Condition {
        type_: type_.into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.into(),
        message,
        observed_generation: Some(generation),
        last_transition_time: previous
            .into_iter()
            .flat_map(|p| &p.conditions)
            .find(|c| c.type_ == type_ && c.status == if ok { "True" } else { "False" })
            .map_or_else(|| now.clone(), |c| c.last_transition_time.clone()),
    };
    let accepted = match state.refusals.as_slice() {
        [] => cond(
            condition::ACCEPTED,
            true,
            condition::REASON_ACCEPTED,
            "every host is served from it".into(),
        ),
        refusals => {
            let not_owned = refusals.iter().any(|r| matches!(r, Refusal::NotOwned(_)));
            let why: Vec<String> = refusals
                .iter()
                .map(|r| match r {
                    Refusal::NotOwned(h) => format!(
                        "{h} names a Service of namespace {}: only that namespace or the operator's may claim it",
                        remora_crds::external::host_owner(h).unwrap_or_default()
                    ),
                    Refusal::Conflict { host, holder } => {
                        format!("{host} is held by the older {}/{}", holder.0, holder.1)
                    }
                })
                .collect();
            let reason = if not_owned {
                condition::HOST_NOT_OWNED
            } else {
                condition::HOST_CONFLICT
            };
            cond(condition::ACCEPTED, false, reason, why.join("; "))
        }
    };
    let resolved = if state.endpoints > 0 {
        cond(
            condition::RESOLVED,
            true,
            condition::ENDPOINTS_FOUND,
            format!("{} endpoints over its ports", state.endpoints),
        )
    } else {
        cond(
            condition::RESOLVED,
            false,
            condition::NO_ENDPOINTS,
            "no endpoint: no address listed, or no ExternalWorkload of its namespace selected"
                .into(),
        )
    };
    ExternalServiceStatus {
        observed_generation: Some(generation),
        endpoints: Some(i32::try_from(state.endpoints).unwrap_or(i32::MAX)),
        conditions: vec![accepted, resolved],
    }
}

/// Keep every ExternalService's status as the registry says until `token`.
pub async fn run(
    client: Client,
    discovery: Arc<Discovery>,
    services: SharedWatch<ExternalService>,
    token: CancellationToken,
) {
    services.listed().await;
    let mut batches = discovery.batches();
    loop {
        let failed = write_changed(&client, &discovery, &services).await;
        let wait = if failed { RETRY } else { Duration::MAX };
        tokio::select! {
            () = token.cancelled() => return,
            changed = tokio::time::timeout(wait, batches.changed()) => {
                if let Ok(Err(_)) = changed {
                    // The discovery state is gone: shutting down.
                    return token.cancelled().await;
                }
            }
        }
    }
}

/// Write each status that differs from the stored one; true if a write failed.
async fn write_changed(
    client: &Client,
    discovery: &Discovery,
    services: &SharedWatch<ExternalService>,
) -> bool {
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let mut failed = false;
    for es in services.store().state() {
        let (Some(ns), Some(name)) = (es.metadata.namespace.clone(), es.metadata.name.clone())
        else {
            continue;
        };
        let key = (ns.clone(), name.clone());
        let Some(state) = discovery.read(|r| r.externals().state(&key)) else {
            continue;
        };
        let want = status(&state, es.status.as_ref(), &now);
        if es.status.as_ref() == Some(&want) {
            continue;
        }
        let patch = Patch::Apply(json!({
            "apiVersion": ExternalService::api_version(&()),
            "kind": ExternalService::kind(&()),
            "status": want,
        }));
        let api: Api<ExternalService> = Api::namespaced(client.clone(), &ns);
        if let Err(e) = api
            .patch_status(&name, &PatchParams::apply(FIELD_MANAGER).force(), &patch)
            .await
        {
            tracing::warn!(externalservice = %format_args!("{ns}/{name}"), error = %e, "cannot write the status");
            failed = true;
        }
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).expect("time"))
    }

    #[test]
    fn conditions_say_why_and_keep_their_transition_times() {
        let ok = ExternalState {
            generation: Some(3),
            refusals: vec![],
            endpoints: 2,
        };
        let s = status(&ok, None, &t(10));
        assert_eq!(s.observed_generation, Some(3));
        assert_eq!(s.endpoints, Some(2));
        let c: Vec<(&str, &str, &str)> = s
            .conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.status.as_str(), c.reason.as_str()))
            .collect();
        assert_eq!(
            c,
            [
                ("Accepted", "True", "Accepted"),
                ("Resolved", "True", "EndpointsFound")
            ]
        );
        // Unchanged later: the same status, times included (no write).
        assert_eq!(status(&ok, Some(&s), &t(20)), s);

        let refused = ExternalState {
            generation: Some(4),
            refusals: vec![Refusal::NotOwned("cart.shop".into())],
            endpoints: 0,
        };
        let r = status(&refused, Some(&s), &t(30));
        let accepted = &r.conditions[0];
        assert_eq!(
            (accepted.status.as_str(), accepted.reason.as_str()),
            ("False", "HostNotOwned")
        );
        assert!(
            accepted.message.contains("namespace shop"),
            "{}",
            accepted.message
        );
        assert_eq!(accepted.last_transition_time, t(30));
        assert_eq!(r.conditions[1].reason, "NoEndpoints");
        let conflict = ExternalState {
            refusals: vec![Refusal::Conflict {
                host: "api.example.com".into(),
                holder: ("a".into(), "early".into()),
            }],
            ..refused
        };
        let c = status(&conflict, Some(&r), &t(40));
        assert_eq!(c.conditions[0].reason, "HostConflict");
        assert!(c.conditions[0].message.contains("a/early"));
        // Still False: the transition time stays.
        assert_eq!(c.conditions[0].last_transition_time, t(30));
    }
}
