//! The kube-apiserver audit log as the operator's request log: a policy
//! that records the operator replicas' requests (and nobody else's) at the
//! Metadata level, and the reading of that log: requests per replica by
//! verb and resource, in a time window.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// An audit policy that logs every request of `users` at the Metadata
/// level once (when the response is complete, or, for a watch, when it
/// starts streaming) and nothing else: the log stays small at 10,000 pods.
pub fn policy(users: &[String]) -> String {
    serde_json::json!({
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": [
            {"level": "Metadata", "users": users},
            {"level": "None"},
        ],
    })
    .to_string()
}

/// The kube-apiserver flags that write `log` by `policy_file`.
pub fn apiserver_args(policy_file: &Path, log: &Path) -> Vec<String> {
    vec![
        format!("--audit-policy-file={}", policy_file.display()),
        format!("--audit-log-path={}", log.display()),
        // No rotation during a run (0 means lumberjack's 100 MB).
        "--audit-log-maxsize=100000".to_owned(),
        // Each event written before the response: nothing is lost or late.
        "--audit-log-mode=blocking".to_owned(),
    ]
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawEvent {
    #[serde(rename = "auditID")]
    audit_id: String,
    verb: String,
    user: RawUser,
    #[serde(default)]
    object_ref: Option<RawRef>,
    request_received_timestamp: String,
    #[serde(default)]
    response_status: Option<RawStatus>,
}

#[derive(Debug, Clone, Deserialize)]
struct RawUser {
    username: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawRef {
    #[serde(default)]
    resource: Option<String>,
    #[serde(default)]
    subresource: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
struct RawStatus {
    #[serde(default)]
    code: Option<u16>,
}

/// One request, as the API server received it.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub user: String,
    pub verb: String,
    /// `pods`, `sidecarlifecycles/status`, `leases`; the path for a
    /// non-resource request (empty).
    pub resource: String,
    pub received: Timestamp,
    pub code: Option<u16>,
}

impl Request {
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }

    pub fn is_lease(&self) -> bool {
        self.resource == "leases"
    }
}

/// Every request in the log `text`, once each (a watch is logged when it
/// starts and when it ends), in log order. Lines that are not audit
/// events (a line half-written at the moment of reading) are skipped.
pub fn parse(text: &str) -> Vec<Request> {
    let mut seen = HashSet::new();
    text.lines()
        .filter_map(|l| serde_json::from_str::<RawEvent>(l).ok())
        .filter(|e| seen.insert(e.audit_id.clone()))
        .filter_map(|e| {
            let received = e.request_received_timestamp.parse::<Timestamp>().ok()?;
            let r = e.object_ref.unwrap_or_default();
            let resource = match (r.resource, r.subresource) {
                (Some(res), Some(sub)) => format!("{res}/{sub}"),
                (Some(res), None) => res,
                (None, _) => String::new(),
            };
            Some(Request {
                user: e.user.username,
                verb: e.verb,
                resource,
                received,
                code: e.response_status.and_then(|s| s.code),
            })
        })
        .collect()
}

/// [`parse`] of the file at `path`.
pub fn read(path: &Path) -> Result<Vec<Request>, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        what: format!("reading {}", path.display()),
        source,
    })?;
    Ok(parse(&text))
}

/// One replica's requests received in a window.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Counts {
    pub seconds: f64,
    pub requests: usize,
    /// Writes other than the leader Lease's.
    pub writes: usize,
    pub lease_writes: usize,
    pub lists: usize,
    pub watches: usize,
    /// `<verb> <resource>`: how many.
    pub by_verb: BTreeMap<String, usize>,
}

impl Counts {
    pub fn requests_per_s(&self) -> f64 {
        rate(self.requests, self.seconds)
    }
    pub fn writes_per_s(&self) -> f64 {
        rate(self.writes, self.seconds)
    }
    pub fn lease_writes_per_s(&self) -> f64 {
        rate(self.lease_writes, self.seconds)
    }
    /// `<verb> <resource>` of the count.
    pub fn of(&self, verb: &str, resource: &str) -> usize {
        self.by_verb
            .get(&format!("{verb} {resource}"))
            .copied()
            .unwrap_or(0)
    }
}

/// `n` per second over `seconds`; 0 over an empty window.
pub fn rate(n: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        n as f64 / seconds
    } else {
        0.0
    }
}

/// The requests of `user` received in `[from, to)`.
pub fn count(requests: &[Request], user: &str, from: Timestamp, to: Timestamp) -> Counts {
    let mut c = Counts {
        seconds: (to.as_millisecond() - from.as_millisecond()).max(0) as f64 / 1000.0,
        ..Counts::default()
    };
    for r in requests
        .iter()
        .filter(|r| r.user == user && r.received >= from && r.received < to)
    {
        c.requests += 1;
        match (r.is_write(), r.is_lease()) {
            (true, true) => c.lease_writes += 1,
            (true, false) => c.writes += 1,
            _ => {}
        }
        match r.verb.as_str() {
            "list" => c.lists += 1,
            "watch" => c.watches += 1,
            _ => {}
        }
        *c.by_verb
            .entry(format!("{} {}", r.verb, r.resource))
            .or_default() += 1;
    }
    c
}

/// The username a ServiceAccount's token authenticates as.
pub fn service_account_user(ns: &str, name: &str) -> String {
    format!("system:serviceaccount:{ns}:{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "system:serviceaccount:remora-system:remora-operator-a";

    fn line(
        id: &str,
        stage: &str,
        verb: &str,
        resource: &str,
        sub: Option<&str>,
        at: &str,
    ) -> String {
        let mut r =
            serde_json::json!({"resource": resource, "namespace": "ns", "apiVersion": "v1"});
        if let Some(s) = sub {
            r["subresource"] = s.into();
        }
        serde_json::json!({
            "kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata",
            "auditID": id, "stage": stage, "requestURI": "/api/v1/x", "verb": verb,
            "user": {"username": A, "groups": ["system:serviceaccounts"]},
            "userAgent": "remora-operator/0.1.0 (remora-operator-a)",
            "objectRef": r, "responseStatus": {"metadata": {}, "code": 200},
            "requestReceivedTimestamp": at, "stageTimestamp": at,
        })
        .to_string()
    }

    #[test]
    fn parses_counts_and_windows_requests() {
        let log = [
            line(
                "1",
                "ResponseStarted",
                "watch",
                "pods",
                None,
                "2026-01-01T00:00:00.100000Z",
            ),
            line(
                "2",
                "ResponseComplete",
                "update",
                "leases",
                None,
                "2026-01-01T00:00:01.000000Z",
            ),
            line(
                "3",
                "ResponseComplete",
                "patch",
                "pods",
                None,
                "2026-01-01T00:00:02.500000Z",
            ),
            line(
                "4",
                "ResponseComplete",
                "patch",
                "sidecarlifecycles",
                Some("status"),
                "2026-01-01T00:00:03.000000Z",
            ),
            line(
                "5",
                "ResponseComplete",
                "list",
                "pods",
                None,
                "2026-01-01T00:00:04.000000Z",
            ),
            line(
                "6",
                "ResponseComplete",
                "get",
                "leases",
                None,
                "2026-01-01T00:00:09.999999Z",
            ),
            // The watch again, ending: the same request.
            line(
                "1",
                "ResponseComplete",
                "watch",
                "pods",
                None,
                "2026-01-01T00:00:00.100000Z",
            ),
            "{\"kind\":\"Event\",\"auditID\":\"7\",\"half".to_owned(),
        ]
        .join("\n");
        let reqs = parse(&log);
        assert_eq!(reqs.len(), 6);
        assert_eq!(reqs[3].resource, "sidecarlifecycles/status");
        let t = |s: &str| s.parse::<Timestamp>().unwrap();
        let c = count(
            &reqs,
            A,
            t("2026-01-01T00:00:00Z"),
            t("2026-01-01T00:00:10Z"),
        );
        assert_eq!(c.seconds, 10.0);
        assert_eq!(
            (c.requests, c.writes, c.lease_writes, c.lists, c.watches),
            (6, 2, 1, 1, 1)
        );
        assert_eq!(c.of("patch", "pods"), 1);
        assert!((c.requests_per_s() - 0.6).abs() < 1e-9);
        assert!((c.writes_per_s() - 0.2).abs() < 1e-9);
        // [from, to): the window's end is not in it; another user is not counted.
        let c = count(
            &reqs,
            A,
            t("2026-01-01T00:00:02.5Z"),
            t("2026-01-01T00:00:04Z"),
        );
        assert_eq!((c.requests, c.writes), (2, 2));
        assert_eq!(
            count(
                &reqs,
                "someone",
                t("2026-01-01T00:00:00Z"),
                t("2026-01-02T00:00:00Z")
            )
            .requests,
            0
        );
        assert_eq!(rate(5, 0.0), 0.0);
    }

    #[test]
    fn the_policy_names_the_users_and_drops_the_rest() {
        let p: serde_json::Value = serde_json::from_str(&policy(&[A.to_owned()])).unwrap();
        assert_eq!(p["rules"][0]["users"][0], A);
        assert_eq!(p["rules"][1]["level"], "None");
    }
}
