use std::sync::{Arc, Mutex};

use super::*;
use crate::pki::webhook_cert::service_names;
use k8s_openapi::ByteString;

const S: fn(u64) -> Duration = Duration::from_secs;

fn policy() -> Policy {
    Policy {
        validity: Validity {
            ca: S(90),
            serving: S(30),
        },
        overlap: S(10),
        settle: S(3),
    }
}

fn names() -> Vec<String> {
    service_names("remora-operator", "remora-system")
}

fn t0() -> SystemTime {
    SystemTime::UNIX_EPOCH + S(1_800_000_000)
}

fn fresh(at: SystemTime) -> anyhow::Result<Stored> {
    Ok(Stored::new(crate::pki::webhook_cert::generate_with(
        &names(),
        policy().validity,
        at,
    )?))
}

/// Whether `cert_pem` was signed by one of the roots in `bundle`.
fn trusted_by(cert_pem: &str, bundle: &[u8]) -> bool {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let Ok(der) = CertificateDer::from_pem_slice(cert_pem.as_bytes()) else {
        return false;
    };
    let Ok((_, leaf)) = X509Certificate::from_der(&der) else {
        return false;
    };
    CertificateDer::pem_slice_iter(bundle)
        .filter_map(Result::ok)
        .any(|root| {
            X509Certificate::from_der(&root)
                .is_ok_and(|(_, r)| leaf.verify_signature(Some(r.public_key())).is_ok())
        })
}

const STAGE: Action = Action::Root(Step::Stage);
const SWITCH: Action = Action::Root(Step::Switch);
const RETIRE: Action = Action::Root(Step::Retire);
const CREATE: Action = Action::Root(Step::Create);

/// The webhook's half of a rotation: serving renewals throughout, the
/// switch once the caBundle carries the staged root, a serving certificate
/// of the new root at the switch, the old root kept `overlap` after it.
#[test]
fn a_ca_rotation_is_staged_published_switched_then_retired() -> anyhow::Result<()> {
    let p = policy();
    let mut s = fresh(t0())?;
    let a_root = s.roots.current.cert_pem.clone();
    // Serving renewals at 2/3 of 30 s; the CA is due at 60 s.
    assert_eq!(plan(&s, false, t0(), &p).wake, t0() + S(20));
    let mut t = t0() + S(20);
    while t < t0() + S(60) {
        let pl = plan(&s, false, t, &p);
        if pl.action == Some(Action::Renew) {
            s = apply(&s, Action::Renew, &names(), &p, t)?;
        } else {
            assert_eq!(pl.action, None, "at {t:?}");
            t = pl.wake.min(t0() + S(60));
        }
    }
    // Step 1: stage. The serving certificate stays the old CA's.
    let pl = plan(&s, false, t, &p);
    assert_eq!(pl.action, Some(STAGE));
    let staged = apply(&s, STAGE, &names(), &p, t)?;
    assert_eq!(staged.current(), s.current());
    // The serving certificate is due too: renewed from the old CA.
    assert_eq!(plan(&staged, false, t, &p).action, Some(Action::Renew));
    let staged = apply(&staged, Action::Renew, &names(), &p, t)?;
    let b_root = staged
        .roots
        .next
        .clone()
        .map(|n| n.cert_pem)
        .unwrap_or_default();
    let both = trust_bundle(&staged.roots, t);
    assert!(bundle_has_root(both.as_bytes(), &a_root));
    assert!(bundle_has_root(both.as_bytes(), &b_root));
    // Step 2 waits for publication and then for `settle`.
    let later = t + S(10);
    assert_eq!(plan(&staged, false, later, &p).action, None);
    let early = plan(&staged, true, t + S(1), &p);
    assert_eq!((early.action, early.wake), (None, t + S(3)));
    assert_eq!(plan(&staged, true, t + S(3), &p).action, Some(SWITCH));
    let t = t + S(3);
    let switched = apply(&staged, SWITCH, &names(), &p, t)?;
    assert_eq!(switched.roots.current.cert_pem, b_root);
    assert_eq!(switched.roots.previous.as_deref(), Some(a_root.as_str()));
    assert_eq!(switched.roots.next, None);
    assert_eq!(
        crate::pki::webhook_cert::unusable(&switched.current(), t),
        None
    );
    assert!(trusted_by(&switched.cert_pem, b_root.as_bytes()));
    assert!(!trusted_by(&switched.cert_pem, a_root.as_bytes()));
    // The caBundle text does not change at the switch (oldest first).
    assert_eq!(trust_bundle(&switched.roots, t), both);
    // Step 3: the old root stays for the overlap from the serving
    // certificate's start, then leaves.
    let overlap = plan(&switched, false, t + S(1), &p);
    assert_eq!((overlap.action, overlap.wake), (None, t + S(10)));
    let pl = plan(&switched, false, t + S(10), &p);
    assert_eq!(pl.action, Some(RETIRE), "{pl:?}");
    let retired = apply(&switched, RETIRE, &names(), &p, t + S(10))?;
    assert_eq!(retired.roots.previous, None);
    assert_eq!(retired.current(), switched.current());
    assert_eq!(
        trust_bundle(&retired.roots, t + S(10)),
        format!("{}\n", b_root.trim_end())
    );
    // The new CA is due at two thirds of its own life, from its staging.
    let staged_at = t - S(3);
    let mut next = plan(&retired, false, t + S(10), &p).wake;
    let mut r = retired;
    while next < staged_at + S(60) {
        if plan(&r, false, next, &p).action == Some(Action::Renew) {
            r = apply(&r, Action::Renew, &names(), &p, next)?;
        }
        next = plan(&r, false, next, &p).wake;
    }
    assert_eq!(plan(&r, false, next, &p).action, Some(STAGE));
    // Round trip through the Secret keeps every part.
    for s in [&staged, &switched] {
        assert_eq!(&stored_from_secret(&stored_to_secret("s", "ns", s))?, s);
    }
    Ok(())
}

/// What the webhook adds to the shared checks: a serving certificate that
/// cannot be served replaces the CA too (the old root, still valid, stays
/// trusted for the overlap), and half a staged CA in the Secret is none.
#[test]
fn an_unservable_bundle_is_regenerated() -> anyhow::Result<()> {
    let p = policy();
    let t = t0() + S(1);
    let s = fresh(t0())?;
    let other = fresh(t0())?;
    // A staged CA whose key is another's: dropped on its own.
    let foreign_key = Stored {
        roots: Roots {
            next: Some(CaPair {
                cert_pem: other.roots.current.cert_pem.clone(),
                key_pem: s.roots.current.key_pem.clone(),
            }),
            ..s.roots.clone()
        },
        ..s.clone()
    };
    assert_eq!(plan(&foreign_key, true, t, &p).action, Some(RETIRE));
    assert_eq!(apply(&foreign_key, RETIRE, &names(), &p, t)?, s);
    // Half a staged CA (no key) is not one.
    let mut secret = stored_to_secret("s", "ns", &s);
    if let Some(d) = secret.data.as_mut() {
        d.insert(NEXT_CA_KEY.into(), ByteString(b"x".to_vec()));
    }
    assert_eq!(stored_from_secret(&secret)?, s);
    // An expired CA and serving certificate: a new one.
    let pl = plan(&s, false, t0() + S(91), &p);
    assert_eq!(pl.action, Some(CREATE));
    assert!(pl.why.contains("not valid now"), "{pl:?}");
    let renewed = apply(&s, CREATE, &names(), &p, t0() + S(91))?;
    let usable = crate::pki::webhook_cert::unusable(&renewed.current(), t0() + S(92));
    assert_eq!(usable, None);
    // A serving key not matching its certificate: a new CA and
    // certificate, the old (still valid) root kept for the overlap.
    let mismatched = Stored {
        key_pem: other.key_pem.clone(),
        ..s.clone()
    };
    let pl = plan(&mismatched, false, t, &p);
    assert_eq!(pl.action, Some(CREATE), "{pl:?}");
    let repaired = apply(&mismatched, CREATE, &names(), &p, t)?;
    let usable = crate::pki::webhook_cert::unusable(&repaired.current(), t);
    assert_eq!(usable, None);
    assert_eq!(
        repaired.roots.previous.as_deref(),
        Some(s.roots.current.cert_pem.as_str())
    );
    // Retired `overlap` after the new serving certificate's start.
    assert_eq!(plan(&repaired, false, t + S(10), &p).action, Some(RETIRE));
    Ok(())
}

/// The Secret and the webhook configuration in memory, with
/// resourceVersions, yielding inside each call so that replicas interleave.
#[derive(Clone, Default)]
struct MemStore(Arc<Mutex<Mem>>);

#[derive(Default)]
struct Mem {
    secret: Option<Secret>,
    rv: u64,
    /// The caBundle of the configuration's two webhooks.
    mwc: Vec<Vec<u8>>,
    conflicts: usize,
    /// (warning, reason) of every recorded Event.
    events: Vec<(bool, String)>,
}

impl MemStore {
    fn with<T>(&self, f: impl FnOnce(&mut Mem) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Store for MemStore {
    fn get(&self) -> impl Future<Output = Result<Option<Secret>, CaError>> + Send {
        let me = self.clone();
        async move {
            tokio::task::yield_now().await;
            Ok(me.with(|m| m.secret.clone()))
        }
    }

    fn write(&self, mut s: Secret) -> impl Future<Output = Result<bool, CaError>> + Send {
        let me = self.clone();
        async move {
            tokio::task::yield_now().await;
            Ok(me.with(|m| {
                let stored_rv = m.secret.as_ref().map(|_| m.rv.to_string());
                if s.metadata.resource_version != stored_rv {
                    m.conflicts += 1;
                    return false;
                }
                m.rv += 1;
                s.metadata.resource_version = Some(m.rv.to_string());
                m.secret = Some(s);
                true
            }))
        }
    }

    fn published(&self) -> impl Future<Output = Result<Vec<Vec<u8>>, CaError>> + Send {
        let me = self.clone();
        async move { Ok(me.with(|m| m.mwc.clone())) }
    }

    fn record(
        &self,
        warning: bool,
        reason: &str,
        _note: String,
    ) -> impl Future<Output = ()> + Send {
        self.with(|m| m.events.push((warning, reason.to_string())));
        async {}
    }
}

fn served(dir: &std::path::Path) -> String {
    std::fs::read_to_string(dir.join(crate::pki::webhook_cert::CERT_KEY)).unwrap_or_default()
}

struct Replicas {
    store: MemStore,
    clock: Clock,
    dirs: [tempfile::TempDir; 2],
    metrics: [Metrics; 2],
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Replicas {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Two replicas on one store, and a caBundle keeper that publishes what
/// replica 0 wants five seconds late, longer than `settle` (the API
/// server's copy lags).
fn start_replicas(anchor: SystemTime) -> anyhow::Result<Replicas> {
    let store = MemStore::default();
    let clock = Clock::tokio(anchor);
    let dirs = [tempfile::tempdir()?, tempfile::tempdir()?];
    let metrics = [Metrics::default(), Metrics::default()];
    let mut tasks = Vec::new();
    let mut rxs = Vec::new();
    for i in 0..2 {
        let (tx, rx) = tokio::sync::watch::channel(String::new());
        rxs.push(rx);
        let r = Rotator {
            store: store.clone(),
            secret: "remora-operator-tls".into(),
            namespace: "remora-system".into(),
            names: names(),
            policy: policy(),
            dir: dirs[i].path().to_path_buf(),
            period: S(2),
            clock,
            metrics: metrics[i].clone(),
        };
        tasks.push(tokio::spawn(r.run(Bundle::default(), tx)));
    }
    let (keeper, mut rx) = (store.clone(), rxs.swap_remove(0));
    tasks.push(tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let want = rx.borrow_and_update().clone().into_bytes();
            tokio::time::sleep(S(5)).await;
            keeper.with(|m| m.mwc = vec![want.clone(), want]);
        }
    }));
    Ok(Replicas {
        store,
        clock,
        dirs,
        metrics,
        tasks,
    })
}

#[tokio::test(start_paused = true)]
async fn two_replicas_rotate_the_ca_and_never_serve_an_untrusted_certificate() -> anyhow::Result<()>
{
    let anchor = SystemTime::now();
    let r = start_replicas(anchor)?;
    let start = tokio::time::Instant::now();
    let mut roots = std::collections::BTreeSet::new();
    // Three CA lifetimes, checked every 250 ms: what each replica serves is
    // signed by a root every webhook of the configuration trusts.
    while start.elapsed() < S(270) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let mwc = r.store.with(|m| m.mwc.clone());
        for (i, dir) in r.dirs.iter().enumerate() {
            let cert = served(dir.path());
            if cert.is_empty() || mwc.is_empty() {
                // Before the first write and the first publication.
                assert!(start.elapsed() < S(8), "replica {i} serves nothing");
                continue;
            }
            for (w, bundle) in mwc.iter().enumerate() {
                assert!(
                    trusted_by(&cert, bundle),
                    "at {:?}: replica {i} serves a certificate webhook {w}'s caBundle does not trust",
                    start.elapsed()
                );
            }
        }
        if let Some(s) = r.store.with(|m| m.secret.clone()) {
            let st = stored_from_secret(&s)?;
            roots.insert(st.roots.current.cert_pem);
        }
    }
    // CAs due at 60 s of each 90 s life: three rotations in 270 s, one CA
    // shared by both replicas at the end, and no old root left behind once
    // the overlap is over.
    assert!(roots.len() >= 4, "{} CAs", roots.len());
    let rotations: u64 = r.metrics.iter().map(|m| m.ca_rotations.get()).sum();
    assert!(rotations >= 3, "{rotations} rotations");
    let events = r.store.with(|m| m.events.clone());
    let rotated = events.iter().filter(|e| e.1 == "CARotated").count();
    assert_eq!(rotated as u64, rotations, "{events:?}");
    let secret = r.store.with(|m| m.secret.clone());
    let stored = stored_from_secret(&secret.unwrap_or_default())?;
    let now = r.clock.now();
    for dir in &r.dirs {
        assert!(trusted_by(
            &served(dir.path()),
            stored.roots.current.cert_pem.as_bytes()
        ));
    }
    assert_eq!(
        crate::pki::webhook_cert::unusable(&stored.current(), now),
        None
    );
    let expiry = r.metrics[0].serving_cert_expiry.get();
    assert!(expiry > 0, "expiry metric unset");
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_corrupted_secret_is_repaired_and_both_replicas_follow() -> anyhow::Result<()> {
    let anchor = SystemTime::now();
    let r = start_replicas(anchor)?;
    // Both serve the first Secret.
    tokio::time::sleep(S(5)).await;
    let first = r.store.with(|m| m.secret.clone()).unwrap_or_default();
    let first_ca = stored_from_secret(&first)?.roots.current.cert_pem;
    for dir in &r.dirs {
        assert!(trusted_by(&served(dir.path()), first_ca.as_bytes()));
    }
    // Garbage in the key: replaced within a period or two, and both
    // replicas serve the repaired pair.
    r.store.with(|m| {
        if let Some(d) = m.secret.as_mut().and_then(|s| s.data.as_mut()) {
            d.insert(
                crate::pki::webhook_cert::KEY_KEY.into(),
                ByteString(b"garbage".to_vec()),
            );
        }
    });
    let st = remora_test_support::wait::wait_until(S(10), "the Secret repaired and served", || {
        let check = || {
            let s = r.store.with(|m| m.secret.clone())?;
            let st = stored_from_secret(&s).ok()?;
            let ok = crate::pki::webhook_cert::unusable(&st.current(), r.clock.now()).is_none()
                && r.dirs.iter().all(|d| served(d.path()) == st.cert_pem);
            ok.then_some(st)
        };
        let v = check();
        async move { v }
    })
    .await?;
    // The old root, still valid, stays trusted for the overlap.
    assert_eq!(st.roots.previous.as_deref(), Some(first_ca.as_str()));
    let events = r.store.with(|m| m.events.clone());
    assert!(
        events.contains(&(true, "CertificateRepaired".into())),
        "{events:?}"
    );
    // A deleted Secret is made again.
    r.store.with(|m| m.secret = None);
    tokio::time::sleep(S(5)).await;
    assert!(r.store.with(|m| m.secret.is_some()));
    Ok(())
}
