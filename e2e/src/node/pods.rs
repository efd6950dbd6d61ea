//! A pod seen from the host and the outside (`node_pods.rs`): its processes
//! in `/proc`, the test app as a Deployment behind a Service, container logs
//! with the runtime's timestamps, plain HTTP from the host.

use super::*;
use futures::{AsyncBufReadExt as _, TryStreamExt as _};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::net::{IpAddr, SocketAddr};
use std::time::SystemTime;

/// A process of a pod, as the host sees it in `/proc`.
#[derive(Debug, Clone)]
pub struct PodProcess {
    pub pid: i32,
    /// Its argv (`/proc/PID/cmdline`).
    pub argv: Vec<String>,
    /// The container it runs in: the leaf of its cgroup path, which is
    /// the runtime's container ID (the pause process's is the sandbox's).
    pub container_id: String,
}

impl PodProcess {
    /// argv[0] without its directory.
    pub fn program(&self) -> &str {
        self.argv
            .first()
            .map(|a| a.rsplit('/').next().unwrap_or(a))
            .unwrap_or("")
    }

    /// Whether it runs in the container of a status's `containerID`
    /// (`containerd://<id>`).
    pub fn in_container(&self, status_id: &str) -> bool {
        let id = status_id.rsplit("://").next().unwrap_or(status_id);
        !id.is_empty() && self.container_id == id
    }
}

/// Every process whose cgroup belongs to the pod with `pod_uid`, found by
/// scanning `/proc`. Matches both cgroup drivers' paths: cgroupfs
/// (`/kubepods/<qos>/pod<uid>/<id>`) and systemd
/// (`kubepods-<qos>-pod<uid with _>.slice/cri-containerd-<id>.scope`),
/// under cgroup v1 or v2. Processes that exit during the scan are skipped.
pub fn pod_processes(pod_uid: &str) -> Result<Vec<PodProcess>, Error> {
    let markers = [
        format!("pod{pod_uid}"),
        format!("pod{}", pod_uid.replace('-', "_")),
    ];
    let dir = std::fs::read_dir("/proc").map_err(|e| Error::io("reading /proc", e))?;
    let mut found = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cgroups) = std::fs::read_to_string(entry.path().join("cgroup")) else {
            continue;
        };
        let Some(path) = cgroups
            .lines()
            .filter_map(|l| l.splitn(3, ':').nth(2))
            .find(|p| markers.iter().any(|m| p.contains(m.as_str())))
        else {
            continue;
        };
        let leaf = path.rsplit('/').next().unwrap_or("");
        let container_id = if markers.iter().any(|m| leaf.contains(m.as_str())) {
            String::new()
        } else {
            let leaf = leaf.strip_suffix(".scope").unwrap_or(leaf);
            leaf.rsplit('-').next().unwrap_or(leaf).to_owned()
        };
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let argv: Vec<String> = raw
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        // Kernel threads and zombies have no cmdline.
        if !argv.is_empty() {
            found.push(PodProcess {
                pid,
                argv,
                container_id,
            });
        }
    }
    found.sort_by_key(|p| p.pid);
    Ok(found)
}

/// The inotify instances process `pid` holds: its descriptors on
/// `anon_inode:inotify`. The kernel caps them per user
/// (`fs.inotify.max_user_instances`) and every sidecar on a node runs as
/// the same user.
pub fn inotify_instances(pid: i32) -> Result<usize, Error> {
    remora_test_support::inotify::descriptors(&pid.to_string())
        .map(|d| d.len())
        .map_err(|e| Error::io(format!("reading /proc/{pid}/fd"), e))
}

/// When process `pid` was created, from `/proc/PID/stat` (clock ticks
/// since boot) and `/proc/uptime`: 10 ms resolution, where container
/// `startedAt` has whole seconds.
pub fn process_started(pid: i32) -> Result<SystemTime, Error> {
    let failed = |detail: String| Error::Failed {
        what: format!("start time of process {pid}"),
        detail,
    };
    let now = SystemTime::now();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| Error::io(format!("reading /proc/{pid}/stat"), e))?;
    let uptime = std::fs::read_to_string("/proc/uptime")
        .map_err(|e| Error::io("reading /proc/uptime", e))?;
    // The command name (field 2) may hold spaces: count from its ')'.
    let ticks: u64 = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(19))
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| failed(format!("no starttime in {stat:?}")))?;
    let up: f64 = uptime
        .split_whitespace()
        .next()
        .and_then(|u| u.parse().ok())
        .ok_or_else(|| failed(format!("bad /proc/uptime {uptime:?}")))?;
    let hz = clock_ticks();
    let age = Duration::from_secs_f64((up - ticks as f64 / hz).max(0.0));
    now.checked_sub(age)
        .ok_or_else(|| failed("start before the epoch".into()))
}

/// USER_HZ, the unit of `/proc/PID/stat` times (`getconf CLK_TCK`;
/// 100 on the architectures this runs on).
fn clock_ticks() -> f64 {
    static HZ: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *HZ.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .filter(|hz: &f64| *hz > 0.0)
            .unwrap_or(100.0)
    })
}

/// Sends `signal` to host process `pid`.
pub fn signal(pid: i32, signal: nix::sys::signal::Signal) -> Result<(), Error> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).map_err(|e| {
        Error::io(
            format!("sending {signal} to process {pid}"),
            std::io::Error::from(e),
        )
    })
}

/// A Deployment `name` of the test app (pods labelled `app=<name>`,
/// non-root, read-only root) with pod-template `annotations` and the
/// app's `args`.
pub fn test_app_deployment(
    name: &str,
    replicas: i32,
    annotations: &[(&str, &str)],
    args: &[&str],
) -> Result<Deployment, Error> {
    let annotations: BTreeMap<&str, &str> = annotations.iter().copied().collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}, "annotations": annotations},
                "spec": {
                    "securityContext": {"runAsNonRoot": true, "runAsUser": 65532},
                    "containers": [crate::node::test_app_container("app", args)]
                }
            }
        }
    }))
    .map_err(|e| Error::Failed {
        what: format!("building Deployment {name}"),
        detail: e.to_string(),
    })
}

/// A ClusterIP Service `name` selecting `app=<name>`, `port` → `target_port`.
pub fn test_app_service(name: &str, port: u16, target_port: u16) -> Result<Service, Error> {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "selector": {"app": name},
            "ports": [{"name": "http", "port": port, "targetPort": target_port}]
        }
    }))
    .map_err(|e| Error::Failed {
        what: format!("building Service {name}"),
        detail: e.to_string(),
    })
}

/// Waits until pod `name` is Running and Ready (not terminating); a
/// container that cannot start ends the wait at once.
pub async fn wait_pod_ready(
    client: &Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Result<Pod, Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    wait_until(
        timeout,
        &format!("pod {namespace}/{name} Ready"),
        || async {
            let Some(pod) = pods.get_opt(name).await? else {
                return Ok::<_, Error>(Check::NotYet("not found".into()));
            };
            if let Some(reason) = cannot_start(&pod) {
                return Err(Error::Failed {
                    what: format!("pod {namespace}/{name} cannot start"),
                    detail: reason,
                });
            }
            Ok(
                if pod.metadata.deletion_timestamp.is_none() && is_ready(&pod) {
                    Check::Done(pod)
                } else {
                    Check::NotYet(format!(
                        "phase {:?}",
                        pod.status.as_ref().and_then(|s| s.phase.clone())
                    ))
                },
            )
        },
    )
    .await
}

/// Waits until Service `name`'s EndpointSlices list exactly `n` ready
/// endpoints (what kube-proxy programs next); returns how long it took.
pub async fn wait_service_endpoints(
    client: &Client,
    namespace: &str,
    name: &str,
    n: usize,
    timeout: Duration,
) -> Result<Duration, Error> {
    let t0 = Instant::now();
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), namespace);
    wait_until(
        timeout,
        &format!("{n} ready endpoints of Service {namespace}/{name}"),
        || async {
            let ready = ready_endpoints(&slices, name).await?;
            Ok::<_, Error>(if ready == n {
                Check::Done(())
            } else {
                Check::NotYet(format!("{ready} ready endpoints"))
            })
        },
    )
    .await?;
    Ok(t0.elapsed())
}

/// Waits until kube-proxy has programmed ClusterIP `ip:port` with
/// endpoints (a `KUBE-SERVICES` rule in the nat table jumping to the
/// Service's `KUBE-SVC-` chain); returns how long it took. Send nothing
/// to a ClusterIP before: a packet to one kube-proxy does not know yet
/// follows the default route out of the machine, where the egress guard
/// drops (and counts) it.
pub async fn wait_kube_proxy(ip: IpAddr, port: u16, timeout: Duration) -> Result<Duration, Error> {
    let t0 = Instant::now();
    let dest = format!("-d {ip}/32 ");
    let dport = format!("--dport {port} ");
    wait_until(
        timeout,
        &format!("kube-proxy programming {ip}:{port} with endpoints"),
        || async {
            let nat = run(
                "iptables-save -t nat",
                tokio::process::Command::new("iptables-save").args(["-t", "nat"]),
            )
            .await?;
            let rule = nat.lines().find(|l| {
                l.starts_with("-A KUBE-SERVICES ") && l.contains(&dest) && l.contains(&dport)
            });
            Ok::<_, Error>(match rule {
                Some(r) if r.contains("-j KUBE-SVC-") => Check::Done(()),
                Some(r) => Check::NotYet(r.to_owned()),
                None => Check::NotYet("no rule".into()),
            })
        },
    )
    .await?;
    Ok(t0.elapsed())
}

/// One line of a container's log with the time the runtime read it
/// (`timestamps=true`: nanoseconds, the host's clock).
#[derive(Debug, Clone)]
pub struct LogLine {
    pub at: Timestamp,
    pub text: String,
}

impl LogLine {
    fn parse(raw: &str) -> Option<Self> {
        let (at, text) = raw.split_once(' ')?;
        Some(Self {
            at: at.parse().ok()?,
            text: text.to_owned(),
        })
    }

    /// The line as JSON (the agent logs JSON), if it is.
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&self.text).ok()
    }

    /// Whether it is a JSON event with this `message`.
    pub fn is_event(&self, message: &str) -> bool {
        self.json()
            .is_some_and(|j| j.get("message").and_then(|m| m.as_str()) == Some(message))
    }
}

fn log_params(container: &str, previous: bool, follow: bool) -> LogParams {
    LogParams {
        container: Some(container.to_owned()),
        timestamps: true,
        previous,
        follow,
        ..LogParams::default()
    }
}

/// The log of `container` so far (`previous`: of its last run).
pub async fn container_log(
    client: &Client,
    namespace: &str,
    pod: &str,
    container: &str,
    previous: bool,
) -> Result<Vec<LogLine>, Error> {
    let text = Api::<Pod>::namespaced(client.clone(), namespace)
        .logs(pod, &log_params(container, previous, false))
        .await?;
    Ok(text.lines().filter_map(LogLine::parse).collect())
}

/// Follows a container's log from its start until the container exits
/// (or the pod goes): what it said while being deleted, which
/// [`container_log`] can no longer fetch once the pod is gone.
pub struct LogFollower {
    lines: Arc<Mutex<Vec<LogLine>>>,
    task: tokio::task::JoinHandle<Result<(), Error>>,
}

impl LogFollower {
    pub async fn start(
        client: &Client,
        namespace: &str,
        pod: &str,
        container: &str,
    ) -> Result<Self, Error> {
        let stream = Api::<Pod>::namespaced(client.clone(), namespace)
            .log_stream(pod, &log_params(container, false, true))
            .await?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream.lines());
            while let Some(raw) = stream
                .try_next()
                .await
                .map_err(|e| Error::io("reading a followed log", e))?
            {
                if let Some(line) = LogLine::parse(&raw) {
                    sink.lock().unwrap_or_else(|p| p.into_inner()).push(line);
                }
            }
            Ok(())
        });
        Ok(Self { lines, task })
    }

    /// The lines so far.
    pub fn lines(&self) -> Vec<LogLine> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits (at most `timeout`) for the log to end; returns every line.
    pub async fn finish(mut self, timeout: Duration) -> Result<Vec<LogLine>, Error> {
        match tokio::time::timeout(timeout, &mut self.task).await {
            Ok(Ok(res)) => res?,
            Ok(Err(e)) => {
                return Err(Error::Failed {
                    what: "following a log".into(),
                    detail: e.to_string(),
                });
            }
            Err(_) => {
                return Err(Error::Timeout(Timeout {
                    what: "a followed log to end".into(),
                    timeout,
                    last: Some(format!("{} lines", self.lines().len())),
                }));
            }
        }
        Ok(self.lines())
    }
}

impl Drop for LogFollower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `a - b` in milliseconds (negative when `a` is earlier).
pub fn ms_between(a: Timestamp, b: Timestamp) -> i64 {
    i64::try_from(a.duration_since(b).as_millis()).unwrap_or(i64::MAX)
}

/// A host time as a [`Timestamp`] (for comparing with log times).
pub fn timestamp(t: SystemTime) -> Timestamp {
    Timestamp::try_from(t).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// How far `t` is from now, signed.
pub fn since(t: Timestamp) -> SignedDuration {
    timestamp(SystemTime::now()).duration_since(t)
}

/// `GET path` from the host to `addr` on a fresh connection
/// (`connection: close`, so kube-proxy picks an endpoint per request).
pub async fn http_get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<http::Response<String>, Error> {
    let what = format!("GET http://{addr}{path}");
    let failed = |detail: String| Error::Failed {
        what: what.clone(),
        detail,
    };
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| failed(format!("connect: {e}")))?;
        get_once(stream, &addr.to_string(), path)
            .await
            .map_err(failed)
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| failed(format!("no response in {timeout:?}")))?
}

/// The value of one Prometheus series (`name{labels}` exactly as
/// exposed) in a text exposition; `None` when absent.
pub fn prometheus_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}
