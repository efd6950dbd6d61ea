//! The sidecar itself: the `remora-proxy` container (its env, probes,
//! ports, mounts, security context and lifecycle hooks), the workload CA's
//! wiring into it, and the volumes it needs.

use std::time::Duration;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, DownwardAPIVolumeFile,
    DownwardAPIVolumeSource, EmptyDirVolumeSource, EnvVar, EnvVarSource, ExecAction, HTTPGetAction,
    KeyToPath, Lifecycle, LifecycleHandler, ObjectFieldSelector, Probe, ProjectedVolumeSource,
    SeccompProfile, SecurityContext, ServiceAccountTokenProjection, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use remora_contract::duration::format as format_duration;
use remora_contract::pod::{
    HEALTH_PORT, HOOK_DIR, HOOK_VOLUME, PODINFO_DIR, PODINFO_VOLUME, PROXY_CONTAINER, PROXY_UID,
    READY_PATH, RUN_DIR, RUN_VOLUME,
};
use remora_contract::{discovery, env as env_name, workload_ca};
use remora_crds::SidecarMode;

use crate::resolve::{EffectiveConfig, WorkloadCaWiring};

/// The `remora-proxy` container for the chosen (concrete) mode.
pub fn proxy_container(cfg: &EffectiveConfig, mode: SidecarMode, deadline: Duration) -> Container {
    let d = format_duration;
    let startup_timeout = d(cfg.startup_timeout);
    let env = vec![
        field_env(env_name::POD_NAME, "metadata.name"),
        field_env(env_name::POD_NAMESPACE, "metadata.namespace"),
        field_env(env_name::INSTANCE_IP, "status.podIP"),
        field_env(env_name::SERVICE_ACCOUNT, "spec.serviceAccountName"),
        env(env_name::CONCURRENCY, cfg.concurrency.to_string()),
        env(env_name::LOG_LEVEL, cfg.log_level.as_str().to_string()),
        env(env_name::DRAIN_DURATION, d(cfg.drain_duration)),
        env(
            env_name::TERMINATION_DRAIN_DURATION,
            d(cfg.termination_drain_duration),
        ),
        env(
            env_name::EXIT_ON_ZERO_ACTIVE_CONNECTIONS,
            cfg.exit_on_zero_active_connections.to_string(),
        ),
        env(
            env_name::MINIMUM_DRAIN_DURATION,
            d(cfg.minimum_drain_duration),
        ),
        env(env_name::DRAIN_MODE, cfg.drain_mode.as_str().to_string()),
        env(env_name::QUIET_PERIOD, d(cfg.quiet_period)),
        env(env_name::WITHDRAWAL_TIMEOUT, d(cfg.withdrawal_timeout)),
        env(env_name::DRAIN_DEADLINE, d(deadline)),
        env(env_name::RUN_DIR, RUN_DIR.into()),
        env(
            env_name::ANNOTATIONS_FILE,
            remora_contract::pod::ANNOTATIONS_FILE.into(),
        ),
        env(env_name::HOOK_DIR, HOOK_DIR.into()),
    ];
    let mut c = Container {
        name: PROXY_CONTAINER.into(),
        image: Some(cfg.image.clone()),
        image_pull_policy: Some(cfg.image_pull_policy.clone()),
        command: Some(vec!["remora-agent".into()]),
        args: Some(vec!["run".into()]),
        env: Some(env),
        ports: Some(vec![
            ContainerPort {
                name: Some(remora_contract::pod::HEALTH_PORT_NAME.into()),
                container_port: i32::from(HEALTH_PORT),
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            ContainerPort {
                name: Some(remora_contract::pod::STATS_PORT_NAME.into()),
                container_port: i32::from(remora_contract::pod::STATS_PORT),
                protocol: Some("TCP".into()),
                ..Default::default()
            },
        ]),
        readiness_probe: Some(Probe {
            period_seconds: Some(2),
            timeout_seconds: Some(1),
            failure_threshold: Some(3),
            ..ready_probe()
        }),
        resources: Some(cfg.resources.clone()),
        security_context: Some(SecurityContext {
            run_as_user: Some(PROXY_UID),
            run_as_group: Some(PROXY_UID),
            run_as_non_root: Some(true),
            read_only_root_filesystem: Some(true),
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        volume_mounts: Some(vec![
            VolumeMount {
                name: RUN_VOLUME.into(),
                mount_path: RUN_DIR.into(),
                ..Default::default()
            },
            VolumeMount {
                name: PODINFO_VOLUME.into(),
                mount_path: PODINFO_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
            VolumeMount {
                name: HOOK_VOLUME.into(),
                mount_path: HOOK_DIR.into(),
                ..Default::default()
            },
        ]),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    };
    match mode {
        SidecarMode::Native => {
            c.restart_policy = Some("Always".into());
            if cfg.hold_application_until_proxy_starts {
                // The kubelet starts the next container only once this probe
                // passes: its budget (period x threshold) is startup.timeout.
                let secs = cfg.startup_timeout.as_secs().max(1);
                c.startup_probe = Some(Probe {
                    period_seconds: Some(1),
                    timeout_seconds: Some(1),
                    failure_threshold: Some(i32::try_from(secs).unwrap_or(i32::MAX)),
                    ..ready_probe()
                });
            }
        }
        _ => {
            c.lifecycle = Some(Lifecycle {
                // The kubelet runs the next container only after this hook
                // returns: that is what holds the application.
                post_start: cfg
                    .hold_application_until_proxy_starts
                    .then(|| exec(&["remora-agent", "wait", "--timeout", &startup_timeout])),
                pre_stop: Some(exec(&["remora-agent", "drain", "--timeout", &d(deadline)])),
                ..Default::default()
            });
        }
    }
    c
}

/// Point the sidecar at the workload CA: its address and trust domain, the
/// projected token it proves its service account with, and the trust bundle
/// that verifies the CA (and, in mTLS, its peers).
pub(crate) fn wire_workload_ca(container: &mut Container, ca: &WorkloadCaWiring) {
    container.env.get_or_insert_with(Vec::new).extend([
        env(env_name::CA_ADDRESS, ca.address.clone()),
        env(
            env_name::CA_ROOT_CERT,
            workload_ca::TRUST_BUNDLE_PATH.into(),
        ),
        env(env_name::TOKEN_PATH, workload_ca::TOKEN_PATH.into()),
        env(env_name::TRUST_DOMAIN, ca.trust_domain.clone()),
        env(env_name::CERT_TTL, format_duration(ca.cert_ttl)),
    ]);
    let envs = container.env.get_or_insert_with(Vec::new);
    if let Some(name) = &ca.server_name {
        envs.push(env(env_name::CA_SERVER_NAME, name.clone()));
    }
    // The discovery server shows the CA's certificate: the same name checks it.
    if let Some(address) = &ca.discovery {
        envs.push(env(env_name::DISCOVERY_ADDRESS, address.clone()));
        envs.push(env(
            env_name::DISCOVERY_TOKEN_PATH,
            discovery::TOKEN_PATH.into(),
        ));
        if let Some(name) = &ca.server_name {
            envs.push(env(env_name::DISCOVERY_SERVER_NAME, name.clone()));
        }
    }
    container
        .volume_mounts
        .get_or_insert_with(Vec::new)
        .extend([
            VolumeMount {
                name: workload_ca::TOKEN_VOLUME.into(),
                mount_path: workload_ca::TOKEN_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
            VolumeMount {
                name: workload_ca::TRUST_BUNDLE_VOLUME.into(),
                mount_path: workload_ca::TRUST_BUNDLE_DIR.into(),
                read_only: Some(true),
                ..Default::default()
            },
        ]);
}

/// The volumes the sidecar needs, in the order they are added to the pod;
/// the workload CA's only when it is wired.
pub(crate) fn sidecar_volumes(workload_ca: Option<&WorkloadCaWiring>) -> Vec<Volume> {
    let mut volumes = vec![run_volume(), podinfo_volume(), hook_volume()];
    if let Some(ca) = workload_ca {
        volumes.extend([token_volume(ca.discovery.is_some()), trust_bundle_volume()]);
    }
    volumes
}

/// The app hook's volume: the helper binary and the file with its token,
/// written by the sidecar at start. On disk (the helper is not small), not
/// counted against the pod's memory.
fn hook_volume() -> Volume {
    Volume {
        name: HOOK_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }
}

fn run_volume() -> Volume {
    Volume {
        name: RUN_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: Some("Memory".into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn podinfo_volume() -> Volume {
    Volume {
        name: PODINFO_VOLUME.into(),
        downward_api: Some(DownwardAPIVolumeSource {
            items: Some(vec![DownwardAPIVolumeFile {
                path: "annotations".into(),
                field_ref: Some(ObjectFieldSelector {
                    field_path: "metadata.annotations".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The pod's service-account tokens for the CA and (when on) the discovery
/// server, one audience each: a token one of them is shown cannot be
/// replayed to the other, and the API server (and everything else) refuses
/// both. The kubelet renews them. Projected, so they are there even with
/// `automountServiceAccountToken: false`.
fn token_volume(discovery: bool) -> Volume {
    let token = |audience: &str, path: &str| VolumeProjection {
        service_account_token: Some(ServiceAccountTokenProjection {
            audience: Some(audience.into()),
            expiration_seconds: Some(workload_ca::TOKEN_EXPIRATION_SECONDS),
            path: path.into(),
        }),
        ..Default::default()
    };
    let mut sources = vec![token(workload_ca::TOKEN_AUDIENCE, workload_ca::TOKEN_FILE)];
    if discovery {
        sources.push(token(discovery::TOKEN_AUDIENCE, discovery::TOKEN_FILE));
    }
    Volume {
        name: workload_ca::TOKEN_VOLUME.into(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(sources),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The namespace's trust-bundle ConfigMap. Not optional: the pod waits for
/// it rather than start a sidecar that cannot verify the CA.
fn trust_bundle_volume() -> Volume {
    Volume {
        name: workload_ca::TRUST_BUNDLE_VOLUME.into(),
        config_map: Some(ConfigMapVolumeSource {
            name: workload_ca::TRUST_BUNDLE_CONFIGMAP.into(),
            items: Some(vec![KeyToPath {
                key: workload_ca::TRUST_BUNDLE_KEY.into(),
                path: workload_ca::TRUST_BUNDLE_KEY.into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn field_env(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub(crate) fn env(name: &str, value: String) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value),
        ..Default::default()
    }
}

fn ready_probe() -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(READY_PATH.into()),
            port: IntOrString::Int(i32::from(HEALTH_PORT)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub(crate) fn exec(cmd: &[&str]) -> LifecycleHandler {
    LifecycleHandler {
        exec: Some(ExecAction {
            command: Some(cmd.iter().map(|s| s.to_string()).collect()),
        }),
        ..Default::default()
    }
}
