//! The rotation of a CA's root, shared by both of the operator's CAs:
//! decided by a pure function of what the CA's Secret holds and the time
//! ([`plan`]), carried out by whichever replica's write lands first
//! ([`apply`], then [`write_secret`], conditional on the resourceVersion).
//!
//! A rotation never leaves a certificate in use untrusted:
//! 1. stage: at two thirds of the current root's life (or at once when
//!    asked, or when it cannot sign), a new root joins the trust bundle;
//!    the old one still signs;
//! 2. switch: once the CA's switch condition holds
//!    ([`Facts::trusted_since`]), and `settle` after both that and the
//!    stage, the new root signs; the old one stays trusted as `previous`;
//! 3. retire: the old root leaves `overlap` after the switch, or when it
//!    ends.
//!
//! Each CA keeps the rest in its own room: the webhook's serving
//! certificate and its caBundle (`webhook_cert`), the workload CA's record
//! of distribution and its timestamps (`workload_ca::roots`).

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::PostParams;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};

/// A CA certificate and its private key (PEM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaPair {
    pub cert_pem: String,
    pub key_pem: String,
}

/// The roots a CA's Secret holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roots {
    /// The root that signs.
    pub current: CaPair,
    /// The staged root (step 1), trusted but not yet signing.
    pub next: Option<CaPair>,
    /// The root switched away from (step 2), trusted until retired.
    pub previous: Option<String>,
}

impl Roots {
    pub fn new(current: CaPair) -> Self {
        Self {
            current,
            next: None,
            previous: None,
        }
    }
}

/// The timings of a rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// The lifetime of a new root.
    pub validity: Duration,
    /// How long a staged root waits, once the switch condition holds,
    /// before it signs: the parties that trust it may lag the record.
    pub settle: Duration,
    /// After a switch, how long the old root stays trusted: every
    /// certificate it signed must have been replaced within it.
    pub overlap: Duration,
}

/// What the planner needs beside the roots, which each CA keeps its own
/// way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Facts {
    /// When the staged root was staged; `None` (unknown) stages it again,
    /// so that the wait starts now rather than at some guess.
    pub staged_at: Option<SystemTime>,
    /// When the current root took over; `None` (unknown) keeps the
    /// previous root until it ends.
    pub switched_at: Option<SystemTime>,
    /// Stage at once: a rotation was asked for, or the current root cannot
    /// sign.
    pub rotate: bool,
    /// The switch condition: since when every party that must trust the
    /// staged root does (`None`: not yet). The switch waits `settle` after
    /// the later of this and the stage.
    pub trusted_since: Option<SystemTime>,
}

/// One write to the Secret's roots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// No usable root (none yet, or the current one is unreadable, ended or
    /// otherwise unusable): a new one.
    Create,
    /// A new root next to the current one (step 1).
    Stage,
    /// The staged root becomes current (step 2).
    Switch,
    /// Drop an unusable staged root, or else the previous root (step 3).
    Retire,
}

impl Step {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Stage => "stage",
            Self::Switch => "switch",
            Self::Retire => "retire",
        }
    }
}

/// What [`plan`] decides: at most one step now (and why), and when a step
/// is due next (`None`: nothing is scheduled).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub step: Option<Step>,
    pub why: String,
    pub wake: Option<SystemTime>,
}

/// (not before, not after) of the first certificate in `pem`.
pub fn validity_of(pem: &str) -> Option<(SystemTime, SystemTime)> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).ok()?;
    let (_, c) = X509Certificate::from_der(&der).ok()?;
    let at = |t: x509_parser::time::ASN1Time| {
        let secs = u64::try_from(t.timestamp()).unwrap_or(0);
        SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs))
    };
    Some((at(c.validity().not_before)?, at(c.validity().not_after)?))
}

/// Two thirds of the way from `start` to `end`: when a root is staged and
/// a certificate renewed (a third is left for everyone to pick up the new
/// one, and for retries).
pub fn two_thirds(start: SystemTime, end: SystemTime) -> SystemTime {
    let life = end.duration_since(start).unwrap_or_default();
    let nanos = u64::try_from(life.as_nanos() / 3 * 2).unwrap_or(u64::MAX);
    start
        .checked_add(Duration::from_nanos(nanos))
        .unwrap_or(end)
}

/// Whether `pem` is a certificate that has not ended at `now`.
fn not_ended(pem: &str, now: SystemTime) -> bool {
    validity_of(pem).is_some_and(|(_, end)| now < end)
}

/// Why `pair` cannot act as a CA at `now`, if it cannot. Not-yet-valid is
/// no reason: a replica whose clock is a little behind the one that made
/// the root must not drop it.
fn pair_unusable(pair: &CaPair, now: SystemTime) -> Option<String> {
    let check = || -> Result<(), String> {
        let (_, end) = validity_of(&pair.cert_pem).ok_or("not a PEM X.509 certificate")?;
        if end <= now {
            return Err("ended".into());
        }
        let key = KeyPair::from_pem(&pair.key_pem).map_err(|e| format!("key: {e}"))?;
        if public_key_of(&pair.cert_pem).as_deref() != Some(key.public_key_raw()) {
            return Err("the key is not the certificate's".into());
        }
        Ok(())
    };
    check().err()
}

fn public_key_of(pem: &str) -> Option<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).ok()?;
    let (_, c) = X509Certificate::from_der(&der).ok()?;
    Some(c.public_key().subject_public_key.data.to_vec())
}

/// The next step for `roots` at `now`, if any. Pure, so that every step
/// is unit-tested.
pub fn plan(roots: Option<&Roots>, f: &Facts, p: &Policy, now: SystemTime) -> Plan {
    let act = |step: Step, why: &str| Plan {
        step: Some(step),
        why: why.to_string(),
        wake: Some(now),
    };
    let Some(r) = roots else {
        return act(Step::Create, "no root");
    };
    let Some((start, end)) = validity_of(&r.current.cert_pem) else {
        return act(Step::Create, "the current root is unreadable");
    };
    if end <= now {
        return act(Step::Create, "the current root has ended");
    }
    if let Some(n) = &r.next
        && let Some(why) = pair_unusable(n, now)
    {
        return act(Step::Retire, &format!("staged root: {why}"));
    }
    let mut wake = Vec::new();
    if let Some(prev) = &r.previous {
        let Some(prev_end) = validity_of(prev).map(|(_, e)| e).filter(|e| now < *e) else {
            return act(Step::Retire, "previous root ended or unreadable");
        };
        let retire_at = f
            .switched_at
            .and_then(|t| t.checked_add(p.overlap))
            .map_or(prev_end, |t| t.min(prev_end));
        if now >= retire_at {
            return act(Step::Retire, "overlap over");
        }
        wake.push(retire_at);
    }
    if r.next.is_some() {
        let Some(staged) = f.staged_at else {
            return act(Step::Stage, "staged at an unknown time");
        };
        let from = f.trusted_since.map_or(staged, |t| t.max(staged));
        let switch_at = from.checked_add(p.settle).unwrap_or(from);
        // One previous root at a time: the switch waits for a retirement
        // (only reached with a hand-made Secret).
        if r.previous.is_none() && f.trusted_since.is_some() && now >= switch_at {
            return act(Step::Switch, "the staged root is trusted");
        }
        // Not trusted yet: the caller looks again within its period.
        wake.push(switch_at.max(now));
    } else if r.previous.is_none() {
        let due = match f.rotate {
            true => now,
            false => two_thirds(start, end),
        };
        if now >= due {
            return act(Step::Stage, "the current root is due");
        }
        wake.push(due);
    }
    Plan {
        step: None,
        why: String::new(),
        wake: wake.into_iter().min(),
    }
}

/// How a CA's roots are made.
#[derive(Debug, Clone, Copy)]
pub struct Profile {
    /// The Common Name's start; the time of making and a random suffix
    /// follow, so that roots side by side in a bundle have distinct names.
    pub name: &'static str,
    pub organization: Option<&'static str>,
    /// The path length constraint (`None`: unconstrained).
    pub path_len: Option<u8>,
    pub key_usages: &'static [KeyUsagePurpose],
}

/// A new root of `profile`, valid for `validity` from `now`.
pub fn new_root(
    profile: &Profile,
    validity: Duration,
    now: SystemTime,
) -> Result<CaPair, rcgen::Error> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.not_before = now.into();
    ca.not_after = now.checked_add(validity).unwrap_or(now).into();
    ca.is_ca = IsCa::Ca(match profile.path_len {
        Some(n) => BasicConstraints::Constrained(n),
        None => BasicConstraints::Unconstrained,
    });
    if let Some(o) = profile.organization {
        ca.distinguished_name.push(DnType::OrganizationName, o);
    }
    let secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    ca.distinguished_name.push(
        DnType::CommonName,
        format!("{}-{secs}-{:08x}", profile.name, rand::random::<u32>()),
    );
    ca.key_usages = profile.key_usages.to_vec();
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let cert = ca.self_signed(&key)?;
    Ok(CaPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// `roots` after `step` at `now` (new roots of `profile`).
pub fn apply(
    roots: Option<&Roots>,
    step: Step,
    profile: &Profile,
    p: &Policy,
    now: SystemTime,
) -> Result<Roots, rcgen::Error> {
    let fresh = || new_root(profile, p.validity, now);
    Ok(match (step, roots) {
        (Step::Create, _) | (_, None) => Roots {
            current: fresh()?,
            next: None,
            // A root that has not ended stays trusted for the overlap: a
            // certificate it signed may be in use.
            previous: roots
                .map(|r| &r.current.cert_pem)
                .filter(|c| not_ended(c, now))
                .cloned(),
        },
        (Step::Stage, Some(r)) => Roots {
            next: Some(fresh()?),
            ..r.clone()
        },
        (Step::Switch, Some(r)) => match &r.next {
            Some(next) => Roots {
                current: next.clone(),
                next: None,
                previous: Some(r.current.cert_pem.clone()),
            },
            None => r.clone(),
        },
        (Step::Retire, Some(r)) => {
            // plan() retires an unusable staged root first, on its own; the
            // previous root only when no staged root is dropped.
            let next = r.next.clone().filter(|n| pair_unusable(n, now).is_none());
            let dropped_next = r.next.is_some() && next.is_none();
            Roots {
                current: r.current.clone(),
                previous: r.previous.clone().filter(|_| dropped_next),
                next,
            }
        }
    })
}

/// Every root to trust at `now`: the previous, the current and the staged
/// root (oldest first, so that a switch leaves the text unchanged), each
/// once and only until it ends (the current one always).
pub fn trust_bundle(r: &Roots, now: SystemTime) -> String {
    let mut out: Vec<&str> = Vec::new();
    let roots = [
        r.previous.as_deref(),
        Some(r.current.cert_pem.as_str()),
        r.next.as_ref().map(|n| n.cert_pem.as_str()),
    ];
    for root in roots.into_iter().flatten() {
        let keep = root == r.current.cert_pem || not_ended(root, now);
        if keep && !out.contains(&root.trim()) {
            out.push(root.trim());
        }
    }
    out.iter().map(|r| format!("{r}\n")).collect()
}

/// Where a CA's Secret keeps its roots. The two CAs name them differently,
/// and keep doing so: Secrets in clusters must still be read.
#[derive(Debug, Clone, Copy)]
pub struct SecretKeys {
    pub cert: &'static str,
    pub key: &'static str,
    pub next_cert: &'static str,
    pub next_key: &'static str,
    pub previous: &'static str,
}

impl SecretKeys {
    /// The roots in `data`. A missing or blank value reads as empty (the
    /// current root's) or as none (the others'); half a staged pair is
    /// none: [`plan`] stages a whole one when due.
    pub fn read(&self, data: Option<&BTreeMap<String, ByteString>>) -> Roots {
        let text = |key: &str| {
            data.and_then(|d| d.get(key))
                .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                .filter(|t| !t.trim().is_empty())
        };
        Roots {
            current: CaPair {
                cert_pem: text(self.cert).unwrap_or_default(),
                key_pem: text(self.key).unwrap_or_default(),
            },
            next: text(self.next_cert)
                .zip(text(self.next_key))
                .map(|(cert_pem, key_pem)| CaPair { cert_pem, key_pem }),
            previous: text(self.previous),
        }
    }

    /// Put `r` into `data` (empty values left out).
    pub fn write(&self, r: &Roots, data: &mut BTreeMap<String, ByteString>) {
        let mut put = |k: &str, v: &str| {
            if !v.is_empty() {
                data.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
            }
        };
        put(self.cert, &r.current.cert_pem);
        put(self.key, &r.current.key_pem);
        if let Some(n) = &r.next {
            put(self.next_cert, &n.cert_pem);
            put(self.next_key, &n.key_pem);
        }
        if let Some(p) = &r.previous {
            put(self.previous, p);
        }
    }
}

/// Create `s` (without a resourceVersion) or replace it (conditional on
/// its resourceVersion); `Ok(false)` when another replica wrote first.
pub async fn write_secret(api: &Api<Secret>, name: &str, s: &Secret) -> Result<bool, kube::Error> {
    let written = match s.metadata.resource_version {
        Some(_) => api.replace(name, &PostParams::default(), s).await,
        None => api.create(&PostParams::default(), s).await,
    };
    match written {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests;
