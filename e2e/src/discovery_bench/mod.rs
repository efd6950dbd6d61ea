//! Remora's discovery push side by side with Istio's real pilot-discovery
//! (istiod), both fed by the same real API server (issue 29, "Measured").
//!
//! The bench writes S selector-less Services (`svc-0`.., plus `shared` and
//! `rollout`) with hand-written EndpointSlices (managed-by
//! `discovery-bench`, no pods) into a namespace of its own. Remora's
//! discovery server runs as a child process fed by real watches of that
//! API server ([`remora`] names its two stand-ins: proxies put in its
//! registry rather than read from pods, and a TokenReview double); istiod
//! runs on the host ([`istiod`]). N simulated proxies per contender
//! ([`proxy`]: real gRPC ADS clients from a loopback address each, ACKing
//! like Envoy) declare `shared`, `svc-(i % S)` and `rollout`: Remora serves
//! them only those; istiod by default serves every Service of the cluster;
//! at its best ([`Contender::IstiodSidecars`]) one Sidecar resource per
//! workload scopes each proxy's egress to the same three.
//!
//! Contenders are measured in turn within each cycle (the order rotated
//! from cycle to cycle); every contender runs throughout, so the idle ones
//! follow the same writes meanwhile (watch and debounce, no proxies).
//! Measured: one EndpointSlice write → the last dependent ACKed an EDS
//! response carrying the new endpoint (a Service with N/S dependents, and
//! `shared` with N); a rollout of `--rollout-pods` endpoint changes, one
//! write each `--rollout-step-ms` apart (EDS responses per proxy, last
//! write → all N ACKed); each contender's CPU seconds and RSS from /proc;
//! istiod's own `pilot_proxy_convergence_time`.
//!
//! Not covered: Envoy's own apply time (the clients ACK at once); RDS
//! (not subscribed: endpoint changes do not touch it); Remora's TokenReview
//! and pod watch of the proxies (stand-ins, see [`remora`]); istiod's TLS
//! (its proxies use the plaintext port; Remora's use TLS); the API server's own cost (shared
//! by both); more than one replica of either; a machine of its own (2
//! shared cores: the clients, the API server and both contenders share
//! them).

pub mod cluster;
pub mod confirmation;
pub mod istiod;
pub mod proxy;
pub mod remora;
pub mod report;
pub mod usage;
pub mod withdrawal;

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kube::Client;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::controlplane::process::Janitor;
use istiod::{Histogram, Istiod, Ports};
use proxy::{Board, Identity, Target, Xds};
use remora::RemoraProcess;
use usage::Usage;

/// The bench's configuration (and, with `--serve-remora`, its child's).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "discovery-bench")]
pub struct Args {
    /// Simulated proxies per contender; each N is a run of its own.
    #[arg(long, value_delimiter = ',', default_values_t = [100usize, 1000])]
    pub proxies: Vec<usize>,
    /// Services besides `shared` and `rollout`; proxy i declares svc-(i % S).
    #[arg(long, default_value_t = 100)]
    pub services: usize,
    /// Cycles; in each, every contender is measured in turn.
    #[arg(long, default_value_t = 3)]
    pub cycles: usize,
    /// Endpoint changes per case per contender per cycle.
    #[arg(long, default_value_t = 5)]
    pub changes: usize,
    /// Endpoints of `rollout`, each replaced once per rollout.
    #[arg(long, default_value_t = 100)]
    pub rollout_pods: usize,
    /// Between two writes of the rollout (ms).
    #[arg(long, default_value_t = 10)]
    pub rollout_step_ms: u64,
    /// What the proxies speak: state of the world, or delta (the agent's
    /// default), to every contender.
    #[arg(long, value_enum, default_value_t = Xds::Sotw)]
    pub protocol: Xds,
    /// Which contenders, in the first cycle's order.
    #[arg(long, value_delimiter = ',', default_values_t = [Contender::Remora, Contender::Istiod, Contender::IstiodSidecars])]
    pub contenders: Vec<Contender>,
    /// pilot-discovery (default: what scripts/build-pilot-discovery.sh built).
    #[arg(long)]
    pub pilot_discovery: Option<PathBuf>,
    /// Istio's CRDs (default: beside pilot-discovery, as the script caches them).
    #[arg(long)]
    pub istio_crds: Option<PathBuf>,
    /// istiod's environment beyond PEERS.md's (e.g. PILOT_DEBOUNCE_AFTER=50ms), repeatable.
    #[arg(long = "istiod-env", value_parser = key_value)]
    pub istiod_env: Vec<(String, String)>,
    /// The API server both contenders watch; without it, a local control
    /// plane of its own (`e2e::controlplane`, no controller manager: no
    /// EndpointSlice controller and no pod garbage collector act on the
    /// bench's objects), stopped at the end.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// What to measure: the push (issue 29), or confirmed removal's
    /// convergence (issue 30, [`withdrawal`]).
    #[arg(long, value_enum, default_value_t = Section::Push)]
    pub only: Section,
    /// Withdrawal: rollouts per N per contender (each deletes every one of
    /// the `--rollout-pods` callee pods in turn).
    #[arg(long, default_value_t = 3)]
    pub rollouts: usize,
    /// The bench's namespace (created, then deleted).
    #[arg(long, default_value = "discovery-bench")]
    pub namespace: String,
    #[arg(long, default_value_t = 15010)]
    pub istiod_grpc_port: u16,
    #[arg(long, default_value_t = 18080)]
    pub istiod_http_port: u16,
    #[arg(long, default_value_t = 15014)]
    pub istiod_monitoring_port: u16,
    /// The results file (default: `bench/results/discovery-istiod.json`,
    /// or `withdrawal-convergence.json` with `--only withdrawal`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Internal: run Remora's discovery server for the bench, writing its
    /// address and CA bundle into this directory.
    #[arg(long, hide = true)]
    pub serve_remora: Option<PathBuf>,
}

/// What a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Section {
    /// Endpoint changes and a rollout of EndpointSlice writes.
    Push,
    /// Callee pods deleted one by one: deletion → every proxy stopped
    /// routing to the pod (and, for Remora, the pod's agent told so).
    Withdrawal,
}

impl Args {
    /// Where the results go.
    pub fn out(&self) -> PathBuf {
        self.out.clone().unwrap_or_else(|| {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/results")).join(match self
                .only
            {
                Section::Push => "discovery-istiod.json",
                Section::Withdrawal => "withdrawal-convergence.json",
            })
        })
    }
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Contender {
    /// Remora's discovery server at the operator's defaults.
    Remora,
    /// istiod at its defaults: no Sidecar resource, every proxy gets every Service.
    Istiod,
    /// istiod with a Sidecar resource per workload scoping its egress.
    IstiodSidecars,
}

impl std::fmt::Display for Contender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Remora => "remora",
            Self::Istiod => "istiod",
            Self::IstiodSidecars => "istiod-sidecars",
        })
    }
}

/// Where Remora's child writes its live heap (bytes), in its directory.
pub const HEAP_FILE: &str = "heap";

pub const SHARED: &str = "shared";
pub const ROLLOUT: &str = "rollout";

pub fn service_name(j: usize) -> String {
    format!("svc-{j}")
}

/// The proxies of a run, and the Services each declared.
pub fn plan(namespace: &str, proxies: usize, services: usize) -> Vec<(Identity, Vec<String>)> {
    (0..proxies)
        .map(|i| {
            let j = i % services;
            (
                Identity {
                    index: i,
                    ip: proxy::proxy_ip(i),
                    namespace: namespace.to_string(),
                    workload: format!("w-{j}"),
                },
                vec![SHARED.to_string(), service_name(j), ROLLOUT.to_string()],
            )
        })
        .collect()
}

/// Check the bounds no run may go past.
pub fn check(args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.proxies.iter().all(|&n| (1..=62_500).contains(&n)),
        "--proxies: each 1..=62500 (one loopback address each)"
    );
    anyhow::ensure!(args.services >= 1, "--services: at least 1");
    anyhow::ensure!(
        args.cycles >= 1 && args.changes >= 1,
        "--cycles and --changes: at least 1"
    );
    anyhow::ensure!(
        (1..=1000).contains(&args.rollout_pods),
        "--rollout-pods: 1..=1000 (one EndpointSlice)"
    );
    anyhow::ensure!(!args.contenders.is_empty(), "--contenders: at least one");
    anyhow::ensure!(args.rollouts >= 1, "--rollouts: at least 1");
    Ok(())
}

/// The child's whole life: Remora's server for the largest N.
pub async fn serve_remora(args: &Args, dir: PathBuf) -> anyhow::Result<()> {
    let n = args.proxies.iter().copied().max().unwrap_or(0);
    remora::serve(remora::Plan {
        proxies: plan(&args.namespace, n, args.services),
        dir,
        kubeconfig: args
            .kubeconfig
            .clone()
            .context("--kubeconfig: the child is given its parent's")?,
    })
    .await?;
    Ok(())
}

/// Fresh endpoint addresses and each Service's current ones.
struct Endpoints {
    next: u32,
    current: HashMap<String, Vec<Ipv4Addr>>,
}

impl Endpoints {
    fn fresh(&mut self) -> Ipv4Addr {
        self.next += 1;
        // 10.64.0.0/10: nothing in the cluster uses it, and a run needs few.
        Ipv4Addr::from(0x0a40_0000 + self.next)
    }

    /// Replace endpoint `k` of `service` with a fresh one; (new, all).
    fn replace(&mut self, service: &str, k: usize) -> (Ipv4Addr, Vec<Ipv4Addr>) {
        let ip = self.fresh();
        let ips = self.current.entry(service.to_string()).or_default();
        let slot = k % ips.len().max(1);
        if ips.is_empty() {
            ips.push(ip);
        } else {
            ips[slot] = ip;
        }
        (ip, ips.clone())
    }
}

/// What one phase (a contender, N, a cycle) measured.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub contender: Contender,
    pub proxies: usize,
    pub cycle: usize,
    /// EDS clusters in a proxy's CDS (median over the proxies).
    pub eds_clusters_per_proxy: usize,
    pub subscribe_seconds: f64,
    /// One Service's write → the last of its N/S dependents ACKed (ms).
    pub one_service_ms: Vec<f64>,
    pub one_service_dependents: usize,
    /// `shared`'s write → the last of all N ACKed (ms).
    pub shared_ms: Vec<f64>,
    pub rollout: Rollout,
    pub cpu_seconds: Cpu,
    /// The contender's RSS once every proxy had subscribed.
    pub rss_mib_subscribed: f64,
    /// Its peak RSS since it started (this N's run).
    pub peak_rss_mib: f64,
    /// Remora's live heap (its allocator's count) once every proxy had
    /// subscribed; none for istiod.
    pub heap_mib_subscribed: Option<f64>,
    /// istiod's `pilot_proxy_convergence_time` observed during the phase.
    pub istiod_convergence: Option<Convergence>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Rollout {
    pub writes: usize,
    pub write_seconds: f64,
    pub last_write_to_all_acked_ms: f64,
    pub eds_responses_per_proxy_p50: f64,
    pub eds_responses_per_proxy_max: f64,
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Cpu {
    pub subscribe: f64,
    /// Both cases' single changes together.
    pub changes: f64,
    pub rollout: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Convergence {
    pub count: f64,
    pub mean_ms: f64,
    /// Upper bounds of the buckets holding the quantiles.
    pub p50_at_most_ms: Option<f64>,
    pub p99_at_most_ms: Option<f64>,
}

type ProxyTask = tokio::task::JoinHandle<Result<(), proxy::ProxyError>>;

const CONVERGENCE: &str = "pilot_proxy_convergence_time";

/// What a run measured.
pub enum Outcome {
    Push(Vec<Phase>),
    Withdrawal(Vec<withdrawal::Phase>),
}

/// Everything a run holds: the cluster, its client and the contenders.
struct Run<'a> {
    args: &'a Args,
    /// The API server's, for the contenders.
    kubeconfig: PathBuf,
    client: Client,
    endpoints: Endpoints,
    remora: Option<RemoraProcess>,
    istiod: Option<Istiod>,
    /// Whether the Sidecar resources are in place now.
    sidecars: bool,
}

/// Run the bench; returns the phases. Cleans up (namespaces, CRDs it
/// created, processes) whatever happens.
pub async fn run(args: &Args) -> anyhow::Result<Outcome> {
    use crate::controlplane::{ControlPlane, Options};
    check(args)?;
    let cp = match &args.kubeconfig {
        Some(k) => ControlPlane::external(k.clone())
            .await
            .context("the API server of --kubeconfig")?,
        None => {
            println!("starting a local control plane (no --kubeconfig)");
            ControlPlane::start(Options::without_controller_manager())
                .await
                .context("a local control plane")?
        }
    };
    let client = cp.client()?;
    // Without a namespace controller, a namespace is never gone: a local
    // control plane is thrown away whole instead.
    let external = !cp.is_local();
    let wants_istiod = args.contenders.iter().any(|c| *c != Contender::Remora);
    let pilot = match &args.pilot_discovery {
        Some(p) => p.clone(),
        None => default_pilot_discovery()?,
    };
    let crds_file = args
        .istio_crds
        .clone()
        .unwrap_or_else(|| pilot.with_file_name("crd-all.gen.yaml"));
    let scratch = tempfile::Builder::new()
        .prefix("discovery-bench.")
        .tempdir()
        .context("a scratch directory")?;
    let mut janitor = Janitor::spawn(scratch.path(), false)?;

    // A namespace left by an interrupted run is replaced.
    if external {
        cluster::delete_namespace(&client, &args.namespace).await?;
    }
    let mut created_crds = Vec::new();
    let mut created_istio_ns = false;
    let result = async {
        if wants_istiod {
            created_crds = cluster::apply_istio_crds(&client, &crds_file).await?;
            created_istio_ns = cluster::create_namespace(&client, "istio-system").await?;
        }
        cluster::create_namespace(&client, &args.namespace).await?;
        let mut run = Run {
            args,
            kubeconfig: cp.kubeconfig().to_path_buf(),
            client: client.clone(),
            endpoints: Endpoints {
                next: 0,
                current: HashMap::new(),
            },
            remora: None,
            istiod: None,
            sidecars: false,
        };
        run.seed().await?;
        match args.only {
            Section::Push => {
                let mut phases = Vec::new();
                for &n in &args.proxies {
                    phases.extend(
                        run.measure_n(n, &pilot, scratch.path(), &mut janitor)
                            .await?,
                    );
                }
                anyhow::Ok(Outcome::Push(phases))
            }
            Section::Withdrawal => {
                cluster::apply_service_account(&client, &args.namespace, remora::SERVICE_ACCOUNT)
                    .await?;
                let mut phases = Vec::new();
                for &n in &args.proxies {
                    run.start(n, &pilot, scratch.path(), &mut janitor).await?;
                    let measured = withdrawal::measure_n(&mut run, n).await;
                    run.stop();
                    phases.extend(measured?);
                }
                anyhow::Ok(Outcome::Withdrawal(phases))
            }
        }
    }
    .await;
    // Cleanup, then the result.
    let cleanup = async {
        if !external {
            return anyhow::Ok(());
        }
        cluster::delete_namespace(&client, &args.namespace).await?;
        if created_istio_ns {
            cluster::delete_namespace(&client, "istio-system").await?;
        }
        cluster::delete_crds(&client, &created_crds).await?;
        anyhow::Ok(())
    }
    .await;
    janitor.finish();
    let phases = result?;
    cleanup.context("cleaning up")?;
    Ok(phases)
}

fn default_pilot_discovery() -> anyhow::Result<PathBuf> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts/build-pilot-discovery.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg("--print-path")
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    anyhow::ensure!(
        out.status.success() && path.is_file(),
        "no pilot-discovery: run scripts/build-pilot-discovery.sh (or pass --pilot-discovery); it says {}",
        path.display()
    );
    Ok(path)
}

impl Run<'_> {
    /// Every Service and its slice: `shared` and `svc-j` with 3 endpoints,
    /// `rollout` with `--rollout-pods`.
    async fn seed(&mut self) -> anyhow::Result<()> {
        let ns = &self.args.namespace;
        let mut names: Vec<(String, usize)> =
            vec![(SHARED.into(), 3), (ROLLOUT.into(), self.args.rollout_pods)];
        names.extend((0..self.args.services).map(|j| (service_name(j), 3)));
        for (name, count) in names {
            let ips: Vec<Ipv4Addr> = (0..count).map(|_| self.endpoints.fresh()).collect();
            cluster::apply_service(&self.client, ns, &name).await?;
            cluster::apply_slice(&self.client, ns, &name, &ips).await?;
            self.endpoints.current.insert(name, ips);
        }
        Ok(())
    }

    async fn measure_n(
        &mut self,
        n: usize,
        pilot: &std::path::Path,
        scratch: &std::path::Path,
        janitor: &mut Janitor,
    ) -> anyhow::Result<Vec<Phase>> {
        self.start(n, pilot, scratch, janitor).await?;
        let mut phases = Vec::new();
        let k = self.args.contenders.len();
        for cycle in 0..self.args.cycles {
            for step in 0..k {
                let contender = self.args.contenders[(step + cycle) % k];
                let p = self.phase(contender, n, cycle).await?;
                report::print_phase(&p);
                phases.push(p);
            }
        }
        self.stop();
        Ok(phases)
    }

    /// Start the contenders asked for, for N proxies.
    async fn start(
        &mut self,
        n: usize,
        pilot: &std::path::Path,
        scratch: &std::path::Path,
        janitor: &mut Janitor,
    ) -> anyhow::Result<()> {
        let args = self.args;
        if args.contenders.contains(&Contender::Remora) {
            let dir = scratch.join(format!("remora-{n}"));
            std::fs::create_dir_all(&dir)?;
            let exe = std::env::current_exe()?;
            let child_args = [
                "--proxies".to_string(),
                n.to_string(),
                "--services".into(),
                args.services.to_string(),
                "--namespace".into(),
                args.namespace.clone(),
                "--kubeconfig".into(),
                self.kubeconfig.display().to_string(),
            ];
            println!("starting Remora's discovery server (N={n})");
            self.remora = Some(RemoraProcess::start(&exe, &child_args, &dir, janitor).await?);
        }
        if args.contenders.iter().any(|c| *c != Contender::Remora) {
            let dir = scratch.join(format!("istiod-{n}"));
            std::fs::create_dir_all(&dir)?;
            println!("starting pilot-discovery (N={n})");
            let started = Instant::now();
            self.istiod = Some(
                Istiod::start(
                    pilot,
                    &self.kubeconfig,
                    &dir,
                    Ports {
                        grpc: args.istiod_grpc_port,
                        http: args.istiod_http_port,
                        monitoring: args.istiod_monitoring_port,
                    },
                    &args.istiod_env,
                    janitor,
                )
                .await?,
            );
            println!(
                "pilot-discovery ready in {:.1} s",
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    /// Stop the contenders.
    fn stop(&mut self) {
        if let Some(i) = self.istiod.as_mut() {
            println!("pilot-discovery logged {} error lines", i.error_lines());
            i.stop();
        }
        self.istiod = None;
        self.remora = None;
    }

    fn pid(&self, c: Contender) -> anyhow::Result<u32> {
        match c {
            Contender::Remora => self.remora.as_ref().map(RemoraProcess::pid),
            _ => self.istiod.as_ref().map(Istiod::pid),
        }
        .context("the contender is not running")
    }

    fn target(&self, c: Contender) -> anyhow::Result<Target> {
        Ok(match c {
            Contender::Remora => {
                let r = self.remora.as_ref().context("Remora is not running")?;
                Target::Remora {
                    addr: r.addr,
                    bundle: Arc::clone(&r.bundle),
                    token: Arc::new(remora::token()),
                }
            }
            _ => Target::Istiod {
                addr: self.istiod.as_ref().context("istiod is not running")?.xds,
            },
        })
    }

    /// Put the Sidecar resources in place (or remove them), then wait
    /// until a probe proxy's CDS shows istiod has them.
    async fn sidecars(&mut self, want: bool, n: usize) -> anyhow::Result<()> {
        if self.sidecars == want {
            return Ok(());
        }
        let ns = &self.args.namespace;
        if want {
            for j in 0..self.args.services.min(n) {
                let services = [SHARED.to_string(), service_name(j), ROLLOUT.to_string()];
                cluster::apply_sidecar(&self.client, ns, &format!("w-{j}"), &services).await?;
            }
        } else {
            cluster::delete_sidecars(&self.client, ns).await?;
        }
        self.sidecars = want;
        let target = self.target(Contender::Istiod)?;
        let who = plan(ns, 1, self.args.services).remove(0).0;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let board = Board::new(1);
            let stop = CancellationToken::new();
            let task = tokio::spawn(proxy::run(
                target.clone(),
                who.clone(),
                self.args.protocol,
                Arc::clone(&board),
                stop.clone(),
            ));
            let seen = wait_subscribed(
                &board,
                &[(who.clone(), vec![SHARED.into()])],
                &self.endpoints,
                &mut [],
                Duration::from_secs(30),
            )
            .await;
            let clusters = board.with(0, |s| s.eds_clusters);
            stop.cancel();
            let _ = task.await;
            seen?;
            // Scoped: exactly the three Services declared.
            if (clusters == 3) == want {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "istiod did not apply the Sidecar resources ({want}) in 60 s: {clusters} EDS clusters"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn phase(
        &mut self,
        contender: Contender,
        n: usize,
        cycle: usize,
    ) -> anyhow::Result<Phase> {
        let args = self.args;
        let ns = args.namespace.clone();
        match contender {
            Contender::Istiod => self.sidecars(false, n).await?,
            Contender::IstiodSidecars => self.sidecars(true, n).await?,
            Contender::Remora => {}
        }
        let pid = self.pid(contender)?;
        let target = self.target(contender)?;
        let proxies = plan(&ns, n, args.services);
        let identities: Vec<Identity> = proxies.iter().map(|(w, _)| w.clone()).collect();
        let conv_before = self.convergence(contender).await?;
        let u0 = Usage::of(pid)?;

        let board = Board::new(n);
        let stop = CancellationToken::new();
        let started = Instant::now();
        let mut tasks = proxy::start_all(&target, args.protocol, &identities, &board, &stop).await;
        wait_subscribed(
            &board,
            &proxies,
            &self.endpoints,
            &mut tasks,
            Duration::from_secs(300),
        )
        .await?;
        let subscribe_seconds = started.elapsed().as_secs_f64();
        let u1 = Usage::of(pid)?;
        let heap_mib_subscribed = match contender {
            Contender::Remora => self.remora.as_ref().and_then(RemoraProcess::heap_mib),
            _ => None,
        };
        let mut clusters: Vec<usize> = (0..n).map(|i| board.with(i, |s| s.eds_clusters)).collect();
        clusters.sort_unstable();

        // Single changes: a Service with N/S dependents, then `shared`.
        let groups = args.services.min(n);
        let mut one_service_ms = Vec::new();
        let mut shared_ms = Vec::new();
        let mut one_service_dependents = 0;
        for k in 0..args.changes {
            let j = (cycle * args.changes + k) % groups;
            let name = service_name(j);
            let who: Vec<usize> = (0..n).filter(|i| i % args.services == j).collect();
            one_service_dependents = who.len();
            one_service_ms.push(self.change(&name, k, &who, &board, &mut tasks).await?);
        }
        let all: Vec<usize> = (0..n).collect();
        for k in 0..args.changes {
            shared_ms.push(self.change(SHARED, k, &all, &board, &mut tasks).await?);
        }
        let u2 = Usage::of(pid)?;

        // The rollout: every endpoint of `rollout` replaced, one write each.
        let before: Vec<u64> = (0..n).map(|i| board.with(i, |s| s.eds_responses)).collect();
        let t0 = Instant::now();
        let mut last = (Ipv4Addr::UNSPECIFIED, t0);
        for k in 0..args.rollout_pods {
            let (ip, ips) = self.endpoints.replace(ROLLOUT, k);
            let sent = Instant::now();
            cluster::apply_slice(&self.client, &ns, ROLLOUT, &ips).await?;
            last = (ip, sent);
            tokio::time::sleep(Duration::from_millis(args.rollout_step_ms)).await;
        }
        let write_seconds = t0.elapsed().as_secs_f64();
        let done = wait_acked(&board, &all, last.0, &mut tasks, Duration::from_secs(120)).await?;
        let mut pushes: Vec<f64> = (0..n)
            .map(|i| board.with(i, |s| (s.eds_responses - before[i]) as f64))
            .collect();
        pushes.sort_by(f64::total_cmp);
        let u3 = Usage::of(pid)?;
        let conv_after = self.convergence(contender).await?;

        stop.cancel();
        for t in tasks.drain(..) {
            if let Ok(Err(e)) = t.await {
                anyhow::bail!("{contender}: {e}");
            }
        }
        Ok(Phase {
            contender,
            proxies: n,
            cycle,
            eds_clusters_per_proxy: clusters[n / 2],
            subscribe_seconds,
            one_service_ms,
            one_service_dependents,
            shared_ms,
            rollout: Rollout {
                writes: args.rollout_pods,
                write_seconds,
                last_write_to_all_acked_ms: ms(done.saturating_duration_since(last.1)),
                eds_responses_per_proxy_p50: crate::stats::percentile(&pushes, 0.5),
                eds_responses_per_proxy_max: pushes.last().copied().unwrap_or(0.0),
            },
            cpu_seconds: Cpu {
                subscribe: u1.cpu_seconds - u0.cpu_seconds,
                changes: u2.cpu_seconds - u1.cpu_seconds,
                rollout: u3.cpu_seconds - u2.cpu_seconds,
            },
            rss_mib_subscribed: u1.rss_mib,
            peak_rss_mib: u3.peak_rss_mib,
            heap_mib_subscribed,
            istiod_convergence: match (conv_before, conv_after) {
                (Some(b), Some(a)) => {
                    let d = a.since(&b);
                    Some(Convergence {
                        count: d.count,
                        mean_ms: if d.count > 0.0 {
                            d.sum / d.count * 1000.0
                        } else {
                            f64::NAN
                        },
                        p50_at_most_ms: d.quantile_bound(0.5).map(|s| s * 1000.0),
                        p99_at_most_ms: d.quantile_bound(0.99).map(|s| s * 1000.0),
                    })
                }
                _ => None,
            },
        })
    }

    async fn convergence(&self, c: Contender) -> anyhow::Result<Option<Histogram>> {
        match (c, &self.istiod) {
            (Contender::Remora, _) | (_, None) => Ok(None),
            (_, Some(i)) => Ok(Some(Histogram::read(&i.metrics().await?, CONVERGENCE))),
        }
    }

    /// One endpoint of `service` replaced (one write); ms until every one
    /// of `who` ACKed an EDS response carrying it. Then the debounce's
    /// quiet window passes before the next change.
    async fn change(
        &mut self,
        service: &str,
        k: usize,
        who: &[usize],
        board: &Arc<Board>,
        tasks: &mut [ProxyTask],
    ) -> anyhow::Result<f64> {
        let (ip, ips) = self.endpoints.replace(service, k);
        let t0 = Instant::now();
        cluster::apply_slice(&self.client, &self.args.namespace, service, &ips).await?;
        let done = wait_acked(board, who, ip, tasks, Duration::from_secs(60)).await?;
        // Both contenders' debounce wait 100 ms of quiet by default.
        tokio::time::sleep(Duration::from_millis(250)).await;
        Ok(ms(done.saturating_duration_since(t0)))
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn ended(tasks: &mut [ProxyTask]) -> anyhow::Result<()> {
    let Some(t) = tasks.iter_mut().find(|t| t.is_finished()) else {
        return Ok(());
    };
    match futures::FutureExt::now_or_never(t) {
        Some(Ok(Err(e))) => anyhow::bail!("a proxy ended early: {e}"),
        Some(Err(e)) => anyhow::bail!("a proxy's task failed: {e}"),
        _ => anyhow::bail!("a proxy ended early"),
    }
}

/// When the last of `who` ACKed `ip`, waiting up to `limit`.
async fn wait_acked(
    board: &Board,
    who: &[usize],
    ip: Ipv4Addr,
    tasks: &mut [ProxyTask],
    limit: Duration,
) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(t) = board.all_acked(who, ip) {
            return Ok(t);
        }
        ended(tasks)?;
        anyhow::ensure!(
            Instant::now() < deadline,
            "{ip} not ACKed by all {} dependents in {limit:?}",
            who.len()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Until every proxy ACKed the current endpoints of each Service it declared.
async fn wait_subscribed(
    board: &Board,
    proxies: &[(Identity, Vec<String>)],
    endpoints: &Endpoints,
    tasks: &mut [ProxyTask],
    limit: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    let mut from = 0;
    while from < proxies.len() {
        let (who, services) = &proxies[from];
        let ok = services.iter().all(|s| {
            endpoints.current.get(s).is_none_or(|ips| {
                board.with(who.index, |seen| {
                    ips.iter().all(|ip| seen.first_ack.contains_key(ip))
                })
            })
        });
        if ok {
            from += 1;
            continue;
        }
        ended(tasks)?;
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {from} of {} proxies subscribed in {limit:?}",
            proxies.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn istiod_env_is_key_value() {
        assert_eq!(
            key_value("PILOT_DEBOUNCE_AFTER=50ms"),
            Ok(("PILOT_DEBOUNCE_AFTER".into(), "50ms".into()))
        );
        assert!(key_value("PILOT_DEBOUNCE_AFTER").is_err());
        assert!(key_value("=1").is_err());
    }

    #[test]
    fn proxies_of_one_workload_declare_the_same_services() {
        let p = plan("ns", 5, 2);
        assert_eq!(p[0].1, p[2].1);
        assert_ne!(p[0].1, p[1].1);
        assert_eq!(p[3].0.workload, "w-1");
        assert_eq!(p[3].1, ["shared", "svc-1", "rollout"]);
        assert_ne!(p[0].0.ip, p[1].0.ip);
    }

    #[test]
    fn a_change_replaces_one_endpoint_with_a_fresh_address() {
        let mut e = Endpoints {
            next: 0,
            current: HashMap::new(),
        };
        let ips: Vec<Ipv4Addr> = (0..3).map(|_| e.fresh()).collect();
        e.current.insert("s".into(), ips.clone());
        let (new, all) = e.replace("s", 4);
        assert!(!ips.contains(&new));
        assert_eq!(all, [ips[0], new, ips[2]]);
        // A Service with no endpoints yet gets its first.
        let (first, all) = e.replace("t", 0);
        assert_eq!(all, [first]);
    }

    #[test]
    fn bad_bounds_are_refused() {
        let args = |extra: &[&str]| {
            let mut v = vec!["discovery-bench", "--kubeconfig", "k"];
            v.extend_from_slice(extra);
            <Args as clap::Parser>::parse_from(v)
        };
        assert!(check(&args(&[])).is_ok());
        assert!(check(&args(&["--proxies", "0"])).is_err());
        assert!(check(&args(&["--services", "0"])).is_err());
        assert!(check(&args(&["--rollout-pods", "0"])).is_err());
    }
}
