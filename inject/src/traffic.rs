//! The sidecar's traffic, from the pod's annotations: its static listeners
//! (`remora.dev/inbound`, `remora.dev/outbound`), their mTLS
//! (`remora.dev/inbound-tls`, `remora.dev/outbound-tls`) and whether it gets
//! the workload CA (`remora.dev/workload-ca`). What would turn the sidecar
//! against itself is refused with a [`PlumbingError`].

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, ContainerPort};
use remora_contract::pod::{HEALTH_PORT, INBOUND_PORT, sidecar_port_use};
use remora_contract::traffic::{
    InboundSpec, MAX_LISTENERS, OutboundSpec, OutboundTlsSpec, check_spiffe_id,
};
use remora_contract::{annotations as keys, env as env_name};
use serde_json::Value;

use crate::container::env;
use crate::resolve::{EffectiveConfig, WorkloadCaWiring};

/// A pod whose traffic annotations would turn the sidecar against itself
/// (publish Envoy's admin API, loop through the sidecar, bind a port twice)
/// or ask for more listeners than a sidecar is for: refused, never injected
/// as asked and never silently injected without them.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlumbingError {
    #[error("{key} entry {entry:?}: listener port {port} is the sidecar's own ({use_})")]
    ReservedListener {
        key: &'static str,
        entry: String,
        port: u16,
        use_: &'static str,
    },
    #[error("{key} entry {entry:?}: target port {port} is the sidecar's own ({use_})")]
    ReservedTarget {
        key: &'static str,
        entry: String,
        port: u16,
        use_: &'static str,
    },
    #[error("{key} entry {entry:?}: listener port {port} is already taken by {first:?}")]
    Duplicate {
        key: &'static str,
        entry: String,
        port: u16,
        first: String,
    },
    #[error("{key} lists {count} entries; at most {max} are accepted")]
    TooMany {
        key: &'static str,
        count: usize,
        max: usize,
    },
    #[error("{key}: {reason}")]
    BadValue { key: &'static str, reason: String },
    #[error(
        "{key} entry {entry:?}: port {port} is not a listener of {}",
        keys::OUTBOUND
    )]
    NotOutbound {
        key: &'static str,
        entry: String,
        port: u16,
    },
    #[error("{key} entry {entry:?}: port {port} is already given by {first:?}")]
    TlsTwice {
        key: &'static str,
        entry: String,
        port: u16,
        first: String,
    },
}

/// Whether the sidecar gets the workload CA: the chart enables it and the
/// pod does not say `remora.dev/workload-ca: "false"`. A value that is not a
/// boolean is refused: guessing would hand out (or withhold) an identity.
pub(crate) fn workload_ca_wiring<'c>(
    cfg: &'c EffectiveConfig,
    annotations: &BTreeMap<String, String>,
) -> Result<Option<&'c WorkloadCaWiring>, PlumbingError> {
    let wanted = match annotations.get(keys::WORKLOAD_CA) {
        Some(v) => {
            remora_contract::value::parse_bool(v).map_err(|reason| PlumbingError::BadValue {
                key: keys::WORKLOAD_CA,
                reason,
            })?
        }
        None => true,
    };
    Ok(cfg.workload_ca.as_ref().filter(|_| wanted))
}

/// What the injection records of the sidecar's traffic in `remora.dev/status`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plumbing {
    /// The inbound ports on which it accepts the mesh's mTLS (every inbound
    /// port with the CA: the agent's inbound listeners are then permissive
    /// or, with `remora.dev/inbound-tls`, mTLS only).
    pub mtls_ports: Vec<u16>,
    /// Its inbound listeners (`PORT:APP_PORT` or `APP_PORT`), the default
    /// one included: what the discovery server serves while the pod
    /// carries no `remora.dev/inbound` ([`live_inbound`]).
    pub inbound: Vec<String>,
}

/// Give the sidecar its listeners and their mTLS settings (as env), or
/// refuse the pod. `ca_wired`: whether it gets the workload CA;
/// `discovery`: whether its outbound listeners come from the discovery server.
pub(crate) fn plumb(
    container: &mut Container,
    annotations: &BTreeMap<String, String>,
    app_containers: &[Value],
    (ca_wired, discovery): (bool, bool),
    warnings: &mut Vec<String>,
) -> Result<Plumbing, PlumbingError> {
    let plumbed = plumb_traffic(container, annotations, app_containers, warnings)?;
    plumb_tls(
        container,
        annotations,
        &plumbed,
        (ca_wired, discovery),
        warnings,
    )?;
    Ok(Plumbing {
        mtls_ports: if ca_wired {
            plumbed.inbound_ports
        } else {
            Vec::new()
        },
        inbound: plumbed.inbound_entries,
    })
}

/// The inbound listeners of a running pod, for the discovery server (which
/// serves them, so a change of `remora.dev/inbound` applies live): those of
/// the annotation, read and checked by the injection's rules (entries the
/// agent would refuse dropped with a warning; none on the sidecar's own
/// ports, on an outbound listener's port or twice; at most
/// [`MAX_LISTENERS`]); without the annotation, or when it is refused (the
/// reason in `warnings`), `injected`: those the pod was injected with.
pub fn live_inbound<S: AsRef<str>>(
    annotations: &BTreeMap<String, String>,
    injected: &[S],
    warnings: &mut Vec<String>,
) -> Vec<InboundSpec> {
    let parse = |entries: &mut dyn Iterator<Item = &str>| -> Vec<InboundSpec> {
        entries.filter_map(|e| e.parse().ok()).collect()
    };
    let Some(raw) = annotations.get(keys::INBOUND) else {
        return parse(&mut injected.iter().map(AsRef::as_ref));
    };
    let checked = (|| {
        let inbound = listeners(keys::INBOUND, raw, &inbound_entry, warnings)?;
        // The outbound entries only for their ports; the injection already
        // warned about the ones it dropped.
        let outbound = match annotations.get(keys::OUTBOUND) {
            Some(raw) => listeners(keys::OUTBOUND, raw, &outbound_entry, &mut Vec::new())?,
            None => Vec::new(),
        };
        let all: Vec<Listener> = inbound.into_iter().chain(outbound).collect();
        check_listeners(&all)?;
        Ok::<_, PlumbingError>(all)
    })();
    match checked {
        Ok(all) => parse(&mut all.iter().filter(|l| l.inbound).map(|l| l.entry.as_str())),
        Err(e) => {
            warnings.push(format!(
                "remora: {e}; the sidecar keeps the inbound listeners it was injected with"
            ));
            parse(&mut injected.iter().map(AsRef::as_ref))
        }
    }
}

/// A `remora.dev/inbound` entry: its listener port and its app's port.
fn inbound_entry(item: &str) -> Result<(u16, Option<u16>), String> {
    item.parse::<InboundSpec>()
        .map(|s| (s.port.unwrap_or(INBOUND_PORT), Some(s.app_port)))
}

/// A `remora.dev/outbound` entry: its listener port and, when on this pod,
/// its target port.
fn outbound_entry(item: &str) -> Result<(u16, Option<u16>), String> {
    item.parse::<OutboundSpec>()
        .map(|s| (s.port, s.targets_this_pod().then_some(s.upstream_port)))
}

/// `remora.dev/inbound-tls`: `None` when not asked (`false`), else the
/// SPIFFE IDs allowed to call (empty: any of the mesh). The injection and
/// the discovery server read it here.
pub fn inbound_tls(raw: &str) -> Result<Option<Vec<String>>, PlumbingError> {
    match remora_contract::value::parse_bool(raw) {
        Ok(false) => Ok(None),
        Ok(true) => Ok(Some(Vec::new())),
        Err(_) => {
            let ids: Vec<String> = raw
                .split(',')
                .map(str::trim)
                .filter(|i| !i.is_empty())
                .map(str::to_string)
                .collect();
            if ids.len() > MAX_LISTENERS {
                return Err(PlumbingError::TooMany {
                    key: keys::INBOUND_TLS,
                    count: ids.len(),
                    max: MAX_LISTENERS,
                });
            }
            for id in &ids {
                check_spiffe_id(id).map_err(|e| PlumbingError::BadValue {
                    key: keys::INBOUND_TLS,
                    reason: format!("expected true, false or SPIFFE IDs: {e}"),
                })?;
            }
            Ok(Some(ids))
        }
    }
}

/// One static listener the sidecar will get.
struct Listener {
    inbound: bool,
    /// Where it comes from, for messages: the annotation, or the default.
    key: &'static str,
    entry: String,
    port: u16,
    /// The port it forwards to when that is on this pod.
    local_target: Option<u16>,
}

/// Reads one entry: its listener port and, when on this pod, its target port.
type ParseEntry = dyn Fn(&str) -> Result<(u16, Option<u16>), String>;

/// The entries of one traffic annotation: at most [`MAX_LISTENERS`]; those
/// the agent would refuse to parse are dropped with a warning, so a typo
/// never gives a sidecar that cannot start.
fn listeners(
    key: &'static str,
    raw: &str,
    parse: &ParseEntry,
    warnings: &mut Vec<String>,
) -> Result<Vec<Listener>, PlumbingError> {
    let items: Vec<&str> = raw
        .split(',')
        .map(str::trim)
        .filter(|i| !i.is_empty())
        .collect();
    if items.len() > MAX_LISTENERS {
        return Err(PlumbingError::TooMany {
            key,
            count: items.len(),
            max: MAX_LISTENERS,
        });
    }
    let mut kept = Vec::new();
    for item in items {
        match parse(item) {
            Ok((port, local_target)) => kept.push(Listener {
                inbound: key == keys::INBOUND,
                key,
                entry: item.to_string(),
                port,
                local_target,
            }),
            Err(e) => warnings.push(format!("remora: ignored {key} entry {item:?}: {e}")),
        }
    }
    Ok(kept)
}

/// Sidecar ports an outbound (loopback) listener may forward to.
const OUTBOUND_MAY_TARGET: [u16; 2] = [HEALTH_PORT, remora_contract::pod::STATS_PORT];

/// Refuse listeners on the sidecar's own ports or on a port taken twice,
/// and forwarding (on this pod) to the sidecar's ports or its listeners.
fn check_listeners(all: &[Listener]) -> Result<(), PlumbingError> {
    let mut taken: BTreeMap<u16, &Listener> = BTreeMap::new();
    for l in all {
        // 15006 is the inbound listener's own: taken only by a duplicate.
        if let Some(use_) = sidecar_port_use(l.port).filter(|_| l.port != INBOUND_PORT) {
            return Err(PlumbingError::ReservedListener {
                key: l.key,
                entry: l.entry.clone(),
                port: l.port,
                use_,
            });
        }
        if let Some(first) = taken.insert(l.port, l) {
            return Err(PlumbingError::Duplicate {
                key: l.key,
                entry: l.entry.clone(),
                port: l.port,
                first: first.entry.clone(),
            });
        }
    }
    for l in all {
        let Some(port) = l.local_target else { continue };
        // An outbound listener is bound on loopback: one onto the health or
        // stats port (served on every address anyway) exposes nothing, and
        // lets an app wait, through Envoy, until its sidecar is ready.
        if !l.inbound && OUTBOUND_MAY_TARGET.contains(&port) {
            continue;
        }
        let use_ = sidecar_port_use(port).or_else(|| {
            taken
                .contains_key(&port)
                .then_some("a static listener of this pod")
        });
        if let Some(use_) = use_ {
            return Err(PlumbingError::ReservedTarget {
                key: l.key,
                entry: l.entry.clone(),
                port,
                use_,
            });
        }
    }
    Ok(())
}

/// Give the sidecar its static-mode listeners: inbound from the pod's
/// `remora.dev/inbound` annotation or, by default, 15006 in front of the first
/// TCP port of the first app container; outbound from `remora.dev/outbound`.
fn plumb_traffic(
    container: &mut Container,
    annotations: &BTreeMap<String, String>,
    app_containers: &[Value],
    warnings: &mut Vec<String>,
) -> Result<Plumbed, PlumbingError> {
    let inbound = match annotations.get(keys::INBOUND) {
        Some(raw) => listeners(keys::INBOUND, raw, &inbound_entry, warnings)?,
        None => {
            // Never the sidecar's own ports: an app port among them was
            // warned about, and forwarding to it would loop or publish admin.
            let app_port = app_containers
                .first()
                .and_then(|c| c["ports"].as_array())
                .into_iter()
                .flatten()
                .filter(|p| p["protocol"].as_str().unwrap_or("TCP") == "TCP")
                .filter_map(|p| p["containerPort"].as_u64())
                .filter_map(|p| u16::try_from(p).ok())
                .find(|p| *p != 0 && sidecar_port_use(*p).is_none());
            app_port
                .map(|p| Listener {
                    inbound: true,
                    key: "the default inbound listener",
                    entry: format!("{INBOUND_PORT}:{p}"),
                    port: INBOUND_PORT,
                    local_target: Some(p),
                })
                .into_iter()
                .collect()
        }
    };
    let outbound = match annotations.get(keys::OUTBOUND) {
        Some(raw) => listeners(keys::OUTBOUND, raw, &outbound_entry, warnings)?,
        None => Vec::new(),
    };
    let all: Vec<Listener> = inbound.into_iter().chain(outbound).collect();
    check_listeners(&all)?;
    let join = |inbound: bool| {
        all.iter()
            .filter(|l| l.inbound == inbound)
            .map(|l| l.entry.as_str())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (inbound, outbound) = (join(true), join(false));
    let vars = container.env.get_or_insert_with(Vec::new);
    if !inbound.is_empty() {
        vars.push(env(env_name::INBOUND, inbound));
    }
    if !outbound.is_empty() {
        vars.push(env(env_name::OUTBOUND, outbound));
    }
    let ports = container.ports.get_or_insert_with(Vec::new);
    let inbound_ports = all.iter().filter(|l| l.inbound);
    for (i, l) in inbound_ports.enumerate() {
        ports.push(ContainerPort {
            // Port names are at most 15 characters.
            name: Some(if i == 0 {
                remora_contract::pod::INBOUND_PORT_NAME.into()
            } else {
                format!("remora-in-{i}")
            }),
            container_port: i32::from(l.port),
            protocol: Some("TCP".into()),
            ..Default::default()
        });
    }
    Ok(Plumbed {
        has_inbound: all.iter().any(|l| l.inbound),
        inbound_entries: all
            .iter()
            .filter(|l| l.inbound)
            .map(|l| l.entry.clone())
            .collect(),
        inbound_ports: all.iter().filter(|l| l.inbound).map(|l| l.port).collect(),
        outbound_ports: all.iter().filter(|l| !l.inbound).map(|l| l.port).collect(),
    })
}

/// The static listeners the sidecar got, as the TLS annotations need them.
struct Plumbed {
    has_inbound: bool,
    inbound_entries: Vec<String>,
    inbound_ports: Vec<u16>,
    outbound_ports: Vec<u16>,
}

/// The static-mode mTLS annotations, checked against the listeners the
/// sidecar got: `remora.dev/inbound-tls` (`true`, or the SPIFFE IDs allowed
/// to call) and `remora.dev/outbound-tls` (`PORT=SPIFFE_ID,...`, each PORT an
/// outbound listener, at most once). Anything else is refused: a pod that
/// asked for mTLS must not start without it.
fn plumb_tls(
    container: &mut Container,
    annotations: &BTreeMap<String, String>,
    plumbed: &Plumbed,
    (ca_wired, discovery): (bool, bool),
    warnings: &mut Vec<String>,
) -> Result<(), PlumbingError> {
    let items = |raw: &str| -> Vec<String> {
        raw.split(',')
            .map(str::trim)
            .filter(|i| !i.is_empty())
            .map(str::to_string)
            .collect()
    };
    let mut asked = Vec::new();
    let mut vars = Vec::new();
    if let Some(raw) = annotations.get(keys::INBOUND_TLS) {
        let sans = inbound_tls(raw)?;
        if let Some(sans) = sans {
            asked.push(keys::INBOUND_TLS);
            if !plumbed.has_inbound {
                warnings.push(format!(
                    "remora: {} is set but the sidecar has no inbound listener",
                    keys::INBOUND_TLS
                ));
            }
            vars.push(env(env_name::INBOUND_TLS, "true".into()));
            if !sans.is_empty() {
                vars.push(env(env_name::INBOUND_TLS_SAN, sans.join(",")));
            }
        }
    }
    if let Some(raw) = annotations.get(keys::OUTBOUND_TLS) {
        let entries = items(raw);
        let mut given: BTreeMap<u16, &str> = BTreeMap::new();
        for entry in &entries {
            let spec = entry
                .parse::<OutboundTlsSpec>()
                .map_err(|e| PlumbingError::BadValue {
                    key: keys::OUTBOUND_TLS,
                    reason: format!("entry {entry:?}: {e}"),
                })?;
            if !plumbed.outbound_ports.contains(&spec.port) {
                return Err(PlumbingError::NotOutbound {
                    key: keys::OUTBOUND_TLS,
                    entry: entry.clone(),
                    port: spec.port,
                });
            }
            if let Some(first) = given.insert(spec.port, entry) {
                return Err(PlumbingError::TlsTwice {
                    key: keys::OUTBOUND_TLS,
                    entry: entry.clone(),
                    port: spec.port,
                    first: first.to_string(),
                });
            }
        }
        if !entries.is_empty() && discovery {
            // The discovery server's clusters carry the mesh's mTLS, checked
            // against the identities behind each Service: the static pin
            // has no listener to go on, and the agent refuses it beside a
            // discovery address, so it is dropped here, and said so.
            warnings.push(format!(
                "remora: {} is ignored with discovery: calls to meshed Services are mTLS, \
                 checked against the ServiceAccounts of their endpoints",
                keys::OUTBOUND_TLS
            ));
        } else if !entries.is_empty() {
            asked.push(keys::OUTBOUND_TLS);
            vars.push(env(env_name::OUTBOUND_TLS, entries.join(",")));
        }
    }
    if !ca_wired && let Some(key) = asked.first() {
        // Not refused: certificates may come from a mounted --cert-dir.
        warnings.push(format!(
            "remora: {key} without the workload CA (not enabled, or {} is \"false\"): the \
             sidecar needs its certificates in its --cert-dir",
            keys::WORKLOAD_CA
        ));
    }
    container.env.get_or_insert_with(Vec::new).extend(vars);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn live_inbound_reads_the_annotation_as_the_webhook_does() {
        let injected = ["15006:8080"];
        let run = |pairs: &[(&str, &str)]| {
            let mut w = Vec::new();
            let got: Vec<String> = live_inbound(&annotations(pairs), &injected, &mut w)
                .iter()
                .map(|s| format!("{:?}:{}", s.port, s.app_port))
                .collect();
            (got, w.len())
        };
        assert_eq!(run(&[]), (vec!["Some(15006):8080".to_string()], 0));
        assert_eq!(
            run(&[(keys::INBOUND, "8081, 9000:9090,bad")]),
            (
                vec!["None:8081".to_string(), "Some(9000):9090".to_string()],
                1
            )
        );
        // Refused as the webhook refuses it: what was injected stays.
        for bad in [
            &[(keys::INBOUND, "15000:8081")][..],
            &[(keys::INBOUND, "9000:15000")],
            &[(keys::INBOUND, "8081,15006:8082")],
            &[
                (keys::INBOUND, "15001:8081"),
                (keys::OUTBOUND, "15001:cart.shop:80"),
            ],
        ] {
            assert_eq!(
                run(bad),
                (vec!["Some(15006):8080".to_string()], 1),
                "{bad:?}"
            );
        }
        let many = vec!["8080"; MAX_LISTENERS + 1].join(",");
        assert_eq!(
            run(&[(keys::INBOUND, &many)]).0,
            ["Some(15006):8080"],
            "too many entries"
        );
    }

    #[test]
    fn inbound_tls_values() {
        assert_eq!(inbound_tls("false"), Ok(None));
        assert_eq!(inbound_tls("true"), Ok(Some(vec![])));
        assert_eq!(
            inbound_tls(" spiffe://td/a , spiffe://td/b"),
            Ok(Some(vec!["spiffe://td/a".into(), "spiffe://td/b".into()]))
        );
        assert!(matches!(
            inbound_tls("spiffe://td/../a"),
            Err(PlumbingError::BadValue { .. })
        ));
    }
}
