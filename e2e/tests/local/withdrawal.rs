//! Confirmed removal (issue 30) with the real Envoy, the agent binary and
//! the operator's discovery server in this process (the registry fed
//! directly, as the pod watch feeds it; a test double for TokenReview), no
//! node: a client sidecar `web-0` routes to Service `cart`, whose pods
//! `cart-0` and `cart-1` run sidecars of their own with quiet period 0.
//!
//! Shown, on the same processes:
//! - `cart-0` starts deleting and its app's preStop hook asks its agent:
//!   the hook answers (the app may stop) only once the client's Envoy has
//!   taken the pod out of its endpoints; the client's `/clusters` no longer
//!   lists the address by then, and the agent counts the drain confirmed;
//! - the client's Envoy frozen (SIGSTOP), `cart-1` starts deleting: its
//!   agent waits the withdrawal timeout, then lets the app stop and names
//!   the client that never confirmed.
//!
//! Both with one discovery replica, and with two: the client's stream on
//! one (`op-b`), the callees' on the other (`op-a`), which has nobody to
//! wait for and says so at once; the callees' agents learn from `op-a`'s
//! withdrawal that `op-b` serves too, ask it, and wait for its client.
//!
//! The agent binary must be built (`cargo build -p remora-agent`, or set
//! `REMORA_AGENT_BIN`); Envoy is found as the other tests find it.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use e2e::discovery_rig::{
    NS, Reviewer, Rig, Sidecar, Upstreams, app_prestop, get, host, http_service,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use remora_contract::annotations::WITHDRAWAL_TIMEOUT;
use remora_contract::discovery::{PORT_NAME, ServiceHost};
use remora_operator::discovery::registry::{PodKey, ProxyInfo, Replicas, SliceInfo};
use remora_test_support::named_backend::NamedBackend;
use remora_test_support::ports::free_port;
use remora_test_support::wait::wait_until;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(30);
/// The callees' withdrawal timeout.
const BOUND: &str = "3s";
const CONFIRMED: &str = "remora_agent_drain_withdrawals_total{outcome=\"confirmed\"} ";
const TIMED_OUT: &str = "remora_agent_drain_withdrawals_total{outcome=\"timed_out\"} ";

fn key(name: &str) -> PodKey {
    PodKey {
        namespace: NS.into(),
        name: name.into(),
    }
}

/// A callee pod's proxy as the pod watch reads it: serving, or deleting.
fn callee(deleting: bool) -> ProxyInfo {
    ProxyInfo {
        ip: Some("127.0.0.1".into()),
        service_account: "cart".into(),
        agent_annotations: [(WITHDRAWAL_TIMEOUT.to_string(), BOUND.to_string())].into(),
        withdrawn: deleting,
        deleting,
        ..Default::default()
    }
}

/// Whether the client Envoy on admin port `admin` lists `addr` in its clusters.
async fn routes_to(admin: u16, addr: SocketAddr) -> anyhow::Result<bool> {
    let (_, body) = get(admin, "/clusters")
        .await
        .context("the client Envoy's /clusters")?;
    Ok(body.contains(&format!("{addr}::")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callee_stops_only_once_its_clients_confirmed_and_names_one_that_never_does()
-> anyhow::Result<()> {
    confirmed_removal(false).await
}

/// The same with two discovery replicas: the client on one, the callees on
/// the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_replicas_the_callee_waits_for_the_client_on_the_other_replica()
-> anyhow::Result<()> {
    confirmed_removal(true).await
}

/// The operator's Service, whose ready endpoints are the replicas.
fn operator_service() -> ServiceHost {
    ServiceHost {
        name: "remora-operator".into(),
        namespace: "remora-system".into(),
    }
}

async fn confirmed_removal(two_replicas: bool) -> anyhow::Result<()> {
    let rig = Rig::new(Reviewer::new(&[(1, "web"), (2, "cart"), (3, "cart")]), None)?;
    // Replica op-a serves the callees; op-b (or op-a itself) the client.
    let other = two_replicas.then(|| rig.another_replica());
    let replicas: Vec<&Rig> = std::iter::once(&rig).chain(other.as_ref()).collect();
    let (app_port, listen) = (free_port(), free_port());
    let addr_0: SocketAddr = format!("127.0.0.2:{app_port}").parse()?;
    let addr_1: SocketAddr = format!("127.0.0.3:{app_port}").parse()?;
    NamedBackend::start(addr_0, "cart-0").await?;
    NamedBackend::start(addr_1, "cart-1").await?;
    let cart = host("cart");
    // The replicas on one port, each on a loopback address of its own.
    let port = free_port();
    let op_a: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let op_b: SocketAddr = format!("127.0.0.4:{port}").parse()?;
    for (discovery, own) in replicas.iter().map(|r| &r.discovery).zip(["op-a", "op-b"]) {
        discovery.update(|r| {
            r.set_replicas(Some(Replicas {
                service: operator_service(),
                own_pod: own.into(),
            }));
            let mut t = Vec::new();
            t.extend(r.apply_service(cart.clone(), http_service()));
            t.extend(
                r.apply_slice(
                    (NS.into(), "cart-x".into()),
                    SliceInfo {
                        service: Some(cart.clone()),
                        ports: [("http".to_string(), app_port)].into(),
                        ready: [addr_0.ip(), addr_1.ip()].into(),
                        pods: [
                            (addr_0.ip(), "cart-0".to_string()),
                            (addr_1.ip(), "cart-1".to_string()),
                        ]
                        .into(),
                    },
                ),
            );
            t.extend(r.apply_proxy(
                key("web-0"),
                ProxyInfo {
                    ip: Some("127.0.0.1".into()),
                    service_account: "web".into(),
                    outbound: Some(format!("{listen}:cart.shop:80").into()),
                    ..Default::default()
                },
            ));
            if two_replicas {
                t.extend(r.apply_slice(
                    ("remora-system".into(), "remora-operator-x".into()),
                    SliceInfo {
                        service: Some(operator_service()),
                        ports: [(PORT_NAME.to_string(), port)].into(),
                        ready: [op_a.ip(), op_b.ip()].into(),
                        pods: [(op_a.ip(), "op-a".into()), (op_b.ip(), "op-b".into())].into(),
                    },
                ));
            }
            t
        });
        discovery.apply_proxy(key("cart-0"), callee(false));
        discovery.apply_proxy(key("cart-1"), callee(false));
    }

    let stop = CancellationToken::new();
    let mut servers = Vec::new();
    for (r, addr) in replicas.iter().zip([op_a, op_b]) {
        servers.push(r.serve_discovery(addr, stop.clone()).await?);
    }
    let callee_upstreams = Upstreams {
        discovery: Some(op_a),
        ca: None,
    };
    let client_upstreams = Upstreams {
        discovery: Some(if two_replicas { op_b } else { op_a }),
        ca: None,
    };
    let mut client = Sidecar::start(&rig, &client_upstreams, "web-0", "web", 1, &[])?;
    // The callees: an app hook (the helper itself is never run here, any
    // file will do) and quiet period 0, as for a workload called only by
    // meshed clients.
    let hooks = tempfile::tempdir()?;
    let helper = hooks.path().join("helper");
    std::fs::write(&helper, "")?;
    let mut callees = Vec::new();
    for (name, nonce) in [("cart-0", 2), ("cart-1", 3)] {
        let hook = hooks.path().join(name);
        std::fs::create_dir(&hook)?;
        let mut s = Sidecar::start(
            &rig,
            &callee_upstreams,
            name,
            "cart",
            nonce,
            &[
                format!("--hook-dir={}", hook.display()),
                format!("--prestop-helper={}", helper.display()),
                "--quiet-period=0s".into(),
                format!("--withdrawal-timeout={BOUND}"),
            ],
        )?;
        s.ready(name).await?;
        callees.push((s, hook));
    }
    client.ready("the client sidecar").await?;
    let admin = client.envoy_admin;
    let both = wait_until(DEADLINE, "the client routes to both callees", || async {
        (routes_to(admin, addr_0).await.ok()? && routes_to(admin, addr_1).await.ok()?).then_some(())
    })
    .await;
    if both.is_err() {
        bail!("the client never held both callees:\n{}", client.log());
    }
    let (status, raw) = get(listen, "/")
        .await
        .context("a call through the client")?;
    ensure!(status == 200, "{raw}");

    // cart-0 starts deleting (the API server), then its app's preStop hook
    // asks its agent (the kubelet).
    let (cart_0, hook_0) = &callees[0];
    for r in &replicas {
        r.discovery.apply_proxy(key("cart-0"), callee(true));
    }
    let asked = Instant::now();
    let (status, raw) = app_prestop(hook_0)
        .await
        .context("cart-0's app hook answers")?;
    let released = asked.elapsed();
    ensure!(status == 200, "{raw}");
    // By the time the app may stop, the client's Envoy has dropped it.
    ensure!(
        !routes_to(admin, addr_0).await?,
        "cart-0's app was released while the client still routed to it"
    );
    ensure!(routes_to(admin, addr_1).await?, "cart-1 is still served");
    let confirmed = wait_until(DEADLINE, "cart-0's drain counted confirmed", || async {
        (cart_0.metric(CONFIRMED).await == 1.0).then_some(())
    })
    .await;
    if confirmed.is_err() {
        bail!("cart-0's drain was not confirmed:\n{}", cart_0.log());
    }
    println!("confirmed removal: cart-0's app released {released:?} after its hook asked");

    // The client's Envoy frozen: it takes no update and ACKs nothing.
    let pid = client.envoy_pid().await.context("the client Envoy's pid")?;
    kill(Pid::from_raw(pid), Signal::SIGSTOP)?;
    let (cart_1, hook_1) = &callees[1];
    for r in &replicas {
        r.discovery.apply_proxy(key("cart-1"), callee(true));
    }
    let asked = Instant::now();
    let answered = app_prestop(hook_1).await;
    let released = asked.elapsed();
    kill(Pid::from_raw(pid), Signal::SIGCONT)?;
    let (status, raw) = answered.context("cart-1's app hook answers")?;
    ensure!(status == 200, "{raw}");
    let timed_out = wait_until(DEADLINE, "cart-1's drain counted timed out", || async {
        (cart_1.metric(TIMED_OUT).await == 1.0).then_some(())
    })
    .await;
    if timed_out.is_err() {
        bail!("cart-1's drain did not time out:\n{}", cart_1.log());
    }
    let log = cart_1.log();
    ensure!(
        log.contains("shop/web-0"),
        "cart-1's agent did not name the client that never confirmed:\n{log}"
    );
    ensure!(
        cart_1
            .metric("remora_agent_drain_withdrawal_unconfirmed_total ")
            .await
            == 1.0,
        "one proxy unconfirmed"
    );
    println!(
        "a frozen client: cart-1's app released {released:?} after its hook asked (bound {BOUND}), the client named"
    );
    for (mut s, _) in callees {
        s.child.start_kill()?;
    }
    client.child.start_kill()?;
    stop.cancel();
    for s in servers {
        s.await?;
    }
    Ok(())
}
