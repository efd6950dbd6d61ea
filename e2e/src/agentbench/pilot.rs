//! Istio's pilot-agent as a contender, run the way `../shared/PEERS.md`
//! says works without istiod: `pilot-agent proxy sidecar --templateFile T`
//! from a working directory of its own, T being Istio's own bootstrap
//! template with `dynamic_resources` turned into file-based LDS and CDS
//! (holding the same inbound listener and cluster remora-agent generates),
//! the workload certificate as file-mounted certificates in
//! `./var/run/secrets/workload-spiffe-credentials/`, and always
//! `CLOUD_PLATFORM=none` and `ISTIO_META_DNS_CAPTURE=false`: without them it
//! probes cloud metadata and DNS off the machine, so [`refuse_unsafe`] stops
//! any start that lacks them.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use std::time::Duration;

use remora_agent::bootstrap::{Extras, generate};
use remora_agent::sds::bootstrap::inbound_tls_transport_socket;
use remora_test_support::ports::free_port;
use serde_json::{Value, json};
use tokio::process::Command;

use super::{AgentBenchError, Drain, Prepared, Settings, Setup, clean_env, io};

/// Where pilot-agent finds file-mounted workload certificates, relative to
/// its working directory.
pub const CREDENTIALS_DIR: &str = "var/run/secrets/workload-spiffe-credentials";

pub fn prepare(
    setup: &Setup,
    dir: &Path,
    settings: Settings,
    name: &str,
) -> Result<Prepared, AgentBenchError> {
    let (inbound, envoy_admin, status, envoy_status, prometheus, discovery) = (
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
    );
    let config_path = dir.join("etc/istio/proxy");
    for d in [
        &config_path,
        &dir.join("var/run/secrets/workload-spiffe-uds"),
    ] {
        std::fs::create_dir_all(d).map_err(io(format!("creating {}", d.display())))?;
    }
    let (listener, cluster) = inbound_resources(setup.app_port, inbound, settings.tls)?;
    let (lds, cds) = (dir.join("lds.json"), dir.join("cds.json"));
    write_resources(
        &lds,
        "type.googleapis.com/envoy.config.listener.v3.Listener",
        listener,
    )?;
    write_resources(
        &cds,
        "type.googleapis.com/envoy.config.cluster.v3.Cluster",
        cluster,
    )?;
    let template_err = |reason: String| AgentBenchError::Template {
        path: setup.pilot_template.clone(),
        reason,
    };
    let original =
        std::fs::read_to_string(&setup.pilot_template).map_err(|e| template_err(e.to_string()))?;
    let template = file_dynamic_resources(&original, &lds, &cds).map_err(template_err)?;
    let template_path = dir.join("envoy_bootstrap.json");
    std::fs::write(&template_path, template)
        .map_err(io(format!("writing {}", template_path.display())))?;

    let mut proxy_config = json!({
        "binaryPath": setup.envoy,
        "configPath": config_path,
        // Nothing listens there; nothing connects either (no ADS in the
        // template), but it must never be an address off the machine.
        "discoveryAddress": format!("127.0.0.1:{discovery}"),
        "controlPlaneAuthPolicy": "NONE",
        "proxyAdminPort": envoy_admin,
        "statusPort": status,
        // Istio's injected default, and remora-agent's.
        "concurrency": 2,
    });
    let mut cmd = Command::new(&setup.pilot_agent);
    clean_env(&mut cmd, dir);
    match settings.drain {
        Drain::Defaults => {}
        Drain::TerminationDrain(d) => {
            proxy_config["terminationDrainDuration"] = json!(go_duration(d));
        }
        Drain::ExitOnZero { minimum } => {
            cmd.env("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true")
                .env("MINIMUM_DRAIN_DURATION", go_duration(minimum));
        }
    }
    cmd.current_dir(dir)
        .env("POD_NAME", name)
        .env("ENVOY_STATUS_PORT", envoy_status.to_string())
        .env("ENVOY_PROMETHEUS_PORT", prometheus.to_string())
        .env("PROXY_CONFIG", proxy_config.to_string())
        .env("CLOUD_PLATFORM", "none")
        .env("ISTIO_META_DNS_CAPTURE", "false")
        .args(["proxy", "sidecar", "--templateFile"])
        .arg(&template_path);
    Ok(Prepared {
        command: cmd,
        inbound,
        envoy_admin,
        // The agent's own status server (Kubernetes probes it through
        // Envoy's 15021 listener; here the agent is asked directly, as
        // remora-agent's health port is).
        ready_url: format!("http://127.0.0.1:{status}/healthz/ready"),
        cert_dir: dir.join(CREDENTIALS_DIR),
    })
}

/// A duration as Go's `time.ParseDuration` and protobuf's JSON both read it.
fn go_duration(d: Duration) -> String {
    format!("{}s", d.as_secs_f64())
}

/// Refuse to start pilot-agent unless its environment keeps it on the
/// machine: `CLOUD_PLATFORM=none`, `ISTIO_META_DNS_CAPTURE=false`, and a
/// loopback `discoveryAddress`, all set explicitly.
pub fn refuse_unsafe(cmd: &Command) -> Result<(), AgentBenchError> {
    let envs: HashMap<&OsStr, Option<&OsStr>> = cmd.as_std().get_envs().collect();
    let var = |k: &str| {
        envs.get(OsStr::new(k))
            .copied()
            .flatten()
            .and_then(OsStr::to_str)
    };
    if var("CLOUD_PLATFORM") != Some("none") {
        return Err(AgentBenchError::Unsafe(
            "CLOUD_PLATFORM=none is not set: pilot-agent would probe cloud metadata (169.254.169.254)"
                .into(),
        ));
    }
    if var("ISTIO_META_DNS_CAPTURE") != Some("false") {
        return Err(AgentBenchError::Unsafe(
            "ISTIO_META_DNS_CAPTURE=false is not set".into(),
        ));
    }
    let discovery = var("PROXY_CONFIG")
        .and_then(|c| serde_json::from_str::<Value>(c).ok())
        .and_then(|c| c["discoveryAddress"].as_str().map(str::to_owned))
        .unwrap_or_default();
    if !(discovery.starts_with("127.0.0.1:") || discovery.starts_with("localhost:")) {
        return Err(AgentBenchError::Unsafe(format!(
            "PROXY_CONFIG discoveryAddress {discovery:?} is not a loopback address (the default is istiod's, off the machine)"
        )));
    }
    Ok(())
}

/// The inbound listener and its cluster exactly as remora-agent generates
/// them for `--inbound INBOUND:APP` (with its mTLS transport socket, whose
/// SDS cluster `sds-grpc` and secret names `default`/`ROOTCA` are Istio's
/// too), so both Envoys serve the same listener.
fn inbound_resources(app: u16, inbound: u16, tls: bool) -> Result<(Value, Value), AgentBenchError> {
    let fail = |m: String| AgentBenchError::Listener(m);
    let argv = [
        "remora-agent".to_string(),
        "run".into(),
        "--inbound".into(),
        format!("{inbound}:{app}"),
    ];
    let cli = <remora_agent::config::Cli as clap::Parser>::try_parse_from(argv)
        .map_err(|e| fail(e.to_string()))?;
    let remora_agent::config::Command::Run(cfg) = cli.command else {
        return Err(fail("not a run command".into()));
    };
    let extras = Extras {
        inbound_transport_socket: tls.then(|| inbound_tls_transport_socket(&[])),
        ..Default::default()
    };
    let doc = generate(&cfg, &extras, None, false).map_err(|e| fail(e.to_string()))?;
    let listener = doc["static_resources"]["listeners"]
        .as_array()
        .and_then(|ls| ls.iter().find(|l| l["traffic_direction"] == "INBOUND"))
        .cloned()
        .ok_or_else(|| fail("no INBOUND listener in the generated bootstrap".into()))?;
    let cluster_name =
        listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"]
            [0]["routes"][0]["route"]["cluster"]
            .as_str()
            .ok_or_else(|| fail("the inbound listener routes to no cluster".into()))?;
    let cluster = doc["static_resources"]["clusters"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == cluster_name))
        .cloned()
        .ok_or_else(|| fail(format!("no cluster {cluster_name:?}")))?;
    Ok((listener, cluster))
}

/// A file-based xDS resource file: a DiscoveryResponse with one resource.
fn write_resources(
    path: &Path,
    type_url: &str,
    mut resource: Value,
) -> Result<(), AgentBenchError> {
    resource["@type"] = json!(type_url);
    let doc = json!({"version_info": "1", "resources": [resource]});
    std::fs::write(path, doc.to_string()).map_err(io(format!("writing {}", path.display())))
}

/// Istio's bootstrap template (a Go template, not JSON) with its
/// `dynamic_resources` object (ADS) replaced by LDS and CDS from files.
pub fn file_dynamic_resources(template: &str, lds: &Path, cds: &Path) -> Result<String, String> {
    const KEY: &str = "\"dynamic_resources\"";
    let mut found = template.match_indices(KEY);
    let (at, _) = found
        .next()
        .ok_or("no \"dynamic_resources\" in the template")?;
    if found.next().is_some() {
        return Err("\"dynamic_resources\" appears more than once".into());
    }
    let open = at
        + template[at..]
            .find('{')
            .ok_or("no object after \"dynamic_resources\"")?;
    // The template's `{{ ... }}` actions inside the object are balanced, so
    // counting braces finds its end.
    let mut depth = 0usize;
    let mut close = None;
    for (i, c) in template[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    close = Some(open + i);
                    break;
                }
            }
            _ => {}
        }
    }
    let close = close.ok_or("unbalanced braces after \"dynamic_resources\"")?;
    let source = |p: &Path| {
        json!({
            "path_config_source": {"path": p},
            "resource_api_version": "V3"
        })
    };
    let files = json!({"lds_config": source(lds), "cds_config": source(cds)});
    Ok(format!(
        "{}{}{}",
        &template[..open],
        files,
        &template[close + 1..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    // The shape of Istio's template around the block (release-1.31).
    const TEMPLATE: &str = r#"{
  "node": {"id": "{{ .nodeID }}"},
  "dynamic_resources": {
    "lds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
    "cds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
    "ads_config": {
      "api_type": "{{ .xds_type }}",
      "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]
    }
  },
  "static_resources": {"clusters": [{{ .extra }}]}
}"#;

    #[test]
    fn dynamic_resources_become_files_and_the_rest_stays() {
        let out =
            file_dynamic_resources(TEMPLATE, Path::new("/w/lds.json"), Path::new("/w/cds.json"))
                .expect("patched");
        assert!(!out.contains("ads_config"), "{out}");
        assert!(!out.contains("xds_type"), "{out}");
        assert!(out.contains(r#""lds_config":{"path_config_source":{"path":"/w/lds.json"}"#));
        assert!(out.contains(r#""cds_config":{"path_config_source":{"path":"/w/cds.json"}"#));
        assert!(out.contains(r#""node": {"id": "{{ .nodeID }}"}"#));
        assert!(out.contains(r#""static_resources": {"clusters": [{{ .extra }}]}"#));
        assert!(file_dynamic_resources("{}", Path::new("a"), Path::new("b")).is_err());
    }

    #[test]
    fn pilot_agent_is_never_started_without_the_safety_env() {
        let safe = |cmd: &mut Command| {
            cmd.env("CLOUD_PLATFORM", "none")
                .env("ISTIO_META_DNS_CAPTURE", "false")
                .env("PROXY_CONFIG", r#"{"discoveryAddress":"127.0.0.1:1"}"#);
        };
        let mut ok = Command::new("pilot-agent");
        safe(&mut ok);
        assert!(refuse_unsafe(&ok).is_ok());
        for (k, v) in [
            ("CLOUD_PLATFORM", None),
            ("CLOUD_PLATFORM", Some("gcp")),
            ("ISTIO_META_DNS_CAPTURE", None),
            ("ISTIO_META_DNS_CAPTURE", Some("true")),
            (
                "PROXY_CONFIG",
                Some(r#"{"discoveryAddress":"istiod.istio-system.svc:15012"}"#),
            ),
            ("PROXY_CONFIG", None),
        ] {
            let mut cmd = Command::new("pilot-agent");
            safe(&mut cmd);
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
            assert!(refuse_unsafe(&cmd).is_err(), "{k}={v:?} accepted");
        }
    }

    #[test]
    fn the_listener_is_remoras_inbound_listener() {
        let (l, c) = inbound_resources(8080, 15006, true).expect("resources");
        assert_eq!(l["traffic_direction"], "INBOUND");
        assert_eq!(l["address"]["socket_address"]["port_value"], 15006);
        let tls = &l["filter_chains"][0]["transport_socket"]["typed_config"]["common_tls_context"];
        assert_eq!(
            tls["tls_certificate_sds_secret_configs"][0]["sds_config"]["api_config_source"]["grpc_services"]
                [0]["envoy_grpc"]["cluster_name"],
            "sds-grpc"
        );
        assert_eq!(
            c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
                ["port_value"],
            8080
        );
        let (plain, _) = inbound_resources(8080, 15006, false).expect("resources");
        assert!(plain["filter_chains"][0].get("transport_socket").is_none());
    }
}
