//! SDS in CA mode against the real Envoy and an in-test Istio CA (same proto):
//! issuance, renewal, CA outage, root change, bad token.
#![allow(clippy::unwrap_used)]

mod support_sds;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use prometheus_client::registry::Registry;
use remora_agent::certs::ca::{CaSource, Identity, RenewPolicy};
use remora_agent::config::KeyType;
use remora_agent::readiness::Readiness;
use remora_agent::sds::{self, SdsHandle};
use support_sds::ca_double::{CaServer, TestCa};
use support_sds::*;
use tokio_util::sync::CancellationToken;

fn test_ca(root: Ca, token: &str) -> TestCa {
    TestCa {
        signer: Arc::new(Mutex::new(Arc::new(root))),
        seen: Arc::default(),
        expected_token: Arc::new(Mutex::new(token.to_string())),
    }
}

fn source(server: &CaServer, token_path: &Path, ttl: Duration, out: Option<&Path>) -> CaSource {
    CaSource {
        // Dialled by IP and checked under the certificate's name, as an
        // injected sidecar dials the CA's ClusterIP with no cluster DNS.
        address: format!("127.0.0.1:{}", server.addr.port()),
        server_name: Some("localhost".into()),
        ca_root_pem: Some(server.serving_root_pem.clone()),
        ca_root_cert: None,
        root_poll: Duration::from_millis(50),
        token_path: token_path.to_path_buf(),
        cluster_id: "cluster-7".into(),
        identity: Identity {
            trust_domain: "cluster.local".into(),
            namespace: "shop".into(),
            service_account: "cart".into(),
            key_type: KeyType::EcdsaP256,
            ttl,
        },
        // Seconds-long certificates renew on real time here: a floor below
        // their half-life, and exact retry waits.
        policy: RenewPolicy {
            fraction: 0.5,
            jitter: 0.0,
            min_interval: Duration::from_millis(500),
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(400),
            backoff_jitter: 0.0,
        },
        output_dir: out.map(Path::to_path_buf),
    }
}

struct Rig {
    tmp: tempfile::TempDir,
    readiness: Readiness,
    registry: Registry,
    cancel: CancellationToken,
    handle: SdsHandle,
    envoy: Envoy,
}

async fn rig(tmp: tempfile::TempDir, src: CaSource) -> Result<Rig> {
    let socket = tmp.path().join("sds.sock");
    let readiness = Readiness::new();
    let mut registry = Registry::default();
    let cancel = CancellationToken::new();
    let handle = sds::start_with(
        socket.clone(),
        Some(Box::new(src)),
        &mut registry,
        cancel.clone(),
    )
    .await?;
    // As the agent does when its listeners use both (`--inbound-tls`).
    handle.hold_readiness(&readiness, sds::UsedSecrets::BOTH);
    let envoy = Envoy::start_inbound(tmp.path(), &socket).await?;
    Ok(Rig {
        tmp,
        readiness,
        registry,
        cancel,
        handle,
        envoy,
    })
}

impl Rig {
    async fn serial_other_than(&self, old: &str) -> Result<String> {
        wait_until(DEADLINE, "a new certificate from the CA", || async {
            self.handle
                .current()
                .map(|b| b.serial.clone())
                .filter(|s| s != old)
        })
        .await
        .map_err(Into::into)
    }
}

#[tokio::test]
async fn ca_issues_renews_and_pushes_a_new_root() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let token = tmp.path().join("token");
    std::fs::write(&token, "tok-1\n")?;
    let root1 = Ca::new("mesh-root-1");
    let root1_pem = root1.pem.clone();
    let root1_client = root1.leaf();
    let client1 = connector(&root1_pem, &root1_client);
    let ca_impl = test_ca(root1, "tok-1");
    let server = CaServer::start(ca_impl.clone(), 0).await?;
    let rig_serving_root = server.serving_root_pem.clone();
    let out = tmp.path().join("out");
    let src = source(&server, &token, Duration::from_secs(4), Some(&out));
    let rig = rig(tmp, src).await?;
    let port = rig.envoy.listener_port;

    // Issue.
    let first = rig.serial_other_than("").await?;
    wait_serial(port, &client1, &first).await?;
    wait_until(DEADLINE, "readiness", || async {
        rig.readiness.is_ready().then_some(())
    })
    .await?;
    {
        let seen = ca_impl.seen.lock().unwrap();
        assert_eq!(seen.tokens[0], "Bearer tok-1");
        assert_eq!(seen.cluster_ids[0], "cluster-7");
        assert_eq!(seen.ttls[0], 4);
    }
    let written = remora_agent::certs::file::load_dir(&out)?;
    // The chain's root joins the trust bundle (here the CA's serving root).
    assert!(written.roots_pem.contains(root1_pem.trim()));
    assert!(written.roots_pem.contains(rig_serving_root.trim()));

    // The token file rotates: the next call must carry the new one.
    std::fs::write(&token, "tok-2\n")?;
    *ca_impl.expected_token.lock().unwrap() = "tok-2".into();

    // Renewal at half of the 4 s lifetime.
    let second = rig.serial_other_than(&first).await?;
    wait_serial(port, &client1, &second).await?;
    assert!(
        ca_impl
            .seen
            .lock()
            .unwrap()
            .tokens
            .iter()
            .any(|t| t == "Bearer tok-2")
    );

    // The CA switches roots: ROOTCA follows, clients of the new root get in,
    // clients of the old one no longer do.
    let root2 = Ca::new("mesh-root-2");
    let client2 = connector(&root2.pem, &root2.leaf());
    // Trusts the new root (so the server cert verifies) but presents an old-root cert.
    let old_root_client = connector(&root2.pem, &root1_client);
    let root2_pem = root2.pem.clone();
    *ca_impl.signer.lock().unwrap() = Arc::new(root2);
    // (A renewal already in flight may still come from the old root: wait for the new one.)
    let third = wait_until(DEADLINE, "a certificate from the new root", || async {
        rig.handle
            .current()
            .filter(|b| b.roots_pem.contains(root2_pem.trim()))
            .map(|b| b.serial.clone())
    })
    .await?;
    wait_serial(port, &client2, &third).await?;
    assert!(
        roundtrip(port, &old_root_client).await.is_err(),
        "ROOTCA was replaced: the old root is no longer trusted"
    );

    rig.cancel.cancel();
    rig.handle.join().await?;
    server.stop().await;
    drop(rig.tmp);
    Ok(())
}

#[tokio::test]
async fn ca_outage_keeps_serving_and_retries() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let token = tmp.path().join("token");
    std::fs::write(&token, "tok")?;
    let root = Ca::new("mesh-root");
    let client = connector(&root.pem, &root.leaf());
    let ca_impl = test_ca(root, "tok");
    let server = CaServer::start(ca_impl.clone(), 0).await?;
    let src = source(&server, &token, Duration::from_secs(8), None);
    let rig = rig(tmp, src).await?;
    let port = rig.envoy.listener_port;

    let first = rig.serial_other_than("").await?;
    wait_serial(port, &client, &first).await?;

    // CA goes away; renewal (at ~4 s) fails and is retried with backoff.
    let stopped = server.stop().await;
    let failures = || metric(&rig.registry, "cert_failures_total");
    wait_until(DEADLINE, "three failed renewals", || async {
        (failures() >= 3.0).then_some(())
    })
    .await?;
    let (_, serial) = roundtrip(port, &client).await?;
    assert_eq!(serial, first, "the current cert stays in service");
    assert!(rig.readiness.is_ready(), "readiness does not flap");

    // CA back: the next retry succeeds.
    let server = CaServer::restart(ca_impl.clone(), stopped).await?;
    let second = rig.serial_other_than(&first).await?;
    wait_serial(port, &client, &second).await?;

    rig.cancel.cancel();
    rig.handle.join().await?;
    server.stop().await;
    Ok(())
}

#[tokio::test]
async fn ca_bad_token_holds_readiness_with_the_reason() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let token = tmp.path().join("token");
    std::fs::write(&token, "wrong")?;
    let ca_impl = test_ca(Ca::new("mesh-root"), "right");
    let server = CaServer::start(ca_impl.clone(), 0).await?;
    let src = source(&server, &token, Duration::from_secs(60), None);
    let readiness = Readiness::new();
    let mut registry = Registry::default();
    let cancel = CancellationToken::new();
    let handle = sds::start_with(
        tmp.path().join("sds.sock"),
        Some(Box::new(src)),
        &mut registry,
        cancel.clone(),
    )
    .await?;
    // As the agent does when its listeners use both (`--inbound-tls`).
    handle.hold_readiness(&readiness, sds::UsedSecrets::BOTH);
    let reason = wait_until(DEADLINE, "pending reason", || async {
        readiness
            .pending()
            .into_iter()
            .find(|(_, r)| r.contains("Unauthenticated"))
            .map(|(_, r)| r)
    })
    .await?;
    assert!(!reason.contains("wrong"), "the token never shows: {reason}");
    // Fix the token: issuance goes through on a retry.
    std::fs::write(&token, "right")?;
    wait_until(DEADLINE, "certificate", || async { handle.current() }).await?;
    cancel.cancel();
    handle.join().await?;
    server.stop().await;
    Ok(())
}

/// The trust bundle file (`--ca-root-cert`, a ConfigMap the kubelet swaps)
/// gains a new root: Envoy's ROOTCA follows at once, without a CA call and
/// without a restart; a broken file afterwards keeps the roots in service.
#[tokio::test]
async fn a_new_root_in_the_trust_bundle_file_reaches_envoy_without_a_ca_call() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let token = tmp.path().join("token");
    std::fs::write(&token, "tok")?;
    let mesh = Ca::new("mesh-root");
    let client = connector(&mesh.pem, &mesh.leaf());
    let ca_impl = test_ca(mesh, "tok");
    let server = CaServer::start(ca_impl.clone(), 0).await?;
    let bundle_dir = tmp.path().join("trust");
    std::fs::create_dir_all(&bundle_dir)?;
    let kubelet = |roots: &str| {
        remora_test_support::kubelet::atomic_write(&bundle_dir, [("root-cert.pem", roots)])
            .map(|_| ())
    };
    kubelet(&server.serving_root_pem)?;
    let mut src = source(&server, &token, Duration::from_secs(3600), None);
    src.ca_root_cert = Some(bundle_dir.join("root-cert.pem"));
    let rig = rig(tmp, src).await?;
    let port = rig.envoy.listener_port;
    let first = rig.serial_other_than("").await?;
    wait_serial(port, &client, &first).await?;
    let calls = ca_impl.seen.lock().unwrap().calls;

    // A client of a root the CA never signed with is refused ...
    // (It trusts the served roots, to verify Envoy's certificate.)
    let next = Ca::new("next-root");
    let newcomer_both = connector(&rig_mesh_pem(&rig), &next.leaf());
    assert!(roundtrip(port, &newcomer_both).await.is_err());

    // ... until the trust bundle carries that root.
    kubelet(&format!("{}{}", server.serving_root_pem, next.pem))?;
    wait_until(DEADLINE, "ROOTCA with the new root at Envoy", || async {
        roundtrip(port, &newcomer_both).await.ok().map(|_| ())
    })
    .await?;
    assert_eq!(ca_impl.seen.lock().unwrap().calls, calls, "no CA call");
    let (_, serial) = roundtrip(port, &client).await?;
    assert_eq!(
        serial, first,
        "the same certificate, the mesh root still trusted"
    );

    // A broken file: counted, and the roots in service stay.
    let failures = metric(&rig.registry, "cert_failures_total");
    kubelet("not PEM")?;
    wait_until(DEADLINE, "the broken bundle reported", || async {
        (metric(&rig.registry, "cert_failures_total") > failures).then_some(())
    })
    .await?;
    roundtrip(port, &newcomer_both).await?;
    assert!(rig.readiness.is_ready(), "readiness does not flap");

    rig.cancel.cancel();
    rig.handle.join().await?;
    server.stop().await;
    Ok(())
}

/// The root the CA signs with, as the current bundle's roots hold it.
fn rig_mesh_pem(rig: &Rig) -> String {
    rig.handle
        .current()
        .map(|b| b.roots_pem.clone())
        .unwrap_or_default()
}
