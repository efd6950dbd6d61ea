//! The whole agent with certificates: `remora-agent run --inbound-tls
//! --cert-dir DIR` terminates mTLS on its inbound listener with the workload
//! certificate it serves to Envoy over SDS, and readiness waits for it.

use std::time::Duration;

use crate::support::*;
use crate::support_sds::{Ca, Leaf, connect_tls, connector, write_certs};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;

/// One HTTP request over mTLS; returns the status line and the serial Envoy presented.
fn https_get(port: u16, tls: &TlsConnector) -> anyhow::Result<(String, String)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (mut s, serial) = connect_tls(port, tls).await?;
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await?;
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await??;
        let text = String::from_utf8_lossy(&out).into_owned();
        Ok((text.lines().next().unwrap_or("").to_string(), serial))
    })
}

fn tls_agent(cert_dir: &std::path::Path) -> Agent {
    Agent::builder()
        .arg("--inbound-tls")
        .arg(format!("--cert-dir={}", cert_dir.display()))
        .arg("--inbound-tls-san=spiffe://cluster.local/ns/test/sa/test")
        .spawn()
}

#[test]
fn inbound_mtls_from_sds_admits_same_root_only() {
    let root = Ca::new("workload root");
    let leaf: Leaf = root.leaf();
    let certs = tempfile::tempdir().expect("tempdir");
    write_certs(certs.path(), &leaf, &root.pem);
    let mut agent = tls_agent(certs.path());
    agent.wait_ready();

    let client = root.leaf();
    let (status, serial) =
        https_get(agent.ports.inbound, &connector(&root.pem, &client)).expect("mTLS request");
    assert!(status.contains("200"), "{status}");
    assert_eq!(
        serial, leaf.serial,
        "Envoy presents the workload certificate"
    );

    let other = Ca::new("someone else");
    let stranger = other.leaf();
    let refused = https_get(agent.ports.inbound, &connector(&root.pem, &stranger));
    assert!(
        refused.is_err(),
        "a client from another root got through: {refused:?}"
    );

    // Plaintext is refused too.
    assert!(get(agent.ports.inbound, "/").is_err());

    // Rotation reaches Envoy through the agent, no restart.
    let next = root.leaf();
    write_certs(certs.path(), &next, &root.pem);
    wait_until_blocking(Duration::from_secs(10), "the rotated certificate", || {
        let (_, s) = https_get(agent.ports.inbound, &connector(&root.pem, &client)).ok()?;
        (s == next.serial).then_some(())
    });
    assert_eq!(agent.debug()["envoy"]["epoch"], 0);
}

/// Waits for readiness to answer 503 naming the certificates.
fn not_ready_for_certificates(agent: &Agent) {
    wait_until_blocking(
        Duration::from_secs(20),
        "a 503 naming the certificates",
        || {
            let r = get(agent.ports.health, "/healthz/ready").ok()?;
            (r.status == 503 && r.body.contains("certificates:")).then_some(())
        },
    );
}

#[test]
fn readiness_waits_for_certificates() {
    let root = Ca::new("late root");
    let certs = tempfile::tempdir().expect("tempdir");
    let mut agent = tls_agent(certs.path());
    not_ready_for_certificates(&agent);
    assert!(agent.is_running());

    write_certs(certs.path(), &root.leaf(), &root.pem);
    agent.wait_ready();
}

/// Certificates configured but used by no listener (no `--inbound-tls`, no
/// workload CA): Envoy never asks for them, so readiness does not wait for
/// them, whether they are there or never come (an empty directory).
#[test]
fn certificates_no_listener_uses_do_not_hold_readiness() {
    let root = Ca::new("unused root");
    let certs = tempfile::tempdir().expect("tempdir");
    write_certs(certs.path(), &root.leaf(), &root.pem);
    let empty = tempfile::tempdir().expect("tempdir");
    for args in [
        vec![format!("--cert-dir={}", certs.path().display())],
        vec![format!("--cert-dir={}", empty.path().display())],
    ] {
        let mut agent = Agent::builder().args(args.clone()).spawn();
        agent.wait_ready();
        let r = get(agent.ports.health, "/healthz/ready").expect("readiness");
        assert!(
            r.status == 200 && !r.body.contains("certificates"),
            "{args:?}: {} {}",
            r.status,
            r.body
        );
    }
}

/// With the workload CA wired, the inbound listener takes the mesh's mTLS
/// beside plain text (permissive): the pod is meshed, and is ready only
/// once it can serve meshed clients, so a CA that is down holds readiness
/// on the certificates (plain text alone would take calls a meshed client
/// then cannot make).
#[test]
fn the_workload_ca_down_holds_readiness_of_a_permissive_inbound() {
    let empty = tempfile::tempdir().expect("tempdir");
    let ca_down = free_port();
    let agent = Agent::builder()
        .arg(format!("--ca-address=http://127.0.0.1:{ca_down}"))
        .arg(format!(
            "--token-path={}",
            empty.path().join("token").display()
        ))
        .spawn();
    not_ready_for_certificates(&agent);
}
