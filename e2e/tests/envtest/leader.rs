//! Two `remora-operator serve` processes on one real API server: both serve
//! the webhook, exactly one holds the leader Lease (and runs the
//! controller), and the other takes over when the leader stops, gracefully
//! (SIGTERM: the Lease is released, so at the standby's next try) or not
//! (SIGKILL: after the lease duration).
//!
//! Short timings: lease 3 s, renew deadline 2 s, retry 500 ms. The measured
//! failover times are printed, not asserted (a loaded machine is slower).

use std::cell::Cell;
use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::controlplane::ControlPlane;
use e2e::operator::{Operator, Options};
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use nix::sys::signal::Signal;
use remora_test_support::wait::{Check, Wait, wait_until};
use serde_json::json;

const LEASE: &str = "remora-operator";
const DEADLINE: Duration = Duration::from_secs(30);

/// `(status, body)` of a request to the operator, over its own TLS; `None`
/// when it cannot be reached.
async fn call(
    inj: &Operator,
    method: http::Method,
    path: &str,
    body: Vec<u8>,
) -> Option<(u16, String)> {
    let mut c = remora_test_support::webhook_client::connect(inj.addr(), "localhost", inj.ca_pem())
        .await
        .ok()?;
    let (status, body) = c.request(method, path, body).await.ok()?;
    Some((status.as_u16(), String::from_utf8_lossy(&body).into_owned()))
}

/// A gauge of the operator's /metrics (`name` with the trailing space).
async fn gauge(inj: &Operator, name: &str) -> Option<i64> {
    let (status, body) = call(inj, http::Method::GET, "/metrics", Vec::new()).await?;
    if status != 200 {
        return None;
    }
    body.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
}

/// The operator's `remora_operator_leader` gauge.
async fn leader_gauge(inj: &Operator) -> Option<i64> {
    gauge(inj, "remora_operator_leader ").await
}

/// An AdmissionReview of a pod in a namespace the operator does not select:
/// answered (allowed, no patch) by any live replica, leader or not.
async fn admits(inj: &Operator) -> bool {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "7d3c1a52-4a53-4a4c-9a3e-2d6a3f0c6b11",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "elsewhere",
            "operation": "CREATE",
            "userInfo": {"username": "test"},
            "object": {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": "p", "namespace": "elsewhere"},
                       "spec": {"containers": [{"name": "app", "image": "app:1"}]}},
        }
    });
    let Some((200, body)) = call(
        inj,
        http::Method::POST,
        "/inject",
        serde_json::to_vec(&review).unwrap_or_default(),
    )
    .await
    else {
        return false;
    };
    serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| {
        v["response"]["allowed"] == true && v["response"]["uid"] == review["request"]["uid"]
    })
}

async fn lease(api: &Api<Lease>) -> Result<Option<(String, i32)>, kube::Error> {
    Ok(api
        .get_opt(LEASE)
        .await?
        .and_then(|l| l.spec)
        .and_then(|s| {
            s.holder_identity
                .map(|h| (h, s.lease_transitions.unwrap_or(0)))
        }))
}

/// Two operators `a` and `b`; waits until exactly one leads, as the Lease
/// and both gauges agree, and both answer admissions. Returns the namespace
/// and (leader, standby).
async fn two_operators(
    cp: &ControlPlane,
    client: &Client,
    prefix: &str,
) -> anyhow::Result<(String, Api<Lease>, Operator, Operator)> {
    e2e::chart::install_crds(client).await?;
    let ns = cp.create_namespace(client, prefix).await?;
    let api: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let (a, b) = tokio::try_join!(
        Operator::start(cp.kubeconfig(), Options::fast_leader(&ns, "a")),
        Operator::start(cp.kubeconfig(), Options::fast_leader(&ns, "b")),
    )?;
    let holder = wait_until(
        DEADLINE,
        "one leader, by the Lease and both gauges",
        || async {
            let Some((holder, _)) = lease(&api).await? else {
                return Ok::<_, anyhow::Error>(None);
            };
            let gauges = (leader_gauge(&a).await, leader_gauge(&b).await);
            let want = if holder == "a" {
                (Some(1), Some(0))
            } else {
                (Some(0), Some(1))
            };
            Ok((gauges == want).then_some(holder))
        },
    )
    .await;
    let holder = match holder {
        Ok(h) => h,
        Err(e) => anyhow::bail!(
            "{e}\na's log:\n{}\nb's log:\n{}",
            a.log_tail(),
            b.log_tail()
        ),
    };
    assert!(admits(&a).await, "a does not serve the webhook");
    assert!(admits(&b).await, "b does not serve the webhook");
    Ok(if holder == "a" {
        (ns, api, a, b)
    } else {
        (ns, api, b, a)
    })
}

/// Waits until `standby` holds the Lease and says so on /metrics; returns
/// the times since `from`, and the Lease's transitions. Polls every 20 ms
/// (not `wait_until`'s backoff) so that the times mean something.
async fn takeover(
    api: &Api<Lease>,
    standby: &Operator,
    name: &str,
    from: Instant,
) -> anyhow::Result<(Duration, Duration, i32)> {
    // When the Lease first named `name`, and its transitions then.
    let by_lease = Cell::new(None);
    let what = format!("{name} to take over (the Lease, then its leader gauge)");
    Wait::new(DEADLINE.saturating_sub(from.elapsed()), &what)
        .every(Duration::from_millis(20))
        .until(|| async {
            if by_lease.get().is_none()
                && let Some((h, t)) = lease(api).await?
                && h == name
            {
                by_lease.set(Some((from.elapsed(), t)));
            }
            let Some((l, t)) = by_lease.get() else {
                return Ok::<_, anyhow::Error>(Check::NotYet(
                    "the Lease names another holder".into(),
                ));
            };
            Ok(if leader_gauge(standby).await == Some(1) {
                Check::Done((l, from.elapsed(), t))
            } else {
                Check::NotYet(format!(
                    "the Lease named {name} after {l:?}; its gauge is not 1"
                ))
            })
        })
        .await
        .with_context(|| format!("its log:\n{}", standby.log_tail()))
}

#[tokio::test]
async fn graceful_stop_hands_the_lease_over_at_once() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let (ns, api, mut leader, standby) = two_operators(cp, &client, "leader-term").await?;
    let leader_id = lease(&api).await?.map(|(h, _)| h).unwrap_or_default();
    let standby_id = if leader_id == "a" { "b" } else { "a" };
    let before = lease(&api).await?.map_or(0, |(_, t)| t);

    let t0 = Instant::now();
    leader.signal(Signal::SIGTERM);
    let (by_lease, by_gauge, transitions) = takeover(&api, &standby, standby_id, t0).await?;
    let status = leader.wait_exit(DEADLINE).await?;
    let exited = t0.elapsed();
    println!(
        "graceful failover (SIGTERM {leader_id} -> {standby_id}): Lease {by_lease:?}, \
         gauge {by_gauge:?}; old leader exited after {exited:?} with {status:?}"
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}; log:\n{}",
        leader.log_tail()
    );
    assert_eq!(transitions, before + 1);
    // The old leader said it released the Lease.
    assert!(
        leader.log_text().contains("released the leader Lease"),
        "{}",
        leader.log_tail()
    );
    assert!(admits(&standby).await);
    drop(standby);
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

#[tokio::test]
async fn a_crashed_leader_is_replaced_after_the_lease_duration() -> anyhow::Result<()> {
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    let (ns, api, mut leader, standby) = two_operators(cp, &client, "leader-kill").await?;
    let leader_id = lease(&api).await?.map(|(h, _)| h).unwrap_or_default();
    let standby_id = if leader_id == "a" { "b" } else { "a" };

    let t0 = Instant::now();
    leader.signal(Signal::SIGKILL);
    let (by_lease, by_gauge, _) = takeover(&api, &standby, standby_id, t0).await?;
    println!(
        "crash failover (SIGKILL {leader_id} -> {standby_id}): Lease {by_lease:?}, gauge {by_gauge:?} \
         (lease duration 3s)"
    );
    let status = leader.wait_exit(DEADLINE).await?;
    assert!(status.is_some_and(|s| !s.success()), "{status:?}");
    assert!(admits(&standby).await);
    drop(standby);
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}

/// A TLS connection to the operator on which a request is half-sent: its
/// headers announce a body that has not arrived yet.
async fn half_sent_request(
    inj: &Operator,
    body: &[u8],
) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    use rustls::pki_types::pem::PemObject;
    use tokio::io::AsyncWriteExt;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(inj.ca_pem().as_bytes()) {
        roots.add(cert?)?;
    }
    let cfg = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(inj.addr()).await?;
    let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(rustls::pki_types::ServerName::try_from("localhost")?, tcp)
        .await?;
    let head = format!(
        "POST /inject HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes()).await?;
    tls.write_all(&body[..body.len() / 2]).await?;
    tls.flush().await?;
    Ok(tls)
}

/// Waits until the operator is inside an admission (a connection whose
/// request has not been read yet would be closed by the drain, not finished).
async fn in_flight(inj: &Operator) -> anyhow::Result<()> {
    wait_until(DEADLINE, "an admission in flight", || async {
        Ok::<_, anyhow::Error>(
            (gauge(inj, "remora_operator_admissions_in_flight ").await == Some(1)).then_some(()),
        )
    })
    .await?;
    Ok(())
}

/// Waits until the operator's log says `what`.
async fn logged(inj: &Operator, what: &str) -> anyhow::Result<()> {
    wait_until(DEADLINE, what, || async {
        Ok::<_, anyhow::Error>(inj.log_text().contains(what).then_some(()))
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}; log:\n{}", inj.log_tail()))
}

#[tokio::test]
async fn sigterm_finishes_in_flight_admissions_and_a_second_signal_aborts() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let cp = ControlPlane::shared().await?;
    let client = cp.client()?;
    e2e::chart::install_crds(&client).await?;
    let ns = cp.create_namespace(&client, "leader-drain").await?;
    let mut o = Options::fast_leader(&ns, "drain");
    if let Some(i) = o.args.iter().position(|a| a == "--shutdown-grace") {
        o.args[i + 1] = "60s".to_owned();
    }
    let review = serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "9b0e3c1e-1111-4c4c-8d8d-000000000001",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "elsewhere", "operation": "CREATE", "userInfo": {"username": "t"},
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                       "spec": {"containers": [{"name": "app", "image": "app:1"}]}},
        }
    }))?;

    // In flight at SIGTERM: answered, then the process exits 0.
    let mut inj = Operator::start(cp.kubeconfig(), o.clone()).await?;
    logged(&inj, "acquired the leader Lease").await?;
    let mut conn = half_sent_request(&inj, &review).await?;
    in_flight(&inj).await?;
    inj.signal(Signal::SIGTERM);
    logged(&inj, "webhook server draining").await?;
    // Released while the request is still in flight: the controller does
    // not wait for the webhook's drain.
    logged(&inj, "released the leader Lease").await?;
    assert_eq!(
        inj.wait_exit(Duration::ZERO).await?,
        None,
        "exited with a request in flight"
    );
    conn.write_all(&review[review.len() / 2..]).await?;
    conn.flush().await?;
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, conn.read_to_end(&mut answer)).await??;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains("9b0e3c1e-1111-4c4c-8d8d-000000000001"),
        "{answer}"
    );
    let status = inj.wait_exit(DEADLINE).await?;
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        inj.log_tail()
    );

    // Still in flight at a second signal: exit at once, non-zero.
    let mut inj = Operator::start(cp.kubeconfig(), o).await?;
    let _conn = half_sent_request(&inj, &review).await?;
    in_flight(&inj).await?;
    inj.signal(Signal::SIGTERM);
    logged(&inj, "webhook server draining").await?;
    let t0 = Instant::now();
    inj.signal(Signal::SIGINT);
    let status = inj.wait_exit(DEADLINE).await?;
    println!(
        "second signal: exited after {:?} with {status:?}",
        t0.elapsed()
    );
    assert!(
        status.is_some_and(|s| !s.success()),
        "{status:?}\n{}",
        inj.log_tail()
    );
    cp.delete_namespace(&client, &ns).await?;
    Ok(())
}
