//! `remora-operator serve`: builds a replica from its flags and wires it:
//! the webhook (and the workload CA) on every replica, the leader's tasks
//! ([`crate::leader::tasks`]) only on the elected one.
//!
//! Shutdown ([`Runtime`]): on the first SIGTERM or SIGINT the elector stops
//! the leader-only work and releases the Lease (a standby takes over at its
//! next try), the webhook server stops accepting and lets in-flight requests
//! finish for up to `--shutdown-grace`, and the reflectors, certificate
//! reloader and caBundle keeper stop. A second signal aborts at once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use prometheus_client::registry::Registry;

use crate::flags::ServeArgs;
use crate::leader::tasks::{LeaderContext, TrustBundle, lead_apart};
use crate::leader::{self, LeaderError};
use crate::runtime::{Runtime, RuntimeError};
use crate::webhook::handler::Injector;
use crate::webhook::server::{
    AppState, METRICS_PREFIX, ReviewBudget, ServerError, router, webhook_server,
};
use crate::webhook::tls::{ReloadingCert, TlsError};

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("connecting to the Kubernetes API: {0}")]
    Connect(#[source] kube::Error),
    #[error("self-managed certificate: {0}")]
    Ca(#[from] crate::pki::webhook_cert::CaError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Cluster(#[from] crate::cluster::view::ClusterError),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Leader(#[from] LeaderError),
    #[error("webhook server: {0}")]
    Server(#[from] ServerError),
    #[error("workload CA: {0}")]
    WorkloadCa(String),
}

/// Serve until SIGTERM/SIGINT; `Err` on a second signal.
pub async fn serve(args: ServeArgs) -> Result<(), AppError> {
    let rt = Runtime::with_signals(args.shutdown_grace)?;
    rt.run(run(args, &rt)).await
}

/// Serve until shutdown, then drain (see the module doc).
pub async fn run(args: ServeArgs, rt: &Runtime) -> Result<(), AppError> {
    let shutdown = rt.shutdown_token();
    let leader_cfg = args.leader_config();
    if args.leader_elect {
        // Bad timings fail the start, not the first election.
        leader_cfg.validate()?;
    }
    // Registered below with the others; the rotation starts before.
    let ca_metrics = crate::pki::webhook_cert::Metrics::default();
    let started = tokio::select! {
        biased;
        () = shutdown.cancelled() => {
            tracing::info!("shut down before serving");
            return Ok(());
        }
        r = start(&args, rt, ca_metrics.clone()) => r?,
    };
    let Started {
        kube_config,
        client,
        tls,
        listener,
        view,
    } = started;
    let mut workload_ca = args
        .workload_ca
        .wiring(&args.service_name, &args.operator_namespace);
    if let Some(ca) = &mut workload_ca
        && args.discovery.enabled
    {
        ca.discovery = Some(format!(
            "{}.{}.svc:{}",
            args.service_name,
            args.operator_namespace,
            remora_contract::discovery::PORT
        ));
    }
    if let Some(ca) = &mut workload_ca
        && args
            .workload_ca
            .address
            .as_deref()
            .unwrap_or_default()
            .is_empty()
    {
        dial_by_cluster_ip(&client, &args, ca).await;
    }
    let chart = remora_inject::resolve::ChartDefaults {
        workload_ca,
        ..args.proxy.chart(args.default_mode)
    };
    // Not ready (out of the Service) until the first listing is in, even
    // when the sync timeout let the server start without it.
    let synced = rt.not_ready_until("cluster-view", "listing SidecarLifecycles and namespaces");
    {
        let view = view.clone();
        rt.spawn_until_shutdown("cluster-view-synced", async move {
            view.wait_synced().await;
            synced.ready();
        });
    }
    // One registry; each component registers its own metrics in it.
    let mut registry = Registry::with_prefix(METRICS_PREFIX);
    let webhook_metrics = crate::webhook::handler::Metrics::register(&mut registry);
    let controller_metrics = crate::controllers::lifecycle::Metrics::register(&mut registry);
    let jobs_metrics = crate::controllers::jobs::Metrics::register(&mut registry);
    let pod_watch_metrics = crate::cluster::live_pod::Metrics::register(&mut registry);
    let leader_metrics = leader::Metrics::register(&mut registry);
    if args.self_signed {
        ca_metrics.register(&mut registry);
    }
    let trust_bundle = match &args.workload_ca.enabled {
        true => {
            Some(start_workload_ca(&args, &client, &kube_config, &view, &mut registry, rt).await?)
        }
        false => None,
    };
    // Discovery needs pods on every replica: then the process has one pod
    // watch, which the leader's controllers share.
    let (pods, external_status) = match (&trust_bundle, args.discovery.enabled) {
        (Some(tb), true) => {
            let pods = crate::cluster::live_pod::live_pods(
                client.clone(),
                pod_watch_metrics.clone(),
                rt.shutdown_token().clone(),
            );
            let external_status =
                start_discovery(&args, &client, &kube_config, &mut registry, rt, tb, &pods).await?;
            (Some(pods), external_status)
        }
        _ => (None, None),
    };
    let server = webhook_server(tls, args.shutdown_grace, Some(&mut registry));
    let ctx = Arc::new(LeaderContext {
        kube: kube_config,
        controller: args
            .controller
            .then(|| crate::controllers::lifecycle::Settings {
                chart: chart.clone(),
                operator_namespace: args.operator_namespace.clone(),
                rollout_interval: args.rollout_interval,
                automatic_rollouts: args.automatic_rollouts,
                identity: leader_cfg.identity.clone(),
                qps: args.kube_api_qps,
                burst: args.kube_api_burst,
            }),
        controller_metrics,
        stop_completed_jobs: args.stop_completed_jobs,
        jobs_metrics,
        pod_watch_metrics,
        pods,
        identity: leader_cfg.identity.clone(),
        lifecycles: view.lifecycle_watch(),
        trust_bundle,
        trust_bundle_period: Duration::from_secs(5),
        external_status,
    });
    let state = Arc::new(AppState {
        injector: Injector {
            chart,
            operator_namespace: args.operator_namespace.clone(),
            view: Arc::new(crate::webhook::view::LookingUpView::new(
                view,
                client.clone(),
                crate::webhook::view::NAMESPACE_LOOKUP_TIMEOUT,
            )),
        },
        metrics: webhook_metrics,
        registry,
        max_body_bytes: args.max_request_bytes,
        readiness: rt.readiness().clone(),
        budget: ReviewBudget::new(args.review_memory_budget),
    });
    tracing::info!(listen = %args.listen, "remora-operator serving");

    // A server that failed takes the rest down the same way.
    let server = rt.shut_down_after(async {
        match server {
            Ok(server) => server
                .serve(listener, router(state), shutdown.clone().cancelled_owned())
                .await
                .map_err(ServerError::from),
            Err(e) => Err(e),
        }
    });
    let controller = async {
        if args.leader_elect {
            tracing::info!(identity = %leader_cfg.identity, lease = %format!("{}/{}", leader_cfg.namespace, leader_cfg.lease_name),
                "campaigning for leadership");
            leader::run_elected(
                client,
                leader_cfg,
                Some(leader_metrics),
                shutdown.clone(),
                move |token| lead_apart(Arc::clone(&ctx), token),
            )
            .await
        } else {
            lead_apart(ctx, shutdown.child_token()).await;
            Ok(())
        }
    };
    let (served, elected) = tokio::join!(server, controller);
    let drained = served?;
    elected?;
    tracing::info!(
        forced_connections = drained.forced,
        "remora-operator stopped"
    );
    Ok(())
}

/// Start this replica's workload CA: the signing-root keeper and the gRPC
/// server, both until shutdown. Not ready until it has a root. Returns
/// what the leader needs to distribute the trust bundle.
async fn start_workload_ca(
    args: &ServeArgs,
    client: &Client,
    kube_config: &kube::Config,
    view: &crate::cluster::view::KubeView,
    registry: &mut Registry,
    rt: &Runtime,
) -> Result<TrustBundle, AppError> {
    use crate::pki::workload_ca::{self as ca, authn, keeper, service};
    let ca_args = &args.workload_ca;
    let metrics = ca::Metrics::register(registry);
    let (tx, rx) = tokio::sync::watch::channel(None);
    let keeper = keeper::Keeper {
        secrets: kube::Api::namespaced(client.clone(), &args.operator_namespace),
        name: ca_args.secret.clone(),
        policy: ca_args.root_policy(),
        names: ca::serving_names(
            &args.service_name,
            &ca_args.service_aliases,
            &args.operator_namespace,
        ),
        period: ca_args.keeper_period(),
        metrics: metrics.clone(),
    };
    rt.spawn(
        "workload-ca-keeper",
        keeper.run(tx, rt.shutdown_token().clone()),
    );
    let ready = rt.not_ready_until("workload-ca", "reading or making the signing root");
    rt.spawn_until_shutdown(
        "workload-ca-readiness",
        ca::follow_readiness(rx.clone(), ready),
    );
    let listener = remora_serve::bind(ca_args.listen).map_err(|source| AppError::Bind {
        addr: ca_args.listen,
        source,
    })?;
    // TokenReviews on a client (and connections) of their own, behind the
    // gate's rate limits, so that a flood of them cannot queue ahead of the
    // Lease renewals and watches on the main client.
    let review_client = Client::try_from(kube_config.clone()).map_err(AppError::Connect)?;
    let audience = remora_contract::workload_ca::TOKEN_AUDIENCE;
    let svc = service::CaService {
        auth: authn::TokenReviewer::new(review_client, audience),
        gate: authn::Gate::new(audience, authn::GateLimits::default()),
        authority: rx.clone(),
        trust_domain: ca_args.trust_domain.clone(),
        lifetimes: service::Lifetimes {
            default: ca_args.cert_ttl,
            max: ca_args.cert_max_ttl,
        },
        metrics,
        events: Some(pod_events(client, args)),
    };
    let limits = ca::serve::Limits {
        max_in_flight: usize::try_from(ca_args.max_in_flight).unwrap_or(usize::MAX),
        ..ca::serve::Limits::default()
    };
    rt.spawn(
        "workload-ca-server",
        ca::serve::serve(listener, svc, limits, rt.shutdown_token().clone()),
    );
    tracing::info!(listen = %ca_args.listen, trust_domain = %ca_args.trust_domain, "workload CA serving");
    let signing = crate::controllers::trust_bundle::SigningSecret {
        namespace: args.operator_namespace.clone(),
        name: ca_args.secret.clone(),
    };
    Ok(TrustBundle {
        authority: rx,
        view: view.clone(),
        signing,
    })
}

/// Start this replica's discovery server until shutdown: the Service and
/// EndpointSlice watches, the registry fed from them and from `pods`, the
/// debounce, and the ADS server with the workload CA's serving certificate
/// (`--discovery` requires `--workload-ca`, see flags). Not ready until
/// the watches have listed. Returns what the leader needs to write
/// ExternalServices' status, when the API server serves them.
async fn start_discovery(
    args: &ServeArgs,
    client: &Client,
    kube_config: &kube::Config,
    registry: &mut Registry,
    rt: &Runtime,
    ca: &TrustBundle,
    pods: &crate::cluster::watch::SharedWatch<crate::cluster::live_pod::LivePod>,
) -> Result<Option<crate::leader::tasks::ExternalStatus>, AppError> {
    use crate::discovery::{self, feed, push, serve, server};
    use crate::pki::workload_ca::{ServingCert, authn};
    let d_args = &args.discovery;
    let metrics = discovery::Metrics::register(registry);
    // Discovery requires the workload CA (see flags): calls between meshed
    // workloads are mTLS, with secure naming.
    let (state, debounce) = push::Discovery::with_push_throttle(
        &d_args.cluster_domain,
        Some(&args.workload_ca.trust_domain),
        push::Debounce {
            quiet: d_args.debounce_quiet,
            max_delay: d_args.debounce_max,
        },
        d_args.push_throttle,
    );
    state.withdrawals.metrics.register(registry);
    rt.spawn_until_shutdown("discovery-debounce", debounce);
    // ExternalServices of the operator's namespace may claim any host.
    let mesh_ns = args.operator_namespace.clone();
    // The other replicas, which a withdrawn pod's agent asks too: the
    // ready pods of this Service, this one (POD_NAME) left out; without
    // POD_NAME this replica cannot tell itself apart and names none.
    let replicas = args
        .leader_identity
        .clone()
        .map(|own_pod| discovery::registry::Replicas {
            service: remora_contract::discovery::ServiceHost {
                name: args.service_name.clone(),
                namespace: args.operator_namespace.clone(),
            },
            own_pod,
        });
    if replicas.is_none() {
        tracing::warn!(
            "discovery: no POD_NAME, so withdrawals name no other replica (right with one replica only)"
        );
    }
    state.update(|r| {
        r.set_mesh_namespace(Some(mesh_ns));
        r.set_replicas(replicas);
        Vec::new()
    });
    let externals = feed::externals_served(client).await;
    let watches =
        feed::Watches::start(client, pods.clone(), externals, rt.shutdown_token().clone());
    watches.feed(&state);
    let external_status =
        watches
            .externals
            .as_ref()
            .map(|x| crate::leader::tasks::ExternalStatus {
                discovery: Arc::clone(&state),
                services: x.services.clone(),
            });
    let synced = rt.not_ready_until(
        "discovery",
        "discovery caches synced (Services, EndpointSlices, pods, external services)",
    );
    rt.spawn_until_shutdown("discovery-synced", async move {
        watches.synced().await;
        synced.ready();
    });
    let listener = remora_serve::bind(d_args.listen).map_err(|source| AppError::Bind {
        addr: d_args.listen,
        source,
    })?;
    // TokenReviews on a client of their own, as the CA's.
    let review_client = Client::try_from(kube_config.clone()).map_err(AppError::Connect)?;
    let audience = remora_contract::discovery::TOKEN_AUDIENCE;
    let svc = server::AdsService {
        auth: authn::TokenReviewer::new(review_client, audience),
        gate: authn::Gate::new(audience, authn::GateLimits::default()),
        discovery: state,
        metrics,
        events: Some(pod_events(client, args)),
        shutdown: rt.shutdown_token().clone(),
        pod_wait: server::POD_WAIT,
    };
    let certs = Arc::new(ServingCert(ca.authority.clone()));
    rt.spawn(
        "discovery-server",
        serve::serve(
            listener,
            svc,
            certs,
            serve::limits(),
            rt.shutdown_token().clone(),
        ),
    );
    tracing::info!(listen = %d_args.listen, "discovery serving");
    Ok(external_status)
}

/// Warning Events on pods from the servers that answer them (the CA's
/// refusals, the discovery server's NACKs), as this replica.
fn pod_events(client: &Client, args: &ServeArgs) -> crate::pod_events::PodEvents {
    crate::pod_events::PodEvents::new(kube::runtime::events::Recorder::new(
        client.clone(),
        kube::runtime::events::Reporter {
            controller: crate::identity::FIELD_MANAGER.into(),
            instance: Some(args.leader_config().identity),
        },
    ))
}

/// Sidecars dial the CA at its Service's ClusterIP and check its
/// certificate under the Service's DNS name: a cluster without DNS for
/// Services (or a pod with its own resolver) still reaches it. Without the
/// Service (or the right to read it) they dial the DNS name.
async fn dial_by_cluster_ip(
    client: &Client,
    args: &ServeArgs,
    ca: &mut remora_inject::resolve::WorkloadCaWiring,
) {
    let services: kube::Api<k8s_openapi::api::core::v1::Service> =
        kube::Api::namespaced(client.clone(), &args.operator_namespace);
    match services.get_opt(&args.service_name).await {
        Ok(Some(svc)) => {
            let ip = svc
                .spec
                .and_then(|s| s.cluster_ip)
                .and_then(|ip| ip.parse::<std::net::IpAddr>().ok());
            if let Some(ip) = ip {
                let name = format!("{}.{}.svc", args.service_name, args.operator_namespace);
                ca.address =
                    std::net::SocketAddr::new(ip, remora_contract::workload_ca::PORT).to_string();
                if ca.discovery.is_some() {
                    ca.discovery = Some(
                        std::net::SocketAddr::new(ip, remora_contract::discovery::PORT).to_string(),
                    );
                }
                ca.server_name = Some(name);
            }
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(error = %e, service = %args.service_name, "workload CA: cannot read the Service; sidecars dial its DNS name");
        }
    }
    tracing::info!(address = %ca.address, discovery = ?ca.discovery, server_name = ?ca.server_name, "workload CA: the address sidecars dial");
}

/// The API server's config, from the in-cluster config or KUBECONFIG,
/// naming the operator in `User-Agent` so that the API server's audit log
/// and flow control tell its requests apart (kube-rs sends none of its own).
async fn kube_config(args: &ServeArgs) -> Result<kube::Config, AppError> {
    let mut config = kube::Config::infer()
        .await
        .map_err(|e| AppError::Connect(kube::Error::InferConfig(e)))?;
    let agent = match &args.leader_identity {
        Some(pod) => format!("remora-operator/{} ({pod})", env!("CARGO_PKG_VERSION")),
        None => format!("remora-operator/{}", env!("CARGO_PKG_VERSION")),
    };
    // A pod name that is not a valid header value is sent without it.
    let agent = http::HeaderValue::from_str(&agent).unwrap_or_else(|_| {
        http::HeaderValue::from_static(concat!("remora-operator/", env!("CARGO_PKG_VERSION")))
    });
    config.headers.push((http::header::USER_AGENT, agent));
    Ok(config)
}

struct Started {
    kube_config: kube::Config,
    client: Client,
    tls: Arc<rustls::ServerConfig>,
    listener: tokio::net::TcpListener,
    view: crate::cluster::view::KubeView,
}

/// Everything before serving: certificates, the cluster view, the listener.
/// The background tasks it starts stop at shutdown.
async fn start(
    args: &ServeArgs,
    rt: &Runtime,
    ca_metrics: crate::pki::webhook_cert::Metrics,
) -> Result<Started, AppError> {
    let kube_config = kube_config(args).await?;
    let client = Client::try_from(kube_config.clone()).map_err(AppError::Connect)?;
    let (cert_path, key_path) = if args.self_signed {
        let validity = crate::pki::webhook_cert::Validity {
            ca: args.ca_validity,
            serving: args.serving_cert_validity,
        };
        validity
            .validate()
            .map_err(crate::pki::webhook_cert::CaError::Validity)?;
        args.check()
            .map_err(crate::pki::webhook_cert::CaError::Validity)?;
        let pickup = args
            .tls_secret_resync
            .saturating_add(args.cert_reload_interval);
        let bundle = crate::pki::webhook_cert::ensure_secret(
            &client,
            &args.operator_namespace,
            &args.tls_secret,
            &args.service_name,
            validity,
        )
        .await?;
        let (bundle_tx, bundle_rx) = tokio::sync::watch::channel(bundle.ca_pem.clone());
        let secrets = kube::Api::namespaced(client.clone(), &args.operator_namespace);
        rt.spawn_until_shutdown(
            "ca-bundle-keeper",
            crate::pki::webhook_cert::keep_ca_bundle(
                client.clone(),
                args.webhook_config.clone(),
                secrets.clone(),
                args.tls_secret.clone(),
                args.tls_secret_resync,
                bundle_rx,
            ),
        );
        let rotator = crate::pki::webhook_cert::Rotator {
            store: crate::pki::webhook_cert::KubeStore {
                secrets,
                secret: args.tls_secret.clone(),
                webhook_configs: kube::Api::all(client.clone()),
                webhook_config: args.webhook_config.clone(),
                recorder: Some(kube::runtime::events::Recorder::new(
                    client.clone(),
                    kube::runtime::events::Reporter {
                        controller: crate::identity::FIELD_MANAGER.into(),
                        instance: Some(args.leader_config().identity),
                    },
                )),
            },
            secret: args.tls_secret.clone(),
            namespace: args.operator_namespace.clone(),
            names: crate::pki::webhook_cert::service_names(
                &args.service_name,
                &args.operator_namespace,
            ),
            // Every replica has loaded a new certificate within `pickup`;
            // a third of the serving lifetime is more (checked above).
            policy: crate::pki::webhook_cert::Policy {
                validity,
                overlap: validity.serving / 3,
                settle: pickup,
            },
            dir: args.self_signed_dir.clone(),
            period: args.tls_secret_resync,
            clock: crate::pki::webhook_cert::Clock::System,
            metrics: ca_metrics,
        };
        rt.spawn_until_shutdown(
            "webhook-cert-rotation",
            rotator.run(bundle.clone(), bundle_tx),
        );
        crate::pki::webhook_cert::write_files(&args.self_signed_dir, &bundle)?
    } else {
        (args.tls_cert.clone(), args.tls_key.clone())
    };
    let cert = ReloadingCert::load(cert_path, key_path)?;
    rt.spawn_until_shutdown(
        "serving-cert-reload",
        Arc::clone(&cert).reload_every(args.cert_reload_interval),
    );
    let tls = Arc::new(cert.server_config()?);
    let view = crate::cluster::view::start(
        client.clone(),
        args.sync_timeout,
        rt.shutdown_token().clone(),
    )
    .await?;
    let listener = remora_serve::bind(args.listen).map_err(|source| AppError::Bind {
        addr: args.listen,
        source,
    })?;
    Ok(Started {
        kube_config,
        client,
        tls,
        listener,
        view,
    })
}
