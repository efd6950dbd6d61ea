//! How a request ended: [`Outcome`], the one classification of every
//! client's failures (from hyper, h2, I/O and tonic errors).

use std::error::Error as StdError;
use std::fmt;

use serde::Serialize;

/// The headers a failed response's detail keeps: who produced it (Envoy's
/// local replies, the ingress's own 502s).
const DETAIL_HEADERS: &[&str] = &["server", "x-envoy-", "x-ingress-", "x-pod"];
/// How much of a failed response's body its detail keeps.
const DETAIL_BODY: usize = 200;

/// How one request ended, as precisely as the client can tell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "class", rename_all = "snake_case")]
pub enum Outcome {
    /// A 2xx (gRPC: status OK, a stream that ended cleanly or was held to
    /// its end) with the whole body.
    Ok,
    /// Another HTTP status, e.g. 503 from Envoy; `detail` keeps the
    /// headers that say who answered (`server`, `x-envoy-*`, `x-ingress-*`)
    /// and the start of the body.
    Status {
        code: u16,
        detail: String,
    },
    /// A gRPC status other than OK from the server or a proxy (Envoy turns
    /// its local replies into `grpc-status` for gRPC requests).
    GrpcStatus {
        code: i32,
        message: String,
    },
    /// Nothing listened: the request never left.
    ConnectRefused,
    /// The connection closed before the request was written (the case
    /// hyper would have retried): the server never saw it.
    NotSent {
        detail: String,
    },
    /// The connection ended (EOF) after the request was sent, before the
    /// response was complete: an in-flight cut.
    ClosedBeforeResponse {
        detail: String,
    },
    /// The connection was reset (RST, broken pipe) with the request in
    /// flight: an in-flight cut.
    ResetInFlight {
        detail: String,
    },
    /// HTTP/2 refused the stream without processing it: `RST_STREAM
    /// REFUSED_STREAM`, or a graceful `GOAWAY` whose last stream id is below
    /// this stream's.
    StreamRefused {
        detail: String,
    },
    /// HTTP/2 reset the stream (any other `RST_STREAM`, or a `GOAWAY` with
    /// an error code) after the request was sent: it may have been processed.
    StreamReset {
        detail: String,
    },
    /// No answer within the load's timeout.
    Timeout,
    Other {
        detail: String,
    },
}

impl Outcome {
    pub fn is_ok(&self) -> bool {
        matches!(self, Outcome::Ok)
    }

    /// The variant's name, as in JSON (`"ok"`, `"status"`, ...).
    pub fn class(&self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Status { .. } => "status",
            Outcome::GrpcStatus { .. } => "grpc_status",
            Outcome::ConnectRefused => "connect_refused",
            Outcome::NotSent { .. } => "not_sent",
            Outcome::ClosedBeforeResponse { .. } => "closed_before_response",
            Outcome::ResetInFlight { .. } => "reset_in_flight",
            Outcome::StreamRefused { .. } => "stream_refused",
            Outcome::StreamReset { .. } => "stream_reset",
            Outcome::Timeout => "timeout",
            Outcome::Other { .. } => "other",
        }
    }

    /// The server certainly never processed the request: what a retrying
    /// client would resend safely, and so hide.
    pub fn unprocessed(&self) -> bool {
        matches!(
            self,
            Outcome::ConnectRefused | Outcome::NotSent { .. } | Outcome::StreamRefused { .. }
        )
    }

    /// The request was cut while in flight (HTTP/1.1 connection closed or
    /// reset under it, or an HTTP/2 stream reset after it was sent).
    pub fn in_flight_cut(&self) -> bool {
        matches!(
            self,
            Outcome::ClosedBeforeResponse { .. }
                | Outcome::ResetInFlight { .. }
                | Outcome::StreamReset { .. }
        )
    }

    /// Classifies a client error by what its source chain holds: an h2
    /// error (stream reset, GOAWAY) first, then the deepest I/O error, then
    /// hyper's own kinds (a request canceled before it was written, a
    /// message cut short, a timeout).
    pub fn from_error(err: &(dyn StdError + 'static)) -> Outcome {
        let chain: Vec<&(dyn StdError + 'static)> =
            std::iter::successors(Some(err), |e| (*e).source()).collect();
        let detail = describe(&chain);
        if let Some(h2) = chain.iter().find_map(|e| e.downcast_ref::<h2::Error>()) {
            if let Some(io) = h2.get_io() {
                return from_io(io, detail);
            }
            let reason = h2.reason().unwrap_or(h2::Reason::NO_ERROR);
            // A stream above a graceful GOAWAY's last stream id fails with
            // that GOAWAY; streams below it go on (and fail otherwise if cut).
            if (h2.is_reset() && reason == h2::Reason::REFUSED_STREAM)
                || (h2.is_go_away() && reason == h2::Reason::NO_ERROR)
            {
                return Outcome::StreamRefused { detail };
            }
            if h2.is_reset() || h2.is_go_away() {
                return Outcome::StreamReset { detail };
            }
            return Outcome::Other { detail };
        }
        let connect = chain.iter().any(|e| {
            e.downcast_ref::<hyper_util::client::legacy::Error>()
                .is_some_and(|e| e.is_connect())
        });
        if let Some(io) = chain
            .iter()
            .rev()
            .find_map(|e| e.downcast_ref::<std::io::Error>())
        {
            return match from_io(io, detail.clone()) {
                o @ (Outcome::ConnectRefused | Outcome::Timeout) => o,
                _ if connect => Outcome::Other { detail },
                o => o,
            };
        }
        if let Some(hyper) = chain.iter().find_map(|e| e.downcast_ref::<hyper::Error>()) {
            if hyper.is_canceled() {
                return Outcome::NotSent { detail };
            }
            if hyper.is_incomplete_message() {
                return Outcome::ClosedBeforeResponse { detail };
            }
            if hyper.is_timeout() {
                return Outcome::Timeout;
            }
        }
        Outcome::Other { detail }
    }

    /// A gRPC status: classified by its transport cause when it has one
    /// (tonic wraps connection errors in `Unavailable` and friends),
    /// otherwise it is the server's (or a proxy's) answer.
    pub fn from_grpc(status: &tonic::Status) -> Outcome {
        if let Some(source) = StdError::source(status) {
            return Outcome::from_error(source);
        }
        let mut message = status.message().to_owned();
        for (k, v) in &status.metadata().clone().into_headers() {
            if DETAIL_HEADERS.iter().any(|h| k.as_str().starts_with(h)) {
                message.push_str(&format!("; {k}: {}", v.to_str().unwrap_or("?")));
            }
        }
        Outcome::GrpcStatus {
            code: status.code() as i32,
            message,
        }
    }
}

/// One line for reports and tables: `status 503`, `timeout`,
/// `reset_in_flight: connection reset by peer`, ...
impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Ok | Outcome::ConnectRefused | Outcome::Timeout => f.write_str(self.class()),
            Outcome::Status { code, .. } => write!(f, "status {code}"),
            Outcome::GrpcStatus { code, message } => write!(f, "grpc status {code}: {message}"),
            Outcome::NotSent { detail }
            | Outcome::ClosedBeforeResponse { detail }
            | Outcome::ResetInFlight { detail }
            | Outcome::StreamRefused { detail }
            | Outcome::StreamReset { detail }
            | Outcome::Other { detail } => write!(f, "{}: {detail}", self.class()),
        }
    }
}

fn from_io(io: &std::io::Error, detail: String) -> Outcome {
    use std::io::ErrorKind::*;
    match io.kind() {
        ConnectionRefused => Outcome::ConnectRefused,
        ConnectionReset | ConnectionAborted | BrokenPipe => Outcome::ResetInFlight { detail },
        UnexpectedEof => Outcome::ClosedBeforeResponse { detail },
        TimedOut => Outcome::Timeout,
        _ => Outcome::Other { detail },
    }
}

/// The error chain in one line, without the repeats of wrappers that
/// print their source inside their own message.
fn describe(chain: &[&(dyn StdError + 'static)]) -> String {
    let mut out: Vec<String> = Vec::new();
    for e in chain {
        let s = e.to_string();
        if !out.iter().any(|o| o.contains(&s)) {
            out.push(s);
        }
    }
    out.join(": ")
}

/// The detail of a non-2xx response: the headers of [`DETAIL_HEADERS`] and
/// the start of the body.
pub(super) fn status_detail(headers: &http::HeaderMap, body: &[u8]) -> String {
    let mut parts: Vec<String> = headers
        .iter()
        .filter(|(k, _)| DETAIL_HEADERS.iter().any(|h| k.as_str().starts_with(h)))
        .map(|(k, v)| format!("{k}: {}", v.to_str().unwrap_or("?")))
        .collect();
    let body = String::from_utf8_lossy(&body[..body.len().min(DETAIL_BODY)]);
    let body = body.trim();
    if !body.is_empty() {
        parts.push(format!("body: {body}"));
    }
    parts.join("; ")
}
