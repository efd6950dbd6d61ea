//! SDS in CA mode against the real Envoy and an in-test Istio CA (same proto):
//! issuance, renewal, CA outage, root change, bad token.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support_sds::ca_double::{CaServer, TestCa};
use crate::support_sds::*;
use anyhow::Result;
use prometheus_client::registry::Registry;
use remora_agent::certs::CertBundle;
use remora_agent::certs::ca::CaSource;
use remora_agent::certs::csr::Identity;
use remora_agent::certs::renewal::RenewPolicy;
use remora_agent::config::KeyType;
use remora_agent::readiness::Readiness;
use remora_agent::sds::{self, SdsHandle};
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

fn test_ca(root: Ca, token: &str) -> TestCa {
    TestCa {
        signer: Arc::new(Mutex::new(Arc::new(root))),
        seen: Arc::default(),
        expected_token: Arc::new(Mutex::new(token.to_string())),
        trust_bundle: Arc::default(),
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

    /// The serial Envoy presents to `tls`, once it is that of the
    /// certificate the agent holds and `wanted` accepts. Certificates of
    /// seconds renew meanwhile, so a serial named beforehand may be gone
    /// before Envoy shows it: this follows whichever is current.
    async fn served(
        &self,
        tls: &TlsConnector,
        wanted: impl Fn(&CertBundle) -> bool,
    ) -> Result<String> {
        let held = || {
            self.handle
                .current()
                .filter(|b| wanted(b))
                .map(|b| b.serial.clone())
        };
        let port = self.envoy.listener_port;
        wait_until(
            DEADLINE,
            "Envoy presenting the agent's certificate",
            || async {
                let before = held();
                let (_, presented) = roundtrip(port, tls).await.ok()?;
                // A renewal between the two looks: either one counts.
                [before, held()]
                    .contains(&Some(presented.clone()))
                    .then_some(presented)
            },
        )
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

    // Issue. The certificate renews every 2 s from here on, whatever the
    // test waits for, so each step below follows the one current.
    let first = rig.serial_other_than("").await?;
    rig.served(&client1, |_| true).await?;
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
    // Written file by file, so a renewal may tear a read: read again.
    let written = wait_until(DEADLINE, "the certificate files", || async {
        remora_agent::certs::file::load_dir(&out).ok()
    })
    .await?;
    // A CA that sends no trust bundle (Istio's): its chain's root alone,
    // not the roots that verify the CA (here the CA's serving root).
    assert!(written.roots_pem.contains(root1_pem.trim()));
    assert!(!written.roots_pem.contains(rig_serving_root.trim()));

    // The token file rotates; from now on the CA takes the new token only.
    std::fs::write(&token, "tok-2\n")?;
    *ca_impl.expected_token.lock().unwrap() = "tok-2".into();
    let rotated = ca_impl.seen.lock().unwrap().tokens.len();
    // Renewals (at half of the 4 s lifetime) read the new file. The agent
    // makes one call at a time and serves each answer before the next: once
    // a second call carried the new token, what it holds came from one.
    wait_until(DEADLINE, "two renewals with the new token", || async {
        let seen = ca_impl.seen.lock().unwrap();
        let renewed = seen.tokens[rotated..]
            .iter()
            .filter(|t| *t == "Bearer tok-2");
        (renewed.count() >= 2).then_some(())
    })
    .await?;
    let second = rig.served(&client1, |_| true).await?;
    assert_ne!(second, first);

    // The CA switches roots: ROOTCA follows, clients of the new root get in,
    // clients of the old one no longer do.
    let root2 = Ca::new("mesh-root-2");
    let client2 = connector(&root2.pem, &root2.leaf());
    // Trusts the new root (so the server cert verifies) but presents an old-root cert.
    let old_root_client = connector(&root2.pem, &root1_client);
    let root2_pem = root2.pem.clone();
    *ca_impl.signer.lock().unwrap() = Arc::new(root2);
    // A renewal already in flight may still come from the old root, and the
    // certificate and ROOTCA reach Envoy apart: the new root's client gets
    // in once both have, and ROOTCA then holds the new root alone.
    rig.served(&client2, |b| b.roots_pem.contains(root2_pem.trim()))
        .await?;
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

/// The trust-bundle attack: whoever may write ConfigMaps
/// in the namespace adds a root of their own to the bundle file
/// (`--ca-root-cert`, a ConfigMap the kubelet swaps). Envoy's ROOTCA stays
/// what the CA said over its verified connection, and a client whose
/// certificate that root signed is refused at Envoy. A root the CA itself
/// stages does reach Envoy, by the CA call the file's change prompts, with
/// no restart; a broken file afterwards keeps the roots in service.
#[tokio::test]
async fn an_attackers_root_in_the_trust_bundle_file_is_not_trusted() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let token = tmp.path().join("token");
    std::fs::write(&token, "tok")?;
    let mesh = Ca::new("mesh-root");
    let mesh_pem = mesh.pem.clone();
    let client = connector(&mesh.pem, &mesh.leaf());
    let ca_impl = test_ca(mesh, "tok");
    *ca_impl.trust_bundle.lock().unwrap() = Some(mesh_pem.clone());
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
    let calls = || ca_impl.seen.lock().unwrap().calls;
    let before = calls();

    // The attacker's root and a certificate it signed (any identity: the
    // listener checks the chain, as `inbound-tls` without SANs does). The
    // client trusts the mesh root, to verify Envoy's certificate.
    let attacker = Ca::new("attacker-root");
    let attacker_client = connector(&mesh_pem, &attacker.leaf());
    assert!(roundtrip(port, &attacker_client).await.is_err());
    kubelet(&format!("{}{}", server.serving_root_pem, attacker.pem))?;
    // The agent asks the CA again, and serves what it says.
    wait_until(
        DEADLINE,
        "a CA call prompted by the edited file",
        || async { (calls() > before).then_some(()) },
    )
    .await?;
    let second = rig.serial_other_than(&first).await?;
    wait_serial(port, &client, &second).await?;
    let served = rig_mesh_pem(&rig);
    assert!(!served.contains(attacker.pem.trim()), "{served}");
    assert!(
        roundtrip(port, &attacker_client).await.is_err(),
        "a certificate of the attacker's root is refused"
    );
    // One call for that content, however long it stays.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(calls(), before + 1, "no call loop");
    assert!(roundtrip(port, &attacker_client).await.is_err());

    // A root the CA stages: the leader writes it to the file too.
    let next = Ca::new("next-root");
    let newcomer = connector(&mesh_pem, &next.leaf());
    assert!(roundtrip(port, &newcomer).await.is_err());
    *ca_impl.trust_bundle.lock().unwrap() = Some(format!("{mesh_pem}{}", next.pem));
    kubelet(&format!("{}{}", server.serving_root_pem, next.pem))?;
    wait_until(DEADLINE, "ROOTCA with the staged root at Envoy", || async {
        roundtrip(port, &newcomer).await.ok().map(|_| ())
    })
    .await?;
    roundtrip(port, &client).await?;
    assert!(roundtrip(port, &attacker_client).await.is_err());

    // A broken file: counted, and the roots in service stay.
    let failures = metric(&rig.registry, "cert_failures_total");
    kubelet("not PEM")?;
    wait_until(DEADLINE, "the broken bundle reported", || async {
        (metric(&rig.registry, "cert_failures_total") > failures).then_some(())
    })
    .await?;
    roundtrip(port, &newcomer).await?;
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

/// A TLS session resumed from before a root's retirement is refused after
/// it. The TLS meant is the workload mTLS at the
/// sidecar's Envoy, the only one where a peer's certificate is checked
/// against the roots that retire (the CA's own server asks for no client
/// certificate). A client whose certificate the retiring root signed
/// resumes its session while that root is trusted; once the CA retires it
/// and the agent has pushed the new ROOTCA, the same client, resuming the
/// same session, is refused.
#[tokio::test]
async fn a_session_resumed_from_before_a_root_retires_is_refused_after_it() -> Result<()> {
    use rustls::client::Resumption;
    use rustls::pki_types::ServerName;
    use tokio_rustls::TlsConnector;

    let tmp = tempfile::tempdir()?;
    let token = tmp.path().join("token");
    std::fs::write(&token, "tok")?;
    let (old, new) = (Ca::new("retiring-root"), Ca::new("current-root"));
    let (old_pem, new_pem) = (old.pem.clone(), new.pem.clone());
    let ca_impl = test_ca(new, "tok");
    *ca_impl.trust_bundle.lock().unwrap() = Some(format!("{new_pem}{old_pem}"));
    let server = CaServer::start(ca_impl.clone(), 0).await?;
    let bundle_dir = tmp.path().join("trust");
    std::fs::create_dir_all(&bundle_dir)?;
    let kubelet = |roots: &str| {
        remora_test_support::kubelet::atomic_write(&bundle_dir, [("root-cert.pem", roots)])
            .map(|_| ())
    };
    kubelet(&format!("{}{new_pem}{old_pem}", server.serving_root_pem))?;
    let mut src = source(&server, &token, Duration::from_secs(3600), None);
    src.ca_root_cert = Some(bundle_dir.join("root-cert.pem"));
    let rig = rig(tmp, src).await?;
    let port = rig.envoy.listener_port;
    rig.serial_other_than("").await?;

    // A peer of the retiring root, with session resumption on.
    let peer = old.leaf();
    let mut cfg = (*remora_test_support::pki::client_config(&new_pem, Some(&peer))?).clone();
    cfg.resumption = Resumption::in_memory_sessions(16);
    let resuming = TlsConnector::from(Arc::new(cfg));
    let connect = |tls: TlsConnector| async move {
        let fut = async {
            let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
            let mut s = tls.connect(ServerName::try_from("localhost")?, tcp).await?;
            echo(&mut s).await?;
            let kind = s.get_ref().1.handshake_kind();
            Ok::<_, anyhow::Error>(kind)
        };
        tokio::time::timeout(Duration::from_secs(5), fut)
            .await
            .map_err(|_| anyhow::anyhow!("timed out"))?
    };
    wait_until(DEADLINE, "the retiring root's peer let in", || async {
        connect(resuming.clone()).await.ok()
    })
    .await?;
    // A ticket from the first session: this one resumes.
    let kind = wait_until(DEADLINE, "a resumed session", || async {
        connect(resuming.clone())
            .await
            .ok()
            .flatten()
            .filter(|k| *k == rustls::HandshakeKind::Resumed)
    })
    .await?;
    assert_eq!(kind, rustls::HandshakeKind::Resumed);
    // Store a fresh ticket just before the retirement.
    connect(resuming.clone()).await?;

    // The retirement: the CA's trust set drops the old root, the bundle
    // file follows, the agent asks the CA and pushes the new ROOTCA.
    *ca_impl.trust_bundle.lock().unwrap() = Some(new_pem.clone());
    kubelet(&format!("{}{new_pem}", server.serving_root_pem))?;
    let fresh = connector(&new_pem, &peer);
    wait_until(
        DEADLINE,
        "the retired root's peer refused afresh",
        || async { roundtrip(port, &fresh).await.is_err().then_some(()) },
    )
    .await?;
    let served = rig_mesh_pem(&rig);
    assert!(!served.contains(old_pem.trim()), "{served}");
    let resumed = connect(resuming.clone()).await;
    assert!(
        resumed.is_err(),
        "a session from before the retirement resumed after it: {resumed:?}"
    );

    rig.cancel.cancel();
    rig.handle.join().await?;
    server.stop().await;
    Ok(())
}
