//! Keeping a CA-issued certificate fresh: when to renew (a fraction of the
//! lifetime, less jitter so a fleet does not renew in step, never sooner
//! than a floor after the last issuance), how to back off after a failure
//! (jittered exponential up to a cap, the current certificate still
//! served), and the loop that does it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use backon::{BackoffBuilder, ExponentialBuilder};
use rand::Rng;
use tokio_util::sync::CancellationToken;

use super::ca_client::Issuer;
use super::csr::{CsrError, Identity};
use super::output::{bundle_from_chain, write_output};
use super::roots::{TrustRoots, same_roots};
use super::{BundleSender, CertBundle, CertError};

/// When to renew and how to back off.
#[derive(Debug, Clone)]
pub struct RenewPolicy {
    /// Renew after this fraction of the lifetime (0..1).
    pub fraction: f64,
    /// Renew up to this fraction of the lifetime earlier, at random.
    pub jitter: f64,
    /// Never ask the CA again sooner than this after a successful issuance.
    /// A back-dated or very short certificate, or a clock skewed against the
    /// CA's, puts the renewal point in the past at receipt; without a floor
    /// renewal would call the CA in a loop.
    pub min_interval: Duration,
    /// First wait after a failure; doubles per consecutive failure.
    pub min_backoff: Duration,
    /// Cap of the failure wait (jitter only ever shortens it).
    pub max_backoff: Duration,
    /// Each failure wait is shortened by up to this fraction (0..1), at
    /// random, so a fleet that lost its CA together does not retry in step.
    pub backoff_jitter: f64,
}

impl Default for RenewPolicy {
    fn default() -> Self {
        Self {
            fraction: 0.5,
            jitter: 0.05,
            min_interval: Duration::from_secs(30),
            min_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            backoff_jitter: 0.25,
        }
    }
}

/// `x` clamped to 0..=1; a NaN (a policy built by hand) counts as `default`.
fn unit(x: f64, default: f64) -> f64 {
    if x.is_nan() {
        default
    } else {
        x.clamp(0.0, 1.0)
    }
}

impl RenewPolicy {
    /// Delay from `now` until renewal of `b`; `u` in [0,1) picks the jitter.
    /// Never below [`RenewPolicy::min_interval`].
    pub fn renew_delay(&self, b: &CertBundle, now: SystemTime, u: f64) -> Duration {
        let due = self.renew_due(b, now, u);
        due.max(self.min_interval)
    }

    /// Time from `now` to the renewal point itself (zero when already past).
    fn renew_due(&self, b: &CertBundle, now: SystemTime, u: f64) -> Duration {
        let frac = unit(
            unit(self.fraction, 0.5) - unit(self.jitter, 0.0) * unit(u, 0.0),
            0.5,
        );
        // `frac` is within 0..=1, so this stays within the certificate's own window.
        let at = b
            .not_before
            .checked_add(b.lifetime().mul_f64(frac))
            .unwrap_or(b.not_after);
        at.duration_since(now).unwrap_or_default()
    }

    /// Consecutive failure waits: exponential from `min_backoff`, capped.
    fn backoff(&self) -> impl Iterator<Item = Duration> + Send + use<> {
        ExponentialBuilder::default()
            .with_min_delay(self.min_backoff)
            .with_max_delay(self.max_backoff.max(self.min_backoff))
            .with_factor(2.0)
            .without_max_times()
            .build()
    }

    /// A failure wait shortened by the jitter; `u` in [0,1).
    pub fn jittered(&self, wait: Duration, u: f64) -> Duration {
        wait.mul_f64(1.0 - unit(self.backoff_jitter, 0.0) * unit(u, 0.0))
    }
}

/// Issue, publish, sleep until renewal; on failure back off. Runs until
/// cancelled. Between two CA calls there is always at least
/// `policy.min_interval` after a success and the (jittered, capped)
/// backoff after a failure; the last good bundle stays published meanwhile.
///
/// The roots served for peers are the CA's answer alone (its trust bundle
/// and chain root). A `roots` file that comes to differ from them (a staged
/// or retired root, or an edit by someone else) makes the agent ask the CA
/// again, once per content and no sooner than `policy.min_interval` after
/// the last call; what the file holds is never served.
pub async fn run_renewal<I: Issuer>(
    issuer: I,
    ident: Identity,
    policy: RenewPolicy,
    mut roots: TrustRoots,
    output_dir: Option<PathBuf>,
    out: BundleSender,
    cancel: CancellationToken,
) {
    let source = "CA";
    let mut backoff = policy.backoff();
    // Warn once per run of certificates that are due at receipt, not every floor.
    let mut warned_due = false;
    // A closed roots channel (no --ca-root-cert watcher) never changes again.
    let mut roots_open = true;
    // The file content the last CA call answered (or that prompted one).
    let mut checked: Option<Arc<str>> = None;
    loop {
        let called = tokio::time::Instant::now();
        checked = roots.borrow_and_update().clone().or(checked);
        let result = async {
            // Key generation is CPU work (seconds for RSA): keep it off the runtime's threads.
            let id = ident.clone();
            let (key, csr) = tokio::task::spawn_blocking(move || id.key_and_csr())
                .await
                .map_err(|e| CsrError::Key(e.to_string()))??;
            let issued = issuer.issue(csr, ident.ttl).await?;
            let b = bundle_from_chain(
                issued.chain,
                key.serialize_pem(),
                issued.trust_bundle.as_deref(),
            )?;
            Ok::<_, CertError>(b)
        }
        .await;
        let wait = match result {
            Ok(b) => {
                backoff = policy.backoff();
                let now = SystemTime::now();
                let u: f64 = rand::rng().random();
                let due = policy.renew_due(&b, now, u);
                let delay = policy.renew_delay(&b, now, u);
                if due < policy.min_interval {
                    if !warned_due {
                        tracing::warn!(serial = %b.serial, lifetime = ?b.lifetime(), renew_in = ?delay,
                            "the CA's certificate is due for renewal already (back-dated, very short, or clocks disagree); renewing no sooner than the minimum interval");
                    }
                    warned_due = true;
                } else {
                    warned_due = false;
                }
                if let Some(dir) = &output_dir
                    && let Err(e) = write_output(dir, &b)
                {
                    out.fail(source, &e);
                }
                tracing::info!(serial = %b.serial, renew_in = ?delay, "workload certificate issued");
                out.publish(b);
                delay
            }
            Err(e) => {
                out.fail(source, &e);
                let d = backoff.next().unwrap_or(policy.max_backoff);
                if let Some(cur) = out.current()
                    && cur.not_after <= SystemTime::now()
                {
                    tracing::error!(serial = %cur.serial, "workload certificate expired and the CA is unreachable");
                }
                policy.jittered(d, rand::rng().random())
            }
        };
        let now = tokio::time::Instant::now();
        // Saturate: a huge wait is "a day from now", never a panic.
        let mut deadline = now
            .checked_add(wait)
            .unwrap_or_else(|| now + Duration::from_secs(86_400));
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep_until(deadline) => break,
                changed = roots.changed(), if roots_open => {
                    if changed.is_err() {
                        roots_open = false;
                        continue;
                    }
                    let Some(file) = roots.borrow_and_update().clone() else {
                        continue;
                    };
                    let served = out.current().map(|b| b.roots_pem.clone()).unwrap_or_default();
                    if checked.as_ref() == Some(&file) || same_roots(&file, &served) {
                        continue;
                    }
                    checked = Some(file);
                    let soonest = called + policy.min_interval;
                    if soonest < deadline {
                        deadline = soonest.max(tokio::time::Instant::now());
                        tracing::info!(ask_in = ?deadline.saturating_duration_since(tokio::time::Instant::now()),
                            "the trust bundle file differs from the roots the CA gave; asking the CA again (the file's roots are not trusted)");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::CertMetrics;
    use super::super::testing::{FakeCa, calls_within, ders, fake_ca, ident};
    use super::*;
    use remora_test_support::pki::Ca;
    use remora_test_support::wait::wait_until;
    use tokio::sync::watch;
    use tokio::time::Instant;

    fn gaps(c: &[Instant]) -> Vec<Duration> {
        c.windows(2).map(|w| w[1] - w[0]).collect()
    }

    #[test]
    fn renew_delay_is_half_life_minus_jitter() {
        let now = SystemTime::now();
        let b = CertBundle {
            chain_pem: String::new(),
            key_pem: String::new(),
            roots_pem: String::new(),
            not_before: now,
            not_after: now + Duration::from_secs(1000),
            serial: String::new(),
        };
        let p = RenewPolicy::default();
        assert_eq!(p.renew_delay(&b, now, 0.0), Duration::from_secs(500));
        assert_eq!(p.renew_delay(&b, now, 1.0), Duration::from_secs(450));
        // Past the renewal point, or past the end: the floor, never zero.
        for late in [600, 5000] {
            assert_eq!(
                p.renew_delay(&b, now + Duration::from_secs(late), 0.0),
                p.min_interval
            );
        }
        // A policy built with nonsense fractions neither panics nor loops.
        let odd = RenewPolicy {
            fraction: f64::NAN,
            jitter: f64::INFINITY,
            ..RenewPolicy::default()
        };
        assert!(odd.renew_delay(&b, now, 0.5) >= odd.min_interval);
        let odd = RenewPolicy {
            backoff_jitter: f64::NAN,
            ..RenewPolicy::default()
        };
        assert_eq!(
            odd.jittered(Duration::from_secs(8), 0.9),
            Duration::from_secs(8)
        );
    }

    fn spawn(ca: FakeCa, policy: RenewPolicy) -> (BundleSender, CancellationToken) {
        // No --ca-root-cert: the sender goes at once, as in `CaSource::run`.
        let (out, cancel, _) = spawn_with_roots(ca, policy, watch::channel(None).1);
        (out, cancel)
    }

    fn spawn_with_roots(
        ca: FakeCa,
        policy: RenewPolicy,
        roots: TrustRoots,
    ) -> (BundleSender, CancellationToken, tempfile::TempDir) {
        let out = BundleSender::new(CertMetrics::default());
        let cancel = CancellationToken::new();
        let dir = tempfile::tempdir().expect("tmp");
        tokio::spawn(run_renewal(
            ca,
            ident(),
            policy,
            roots,
            Some(dir.path().join("out")),
            out.clone(),
            cancel.clone(),
        ));
        (out, cancel, dir)
    }

    /// The trust bundle file gains a root (an edit by whoever may write the
    /// ConfigMap): the agent asks the CA again, once, no sooner than the
    /// floor, and serves what the CA said, never the file's extra root. A
    /// root the CA stages does reach the served roots that way.
    #[tokio::test(start_paused = true)]
    async fn the_trust_bundle_file_prompts_a_ca_call_but_never_adds_a_root() {
        let ca = fake_ca(Duration::from_secs(1000));
        let h = ca.handles();
        let chain_root = ca.root.pem.clone();
        *h.trust.lock().expect("lock") = Some(chain_root.clone());
        let (tx, rx) = watch::channel(Some(Arc::<str>::from(chain_root.as_str())));
        let policy = RenewPolicy::default();
        let (out, cancel, dir) = spawn_with_roots(ca, policy.clone(), rx);
        let mut bundles = out.subscribe();
        bundles.wait_for(|b| b.is_some()).await.expect("first");
        let first = out.current().expect("bundle");
        assert_eq!(ders(&first.roots_pem), ders(&chain_root));

        // The attack: the file gains a root of someone else's.
        let attacker = Ca::new("attacker root");
        let poisoned = format!("{chain_root}{}", attacker.pem);
        tx.send_replace(Some(poisoned.as_str().into()));
        let c = calls_within(&h, policy.min_interval * 4, 2).await;
        assert_eq!(c.len(), 2, "one more CA call for the changed file");
        assert!(
            c[1] - c[0] >= policy.min_interval,
            "not sooner than the floor"
        );
        let now = out.current().expect("bundle");
        assert_eq!(
            ders(&now.roots_pem),
            ders(&chain_root),
            "the file's extra root is not served"
        );
        assert!(!now.roots_pem.contains(attacker.pem.trim()));
        let written = super::super::file::load_dir(&dir.path().join("out")).expect("files");
        assert!(!written.roots_pem.contains(attacker.pem.trim()));

        // The CA stages a root: the file's change brings it in, by a CA call.
        let next = Ca::new("staged root");
        let both = format!("{chain_root}{}", next.pem);
        *h.trust.lock().expect("lock") = Some(both.clone());
        tx.send_replace(Some(both.as_str().into()));
        let c = calls_within(&h, policy.min_interval * 2, 3).await;
        assert_eq!(c.len(), 3);
        assert_eq!(ders(&out.current().expect("bundle").roots_pem), ders(&both));
        // The same content again, or the roots served already: no call.
        tx.send_replace(Some(both.as_str().into()));
        let c = calls_within(&h, policy.min_interval * 2, 3).await;
        assert_eq!(c.len(), 3);
        cancel.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn renews_at_half_life() {
        let ca = fake_ca(Duration::from_secs(1000));
        let calls = ca.calls.clone();
        let policy = RenewPolicy {
            jitter: 0.0,
            ..RenewPolicy::default()
        };
        let start = Instant::now();
        let (out, cancel) = spawn(ca, policy);
        let mut rx = out.subscribe();
        rx.wait_for(|b| b.is_some()).await.expect("first");
        let first = out.current().expect("bundle").serial.clone();
        // Auto-advancing paused time jumps straight to the renewal.
        rx.changed().await.expect("renewed");
        let second = out.current().expect("bundle").serial.clone();
        assert_ne!(first, second);
        let c = calls.lock().expect("lock").clone();
        assert_eq!(c.len(), 2);
        let gap = c[1] - start;
        // Wall-clock time moves a little while tokio's is paused; allow for it.
        assert!(
            gap >= Duration::from_secs(495) && gap <= Duration::from_secs(500),
            "{gap:?}"
        );
        cancel.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_exponentially_and_keep_serving() {
        let ca = fake_ca(Duration::from_secs(1000));
        let calls = ca.calls.clone();
        let fail = ca.fail.clone();
        let policy = RenewPolicy {
            jitter: 0.0,
            backoff_jitter: 0.0,
            ..RenewPolicy::default()
        };
        let (out, cancel) = spawn(ca, policy);
        let mut rx = out.subscribe();
        rx.wait_for(|b| b.is_some()).await.expect("first");
        let good = out.current().expect("bundle");
        *fail.lock().expect("lock") = true;
        // The renewal at 500 s, then retries 1, 2, 4, 8 and 16 s apart.
        let retried = || std::future::ready((calls.lock().expect("lock").len() >= 7).then_some(()));
        wait_until(
            Duration::from_secs(600),
            "the renewal and 5 retries",
            retried,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let c = calls.lock().expect("lock").clone();
        let gaps: Vec<u64> = c
            .windows(2)
            .skip(1)
            .map(|w| (w[1] - w[0]).as_secs())
            .collect();
        assert_eq!(gaps, vec![1, 2, 4, 8, 16], "exponential backoff");
        assert_eq!(out.current(), Some(good), "last good bundle kept");
        assert!(out.status().borrow().is_none(), "readiness does not flap");
        // Recovery: the next retry succeeds and backoff resets.
        *fail.lock().expect("lock") = false;
        rx.changed().await.expect("recovered");
        cancel.cancel();
    }

    /// Checks failure waits: the n-th within [(1 - jitter) * base, base]
    /// with base = min(min_backoff * 2^n, max_backoff), and the jitter seen.
    fn assert_backoff(what: &str, waits: &[Duration], p: &RenewPolicy) {
        // Paused-time sleeps end on the next whole millisecond.
        let tick = Duration::from_millis(1);
        let mut base = p.min_backoff;
        let mut shortened = 0;
        for (i, w) in waits.iter().enumerate() {
            let low = base.mul_f64(1.0 - p.backoff_jitter);
            assert!(
                *w >= low && *w <= base + tick,
                "{what}: wait {i} is {w:?}, not within [{low:?}, {base:?}]: {waits:?}"
            );
            if *w + tick < base {
                shortened += 1;
            }
            base = (base * 2).min(p.max_backoff);
        }
        assert!(
            shortened * 2 >= waits.len(),
            "{what}: jitter shortened only {shortened} of {} waits",
            waits.len()
        );
    }

    /// Certificates already due for renewal when they arrive: back-dated, a
    /// CA clock behind ours, a lifetime of seconds. Over ten minutes of
    /// paused time the CA is called once at start and then once per
    /// `min_interval`, and every answer is published.
    #[tokio::test(start_paused = true)]
    async fn certificates_due_at_receipt_renew_no_sooner_than_the_floor() {
        for (what, window) in [
            ("back-dated by an hour, ten minutes left", (-3600, 600)),
            ("CA clock 40 min behind, 1 h lifetime", (-2400, 1200)),
            ("2 s lifetime", (0, 2)),
        ] {
            let ca = fake_ca(Duration::from_secs(1));
            *ca.window.lock().expect("lock") = window;
            let h = ca.handles();
            let policy = RenewPolicy::default();
            let (out, cancel) = spawn(ca, policy.clone());
            let c = calls_within(&h, Duration::from_secs(600), 25).await;
            cancel.cancel();
            // t = 0, 30, …, 570 and maybe 600 (it ties with the end of the span).
            assert!((20..=21).contains(&c.len()), "{what}: {} calls", c.len());
            for g in gaps(&c) {
                assert!(g >= policy.min_interval, "{what}: {g:?} between CA calls");
            }
            assert_eq!(out.metrics.failures.get(), 0, "{what}");
            assert_eq!(
                out.metrics.updates.get(),
                u64::try_from(c.len()).expect("count"),
                "{what}: each valid answer is served"
            );
        }
    }

    /// A CA that answers with certificates expired at receipt: each is
    /// refused, the retries follow the failure backoff, and the last good
    /// certificate stays in service.
    #[tokio::test(start_paused = true)]
    async fn expired_answers_back_off_and_keep_the_last_good() {
        let ca = fake_ca(Duration::from_secs(1000));
        let h = ca.handles();
        let policy = RenewPolicy::default();
        let (out, cancel) = spawn(ca, policy.clone());
        out.subscribe()
            .wait_for(|b| b.is_some())
            .await
            .expect("first");
        let good = out.current().expect("bundle");
        *h.window.lock().expect("lock") = (-7200, -3600);
        // The renewal (before 500 s), then ten minutes of retries.
        let c = calls_within(&h, Duration::from_secs(1100), 30).await;
        cancel.cancel();
        assert!(c.len() >= 14, "{} calls", c.len());
        assert_backoff("expired answers", &gaps(&c[1..]), &policy);
        assert_eq!(
            out.metrics.failures.get(),
            u64::try_from(c.len() - 1).expect("count")
        );
        assert_eq!(out.current(), Some(good), "last good bundle kept");
        assert!(out.status().borrow().is_none(), "readiness does not flap");
    }

    /// A CA that is down: ten minutes of retries, exponential from 1 s with
    /// jitter, capped at 60 s; nothing to serve and the reason in readiness.
    #[tokio::test(start_paused = true)]
    async fn failures_back_off_with_jitter_up_to_the_cap() {
        let ca = fake_ca(Duration::from_secs(1000));
        *ca.fail.lock().expect("lock") = true;
        let h = ca.handles();
        let policy = RenewPolicy::default();
        let (out, cancel) = spawn(ca, policy.clone());
        let c = calls_within(&h, Duration::from_secs(600), 25).await;
        cancel.cancel();
        let waits = gaps(&c);
        assert_backoff("CA down", &waits, &policy);
        // 1+2+…+32 = 63 s, then at most 60 s apart: the cap is reached and held.
        assert!(waits.len() >= 14, "{waits:?}");
        assert!(
            waits[7..].iter().all(|w| *w > Duration::from_secs(44)),
            "{waits:?}"
        );
        assert!(out.current().is_none());
        assert!(
            out.status()
                .borrow()
                .as_deref()
                .is_some_and(|s| s.contains("Unavailable"))
        );
    }
}
