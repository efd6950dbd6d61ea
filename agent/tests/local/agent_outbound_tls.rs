//! Outbound mTLS in static mode, agent to agent through real Envoys: the
//! client agent's `--outbound-tls PORT=SPIFFE_ID` originates mTLS with its
//! workload certificate (SDS `default`) and accepts only a server presenting
//! that identity under `ROOTCA`; the server agent's `--inbound-tls` admits it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use crate::support_sds::{Ca, write_certs};
use remora_test_support::pki::WORKLOAD_ID;

const SERVER_ID: &str = "spiffe://cluster.local/ns/shop/sa/server";
const OTHER_ID: &str = "spiffe://cluster.local/ns/shop/sa/impostor";

#[test]
fn outbound_mtls_reaches_the_named_server_only() {
    let root = Ca::new("mesh root");

    // Server S: mTLS on its inbound listener, admitting the client's identity only.
    let server_certs = tempfile::tempdir().expect("tempdir");
    let server_leaf = root
        .issue()
        .names(&["localhost"])
        .uri(SERVER_ID)
        .valid_for(Duration::from_secs(3600))
        .sign();
    write_certs(server_certs.path(), &server_leaf, &root.pem);
    let mut server = Agent::builder()
        .arg("--inbound-tls")
        .arg(format!("--cert-dir={}", server_certs.path().display()))
        .arg(format!("--inbound-tls-san={WORKLOAD_ID}"))
        .spawn();
    server.wait_ready();
    let upstream = server.ports.inbound;

    // Client C: two outbound listeners to S, one expecting S's identity and
    // one expecting another (from the contract's variable, comma-separated).
    let client_certs = tempfile::tempdir().expect("tempdir");
    write_certs(client_certs.path(), &root.leaf(), &root.pem);
    let (right, wrong) = (free_port(), free_port());
    let mut client = Agent::builder()
        .arg(format!("--cert-dir={}", client_certs.path().display()))
        .arg(format!("--outbound={right}:127.0.0.1:{upstream}"))
        .arg(format!("--outbound={wrong}:127.0.0.1:{upstream}"))
        .env(
            remora_contract::env::OUTBOUND_TLS,
            &format!("{right}={SERVER_ID},{wrong}={OTHER_ID}"),
        )
        .spawn();
    client.wait_ready();
    let shown = client.debug()["config"]["outbound_tls"].clone();
    assert_eq!(shown[0]["port"], right, "{shown}");
    assert_eq!(shown[0]["spiffe_id"], SERVER_ID, "{shown}");

    // Plain HTTP from the app to its sidecar reaches S's app over mTLS.
    let answer = wait_until_blocking(Duration::from_secs(10), "an answer through C", || {
        get(right, "/").ok().filter(|r| r.status == 200)
    });
    assert!(answer.body.starts_with("ok "), "{answer:?}");
    let served = server.app.requests.load(Ordering::SeqCst);
    assert!(served >= 1);

    // The listener expecting another identity refuses S: no answer at all.
    let refused = get(wrong, "/");
    assert!(
        refused.as_ref().map_or(true, |r| r.status == 503),
        "a server with the wrong identity answered: {refused:?}"
    );
    assert_eq!(
        server.app.requests.load(Ordering::SeqCst),
        served,
        "nothing reached S's app through the wrong identity"
    );

    // Straight to S's inbound without a certificate: refused.
    assert!(get(upstream, "/").is_err(), "plaintext got through");
    assert_eq!(server.app.requests.load(Ordering::SeqCst), served);
}
