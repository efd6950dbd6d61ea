//! A scripted CA for the CA-mode tests.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use remora_test_support::pki::Ca;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::ca_client::{CaError, Issued, Issuer};
use super::csr::Identity;
use crate::config::KeyType;

/// A CA double whose answers are scripted: `fail` makes calls error;
/// `window` is the validity it signs, in seconds relative to the wall
/// clock at issuance (negative: in the past).
pub(super) struct FakeCa {
    pub(super) root: Ca,
    pub(super) fail: Arc<Mutex<bool>>,
    pub(super) calls: Arc<Mutex<Vec<Instant>>>,
    pub(super) window: Arc<Mutex<(i64, i64)>>,
    /// Signalled on every call, so a test sees a runaway loop at once.
    pub(super) called: Arc<Notify>,
    /// The trust bundle it sends with each answer.
    pub(super) trust: Arc<Mutex<Option<String>>>,
}

pub(super) fn fake_ca(lifetime: Duration) -> FakeCa {
    let secs = i64::try_from(lifetime.as_secs()).expect("test lifetime");
    FakeCa {
        root: Ca::new("fake-ca"),
        fail: Arc::default(),
        calls: Arc::default(),
        window: Arc::new(Mutex::new((0, secs))),
        called: Arc::default(),
        trust: Arc::default(),
    }
}

pub(super) fn offset(now: SystemTime, secs: i64) -> SystemTime {
    let d = Duration::from_secs(secs.unsigned_abs());
    if secs >= 0 { now + d } else { now - d }
}

impl Issuer for FakeCa {
    async fn issue(&self, csr_pem: String, _ttl: Duration) -> Result<Issued, CaError> {
        self.calls.lock().expect("lock").push(Instant::now());
        self.called.notify_one();
        if *self.fail.lock().expect("lock") {
            return Err(CaError::Rpc {
                code: tonic::Code::Unavailable,
                message: "down".into(),
            });
        }
        let (from, to) = *self.window.lock().expect("lock");
        let now = SystemTime::now();
        let leaf = self
            .root
            .sign_csr_valid(&csr_pem, offset(now, from), offset(now, to), &[])
            .expect("sign");
        Ok(Issued {
            chain: vec![leaf, self.root.pem.clone()],
            trust_bundle: self.trust.lock().expect("lock").clone(),
        })
    }
}

/// Let `span` of (paused) time pass and return the CA calls made; fails
/// as soon as there are more than `limit`, since a loop that never
/// sleeps would also keep the paused clock from ever reaching `span`.
pub(super) async fn calls_within(ca: &FakeCaHandles, span: Duration, limit: usize) -> Vec<Instant> {
    let start = Instant::now();
    let end = tokio::time::sleep(span);
    tokio::pin!(end);
    loop {
        tokio::select! {
            _ = &mut end => break,
            _ = ca.called.notified() => {
                let n = ca.calls.lock().expect("lock").len();
                assert!(n <= limit, "{n} CA calls within {:?}: renewal loops", start.elapsed());
            }
        }
    }
    ca.calls.lock().expect("lock").clone()
}

/// What a test keeps of a [`FakeCa`] it handed to the renewal loop.
pub(super) struct FakeCaHandles {
    pub(super) calls: Arc<Mutex<Vec<Instant>>>,
    pub(super) called: Arc<Notify>,
    pub(super) window: Arc<Mutex<(i64, i64)>>,
    pub(super) trust: Arc<Mutex<Option<String>>>,
}

impl FakeCa {
    pub(super) fn handles(&self) -> FakeCaHandles {
        FakeCaHandles {
            calls: self.calls.clone(),
            called: self.called.clone(),
            window: self.window.clone(),
            trust: self.trust.clone(),
        }
    }
}

pub(super) fn ident() -> Identity {
    Identity {
        trust_domain: "cluster.local".into(),
        namespace: "ns1".into(),
        service_account: "sa1".into(),
        key_type: KeyType::EcdsaP256,
        ttl: Duration::from_secs(3600),
    }
}

pub(super) fn ders(pem: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    super::parse_certs("test", pem).expect("PEM")
}
