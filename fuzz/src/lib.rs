//! Fuzz targets: each takes untrusted bytes and must never panic. The AFL++
//! binaries in `src/bin/` call them (feature `afl`, scripts/fuzz.sh), and
//! `tests/replay.rs` replays the committed corpora and crashes through them
//! with a plain `cargo test`, so a crash once found stays fixed.
//!
//! Besides "no panic", each target asserts a property of what came out
//! (a review that encodes, a parsed value that round-trips), so the fuzzer
//! also finds wrong answers, not only crashes.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use prost::Message;
use remora_agent::bootstrap::{self, Extras};
use remora_agent::config::RunConfig;
use remora_agent::sds::server::SdsService;
use remora_agent::sds::store::SecretName;
use remora_contract::{downward, duration, overlay::Overlay, value};
use remora_crds::{DurationString, ShutdownSpec, SidecarLifecycleSpec, WorkloadSelector};
use remora_inject::resolve::{ChartDefaults, LifecycleEntry};
use remora_inject::review::{self, StaticView};

pub mod discovery;
pub mod discovery_delta;
pub mod xds_proxy;

/// The next length-delimited message of `data`, at most `max` bytes.
pub(crate) fn message<M: Message + Default>(data: &mut &[u8], max: usize) -> Option<M> {
    let len = prost::encoding::decode_varint(data).ok()?;
    let len = usize::try_from(len)
        .ok()
        .filter(|l| *l <= data.len() && *l <= max)?;
    let (msg, rest) = data.split_at(len);
    *data = rest;
    M::decode(msg).ok()
}

/// A committed seed of `target`'s corpus, for the tests that check what it reaches.
#[cfg(test)]
pub(crate) fn seed(target: &str, name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A fuzz target: untrusted bytes in, a panic on any bug.
pub type Target = fn(&[u8]);

/// Every target by name: the name is its corpus directory and AFL binary.
pub const TARGETS: [(&str, Target); 7] = [
    ("admission_review", admission_review),
    ("contract_annotations", contract_annotations),
    ("bootstrap_override", bootstrap_override),
    ("sds_request", sds_request),
    ("discovery_request", discovery::discovery_request),
    ("discovery_delta", discovery_delta::discovery_delta),
    ("xds_response", xds_proxy::xds_response),
];

/// The operator's namespace in the fixed cluster below.
const OPERATOR_NAMESPACE: &str = "remora-system";

/// The review as the webhook decides it, over a fixed cluster with one
/// SidecarLifecycle and one injection-enabled namespace, so inputs can
/// reach the selector match and the lifecycle merge.
fn cluster() -> &'static (StaticView, ChartDefaults) {
    static CLUSTER: OnceLock<(StaticView, ChartDefaults)> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let view = StaticView {
            lifecycles: vec![LifecycleEntry {
                namespace: "shop".into(),
                name: "web".into(),
                created: Some("2026-01-01T00:00:00Z".into()),
                spec: SidecarLifecycleSpec {
                    selector: Some(WorkloadSelector {
                        match_labels: BTreeMap::from([("app".into(), "web".into())]),
                    }),
                    shutdown: Some(ShutdownSpec {
                        termination_drain_duration: Some(DurationString::new("3s")),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            }],
            namespaces: BTreeMap::from([(
                "shop".to_string(),
                BTreeMap::from([("remora.dev/inject".to_string(), "enabled".to_string())]),
            )]),
            native_sidecars: true,
        };
        (view, ChartDefaults::default())
    })
}

/// An AdmissionReview body, as the webhook receives it: the answer must
/// always encode (the server has nothing else to send).
pub fn admission_review(data: &[u8]) {
    let (view, chart) = cluster();
    let (answer, _outcome) = view.review(data, chart, OPERATOR_NAMESPACE);
    if let Err(e) = review::encode(answer) {
        panic!("the review of a fuzzed body does not encode: {e}");
    }
}

/// A downward-API annotations file as the agent reads it, and every parser
/// of annotation values behind it. Each line's value is also fed to the
/// value parsers directly, since the file's quoting limits what reaches them.
pub fn contract_annotations(data: &[u8]) {
    // The file is read with read_to_string: not UTF-8 never gets further.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = downward::stop_request(text);
    let _ = downward::runs_native(text);
    if let Ok(ann) = downward::parse_annotations(text) {
        let _ = Overlay::from_pod_annotations(&ann);
        let _ = Overlay::from_annotations(&ann);
    }
    for line in text.lines().chain([text]) {
        check_duration(line);
        let _ = duration::parse_seconds(line);
        let _ = value::parse_bool(line);
        let _ = value::parse_concurrency(line);
        let _ = line.parse::<remora_contract::SidecarMode>();
        let _ = line.parse::<remora_contract::DrainMode>();
        let _ = line.parse::<remora_contract::LogLevel>();
        let _ = line.parse::<remora_contract::traffic::InboundSpec>();
        let _ = line.parse::<remora_contract::traffic::OutboundSpec>();
    }
}

/// A parsed duration is bounded and survives `format` then `parse`.
fn check_duration(text: &str) {
    if let Ok(d) = duration::parse(text) {
        assert!(d <= duration::MAX, "{text:?} parsed past the bound: {d:?}");
        let shown = duration::format(d);
        assert_eq!(
            duration::parse(&shown),
            Ok(d),
            "{text:?} -> {d:?} -> {shown:?} does not round-trip"
        );
    }
}

/// The agent's configuration for the bootstrap target: static mode with one
/// inbound and one outbound listener, so the override has something to merge over.
fn run_config() -> &'static RunConfig {
    static CFG: OnceLock<RunConfig> = OnceLock::new();
    CFG.get_or_init(|| {
        use clap::Parser;
        let argv = [
            "remora-agent",
            "run",
            "--inbound",
            "15006:8080",
            "--outbound",
            "15001:example.org:80",
        ];
        match remora_agent::config::Cli::try_parse_from(argv).map(|c| c.command) {
            Ok(remora_agent::config::Command::Run(c)) => *c,
            other => panic!("the fixed agent arguments do not parse: {other:?}"),
        }
    })
}

/// A `--bootstrap-override` file's text merged over the generated bootstrap:
/// when accepted, the result still keeps Envoy's admin on loopback (the
/// generator's check) and serialises for Envoy.
pub fn bootstrap_override(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(doc) = bootstrap::parse_override(Path::new("override.yaml"), text) else {
        return;
    };
    assert!(doc.is_object(), "an accepted override must be a mapping");
    if let Ok(b) = bootstrap::generate(run_config(), &Extras::default(), Some(&doc), true)
        && let Err(e) = serde_json::to_vec_pretty(&b)
    {
        panic!("an accepted bootstrap does not serialise: {e}");
    }
}

/// A DiscoveryRequest as the SDS server decodes it off the wire, then what
/// the server does with it short of a socket: the type check and reading
/// each requested name. A request that decodes also re-encodes to bytes
/// that decode to the same size (not compared with `==`: metadata may hold NaN).
pub fn sds_request(data: &[u8]) {
    let Ok(req) = DiscoveryRequest::decode(data) else {
        return;
    };
    let _ = SdsService::check_type(&req);
    for name in &req.resource_names {
        let _ = SecretName::parse(name);
    }
    match DiscoveryRequest::decode(req.encode_to_vec().as_slice()) {
        Ok(again) => assert_eq!(
            again.encoded_len(),
            req.encoded_len(),
            "a decoded request does not round-trip"
        ),
        Err(e) => panic!("a decoded request re-encodes to bytes that do not decode: {e}"),
    }
}
