//! SDS in file mode against the real Envoy: mTLS on an inbound listener,
//! rotation by rewrite and by `..data` symlink swap, and bad input.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use crate::support_sds::*;
use anyhow::Result;
use prometheus_client::registry::Registry;
use remora_agent::certs::file::FileSource;
use remora_agent::readiness::Readiness;
use remora_agent::sds::{self, SdsHandle};
use tempfile::TempDir;
use tokio_util::sync::CancellationToken;

struct Rig {
    tmp: TempDir,
    certs: PathBuf,
    readiness: Readiness,
    registry: Registry,
    cancel: CancellationToken,
    handle: Option<SdsHandle>,
    envoy: Envoy,
}

impl Rig {
    async fn start(prepare: impl FnOnce(&std::path::Path)) -> Result<Self> {
        let tmp = tempfile::tempdir()?;
        let certs = tmp.path().join("certs");
        std::fs::create_dir_all(&certs)?;
        prepare(&certs);
        let socket = tmp.path().join("run").join("sds.sock");
        let readiness = Readiness::new();
        let mut registry = Registry::default();
        let cancel = CancellationToken::new();
        let handle = sds::start_with(
            socket.clone(),
            Some(Box::new(FileSource::new(certs.clone()))),
            &mut registry,
            cancel.clone(),
        )
        .await?;
        // As the agent does when its listeners use both (`--inbound-tls`).
        handle.hold_readiness(&readiness, sds::UsedSecrets::BOTH);
        let envoy = Envoy::start_inbound(tmp.path(), &socket).await?;
        Ok(Self {
            tmp,
            certs,
            readiness,
            registry,
            cancel,
            handle: Some(handle),
            envoy,
        })
    }

    fn port(&self) -> u16 {
        self.envoy.listener_port
    }

    async fn stop(mut self) -> Result<()> {
        self.cancel.cancel();
        if let Some(h) = self.handle.take() {
            let socket = h.socket.clone();
            tokio::time::timeout(Duration::from_secs(10), h.join()).await??;
            assert!(!socket.exists(), "socket removed on shutdown");
        }
        let _ = self.envoy.child.kill().await;
        drop(self.tmp);
        Ok(())
    }
}

#[tokio::test]
async fn mtls_same_root_passes_other_root_refused() -> Result<()> {
    let root = Ca::new("root-a");
    let server = root.leaf();
    let rig = Rig::start(|d| write_certs(d, &server, &root.pem)).await?;

    let good = connector(&root.pem, &root.leaf());
    wait_serial(rig.port(), &good, &server.serial).await?;

    let other = Ca::new("root-b");
    let bad = connector(&root.pem, &other.leaf());
    assert!(
        roundtrip(rig.port(), &bad).await.is_err(),
        "a client from another root must be refused"
    );

    // Readiness: ready once Envoy fetched default and ROOTCA.
    wait_until(DEADLINE, "readiness", || async {
        rig.readiness.is_ready().then_some(())
    })
    .await?;
    assert!(metric(&rig.registry, "sds_pushes_total") >= 2.0);

    // The socket is private to the proxy's user, its directory 0750.
    use std::os::unix::fs::PermissionsExt;
    let sock = rig.tmp.path().join("run").join("sds.sock");
    assert_eq!(
        std::fs::metadata(&sock)?.permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(
        std::fs::metadata(sock.parent().unwrap())?
            .permissions()
            .mode()
            & 0o777,
        0o750
    );
    rig.stop().await
}

#[tokio::test]
async fn rewrite_rotates_and_open_connection_survives() -> Result<()> {
    let root = Ca::new("root");
    let first = root.leaf();
    let rig = Rig::start(|d| write_certs(d, &first, &root.pem)).await?;
    let client = connector(&root.pem, &root.leaf());
    wait_serial(rig.port(), &client, &first.serial).await?;
    let (mut old_conn, _) = roundtrip(rig.port(), &client).await?;

    for _ in 0..3 {
        let next = root.leaf();
        write_certs(&rig.certs, &next, &root.pem);
        wait_serial(rig.port(), &client, &next.serial).await?;
    }
    // The connection opened before the rotations still works.
    echo(&mut old_conn).await?;
    rig.stop().await
}

#[tokio::test]
async fn k8s_symlink_swap_rotates() -> Result<()> {
    let root = Ca::new("root");
    let first = root.leaf();
    let rig = Rig::start(|d| k8s_swap(d, &first, &root.pem)).await?;
    let client = connector(&root.pem, &root.leaf());
    wait_serial(rig.port(), &client, &first.serial).await?;
    let (mut old_conn, _) = roundtrip(rig.port(), &client).await?;

    for _ in 2..5 {
        let next = root.leaf();
        k8s_swap(&rig.certs, &next, &root.pem);
        wait_serial(rig.port(), &client, &next.serial).await?;
    }
    echo(&mut old_conn).await?;
    rig.stop().await
}

#[tokio::test]
async fn bad_writes_keep_the_last_good_certificate() -> Result<()> {
    let root = Ca::new("root");
    let good = root.leaf();
    let rig = Rig::start(|d| write_certs(d, &good, &root.pem)).await?;
    let client = connector(&root.pem, &root.leaf());
    wait_serial(rig.port(), &client, &good.serial).await?;
    wait_until(DEADLINE, "readiness", || async {
        rig.readiness.is_ready().then_some(())
    })
    .await?;

    let failures = || metric(&rig.registry, "cert_failures_total");
    let now = SystemTime::now();
    let other = root.leaf();
    let expired = root.leaf_with(
        now - Duration::from_secs(7200),
        now - Duration::from_secs(3600),
    );
    type Case<'a> = (&'static str, Box<dyn Fn() + 'a>);
    let cases: Vec<Case> = vec![
        (
            "garbage PEM",
            Box::new(|| std::fs::write(rig.certs.join("cert-chain.pem"), "not a pem").unwrap()),
        ),
        (
            "key not matching",
            Box::new(|| {
                std::fs::write(rig.certs.join("cert-chain.pem"), &good.chain).unwrap();
                std::fs::write(rig.certs.join("key.pem"), &other.key).unwrap();
            }),
        ),
        (
            "expired cert",
            Box::new(|| write_certs(&rig.certs, &expired, &root.pem)),
        ),
        (
            "garbage root",
            Box::new(|| {
                write_certs(&rig.certs, &good, &root.pem);
                std::fs::write(
                    rig.certs.join("root-cert.pem"),
                    "-----BEGIN CERTIFICATE-----\nQUJD\n-----END CERTIFICATE-----\n",
                )
                .unwrap();
            }),
        ),
    ];
    for (what, write) in cases {
        let before = failures();
        write();
        wait_until(DEADLINE, what, || async {
            (failures() > before).then_some(())
        })
        .await?;
        let (_, serial) = roundtrip(rig.port(), &client).await?;
        assert_eq!(
            serial, good.serial,
            "{what}: last good cert stays in service"
        );
        assert!(rig.readiness.is_ready(), "{what}: readiness does not flap");
    }
    // A good write after all that is picked up.
    let fixed = root.leaf();
    write_certs(&rig.certs, &fixed, &root.pem);
    wait_serial(rig.port(), &client, &fixed.serial).await?;
    rig.stop().await
}

#[tokio::test]
async fn missing_files_at_start_hold_readiness_then_serve() -> Result<()> {
    let rig = Rig::start(|_| {}).await?;
    let reason = wait_until(DEADLINE, "pending reason", || async {
        rig.readiness
            .pending()
            .into_iter()
            .find(|(n, r)| n == sds::READINESS_GUARD && r.contains("cert-chain.pem"))
            .map(|(_, r)| r)
    })
    .await?;
    assert!(reason.contains("cert-chain.pem"), "{reason}");

    let root = Ca::new("root");
    let leaf = root.leaf();
    write_certs(&rig.certs, &leaf, &root.pem);
    let client = connector(&root.pem, &root.leaf());
    wait_serial(rig.port(), &client, &leaf.serial).await?;
    wait_until(DEADLINE, "readiness", || async {
        rig.readiness.is_ready().then_some(())
    })
    .await?;
    rig.stop().await
}
