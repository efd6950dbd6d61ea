//! The workload CA's signing roots, kept in one Secret that every replica
//! reads, and their rotation: decided by a pure function of what the Secret
//! holds and the time ([`plan`]), carried out by whichever replica gets its
//! write in first (writes are conditional on the Secret's resourceVersion).
//!
//! A rotation never makes a certificate in use untrusted:
//! 1. stage: at two thirds of the root's life, or when someone sets the
//!    annotation [`ROTATE`] on the Secret, a new root is made and joins the
//!    trust bundle; the old one still signs;
//! 2. switch: once the leader has recorded on the Secret ([`DISTRIBUTED`],
//!    the staged root's fingerprint, and [`DISTRIBUTED_AT`]) that every
//!    injected namespace's bundle carries it, and `settle` after both that
//!    record and the stage (the time it takes the kubelet's ConfigMap
//!    refresh and the agent's call to the CA that it prompts), the new root
//!    signs, and the old one stays in the bundle as `previous`;
//! 3. retire: once every certificate the old root signed has ended (the
//!    longest lifetime granted, plus `settle`), it leaves the bundle.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::pki::webhook_cert::CaPair;

pub const ROOT_CERT: &str = "root-cert.pem";
pub const ROOT_KEY: &str = "root-key.pem";
pub const NEXT_CERT: &str = "next-cert.pem";
pub const NEXT_KEY: &str = "next-key.pem";
pub const PREVIOUS_CERT: &str = "previous-cert.pem";
/// Set (to anything) on the Secret to ask for a rotation now; removed when
/// the new root is staged.
pub const ROTATE: &str = "remora.dev/rotate";
const STAGED_AT: &str = "remora.dev/staged-at";
const SWITCHED_AT: &str = "remora.dev/switched-at";
/// The fingerprint ([`fingerprint`]) of the staged root that the leader has
/// seen into every injected namespace's trust bundle, and when (Unix
/// seconds).
pub const DISTRIBUTED: &str = "remora.dev/distributed";
pub const DISTRIBUTED_AT: &str = "remora.dev/distributed-at";

#[derive(Debug, thiserror::Error)]
pub enum RootsError {
    #[error("making a root: {0}")]
    Generate(String),
}

/// What the Secret holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roots {
    pub current: CaPair,
    pub next: Option<CaPair>,
    pub previous: Option<String>,
    /// Unix seconds.
    pub staged_at: Option<u64>,
    pub switched_at: Option<u64>,
    pub rotate: bool,
    /// The staged root every bundle carries ([`fingerprint`]), and since when.
    pub distributed: Option<(String, u64)>,
}

/// SHA-256 of a certificate's DER, hex; `None` when `pem` is not one.
pub fn fingerprint(pem: &str) -> Option<String> {
    use sha2::{Digest, Sha256};
    let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).ok()?;
    Some(format!("{:x}", Sha256::digest(&p.contents)))
}

/// The timings of a rotation.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub validity: Duration,
    pub settle: Duration,
    /// After a switch, how long the old root stays trusted: the longest
    /// lifetime the CA grants plus `settle`.
    pub overlap: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// No usable root (none yet, or the current one is unreadable or ended).
    Create,
    Stage,
    Switch,
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

fn secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn at(s: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH
        .checked_add(Duration::from_secs(s))
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// The next step for `roots` at `now`, if any.
pub fn plan(roots: Option<&Roots>, p: &Policy, now: SystemTime) -> Option<Step> {
    let Some(r) = roots else {
        return Some(Step::Create);
    };
    let Some((start, end)) = crate::pki::webhook_cert::validity_of(&r.current.cert_pem) else {
        return Some(Step::Create);
    };
    if end <= now {
        return Some(Step::Create);
    }
    if let Some(next) = &r.next {
        if crate::pki::webhook_cert::validity_of(&next.cert_pem).is_none() {
            // A broken staged root is made again.
            return Some(Step::Stage);
        }
        // Staged at an unknown time (someone edited the annotations): stage
        // again, so that the clock starts now rather than at the epoch.
        let Some(staged) = r.staged_at else {
            return Some(Step::Stage);
        };
        // Only once every bundle carries this root, and `settle` after
        // both: a timer alone would switch while pods do not trust it yet.
        let recorded = match &r.distributed {
            Some((fp, t)) if fingerprint(&next.cert_pem).as_deref() == Some(fp.as_str()) => *t,
            _ => return None,
        };
        let due = at(staged.max(recorded)).checked_add(p.settle);
        return due.is_some_and(|d| d <= now).then_some(Step::Switch);
    }
    if let Some(prev) = &r.previous {
        let expired = crate::pki::webhook_cert::validity_of(prev).is_none_or(|(_, e)| e <= now);
        // Switched at an unknown time: the old root stays until it ends, as
        // leaves it signed may still be in use.
        let over = r
            .switched_at
            .and_then(|t| at(t).checked_add(p.overlap))
            .is_some_and(|d| d <= now);
        return (expired || over).then_some(Step::Retire);
    }
    let life = end.duration_since(start).unwrap_or_default();
    let stage_at = start.checked_add(life / 3 * 2).unwrap_or(end);
    (r.rotate || stage_at <= now).then_some(Step::Stage)
}

/// A new root, valid `validity` from `now`.
pub fn new_root(validity: Duration, now: SystemTime) -> Result<CaPair, RootsError> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let e = |e: rcgen::Error| RootsError::Generate(e.to_string());
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(e)?;
    ca.not_before = now.into();
    ca.not_after = now.checked_add(validity).unwrap_or(now).into();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Distinct names: old and new roots sit side by side in the bundle.
    ca.distinguished_name
        .push(DnType::OrganizationName, "remora.dev");
    ca.distinguished_name.push(
        DnType::CommonName,
        format!(
            "remora-workload-ca-{}-{:08x}",
            secs(now),
            rand::random::<u32>()
        ),
    );
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(e)?;
    let cert = ca.self_signed(&key).map_err(e)?;
    Ok(CaPair {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// `roots` after `step` at `now`.
pub fn apply(
    roots: Option<&Roots>,
    step: Step,
    p: &Policy,
    now: SystemTime,
) -> Result<Roots, RootsError> {
    let fresh = || new_root(p.validity, now);
    Ok(match (step, roots) {
        (Step::Create, _) | (_, None) => Roots {
            current: fresh()?,
            next: None,
            previous: None,
            staged_at: None,
            switched_at: None,
            rotate: false,
            distributed: None,
        },
        (Step::Stage, Some(r)) => Roots {
            next: Some(fresh()?),
            staged_at: Some(secs(now)),
            rotate: false,
            distributed: None,
            ..r.clone()
        },
        (Step::Switch, Some(r)) => match &r.next {
            Some(next) => Roots {
                current: next.clone(),
                next: None,
                previous: Some(r.current.cert_pem.clone()),
                staged_at: None,
                switched_at: Some(secs(now)),
                rotate: r.rotate,
                distributed: None,
            },
            None => r.clone(),
        },
        (Step::Retire, Some(r)) => Roots {
            previous: None,
            switched_at: None,
            ..r.clone()
        },
    })
}

/// Every root to trust: the current one, a staged one and a retiring one.
pub fn trust_bundle(r: &Roots) -> String {
    let mut out: Vec<String> = Vec::new();
    for pem in [
        Some(&r.current.cert_pem),
        r.next.as_ref().map(|n| &n.cert_pem),
        r.previous.as_ref(),
    ]
    .into_iter()
    .flatten()
    {
        let pem = pem.trim().to_string();
        if !out.contains(&pem) {
            out.push(pem);
        }
    }
    out.join("\n") + "\n"
}

fn text(data: &BTreeMap<String, ByteString>, key: &str) -> Option<String> {
    data.get(key)
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
        .filter(|s| !s.trim().is_empty())
}

/// `None` when the Secret lacks the current root or its key.
pub fn from_secret(s: &Secret) -> Option<Roots> {
    let data = s.data.as_ref()?;
    let ann = s.metadata.annotations.clone().unwrap_or_default();
    let num = |k: &str| ann.get(k).and_then(|v| v.parse::<u64>().ok());
    let pair = |c: &str, k: &str| {
        Some(CaPair {
            cert_pem: text(data, c)?,
            key_pem: text(data, k)?,
        })
    };
    Some(Roots {
        current: pair(ROOT_CERT, ROOT_KEY)?,
        next: pair(NEXT_CERT, NEXT_KEY),
        previous: text(data, PREVIOUS_CERT),
        staged_at: num(STAGED_AT),
        switched_at: num(SWITCHED_AT),
        rotate: ann.contains_key(ROTATE),
        distributed: ann.get(DISTRIBUTED).cloned().zip(num(DISTRIBUTED_AT)),
    })
}

/// The Secret for `r`; `base` keeps name, namespace, resourceVersion and
/// the annotations and labels that are not ours.
pub fn to_secret(r: &Roots, base: ObjectMeta) -> Secret {
    let mut meta = base;
    let mut ann = meta.annotations.take().unwrap_or_default();
    for k in [STAGED_AT, SWITCHED_AT, ROTATE, DISTRIBUTED, DISTRIBUTED_AT] {
        ann.remove(k);
    }
    if let Some((fp, t)) = &r.distributed {
        ann.insert(DISTRIBUTED.into(), fp.clone());
        ann.insert(DISTRIBUTED_AT.into(), t.to_string());
    }
    if let Some(t) = r.staged_at {
        ann.insert(STAGED_AT.into(), t.to_string());
    }
    if let Some(t) = r.switched_at {
        ann.insert(SWITCHED_AT.into(), t.to_string());
    }
    if r.rotate {
        ann.insert(ROTATE.into(), "requested".into());
    }
    meta.annotations = (!ann.is_empty()).then_some(ann);
    let mut data = BTreeMap::new();
    let mut put = |k: &str, v: &str| {
        data.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
    };
    put(ROOT_CERT, &r.current.cert_pem);
    put(ROOT_KEY, &r.current.key_pem);
    if let Some(n) = &r.next {
        put(NEXT_CERT, &n.cert_pem);
        put(NEXT_KEY, &n.key_pem);
    }
    if let Some(p) = &r.previous {
        put(PREVIOUS_CERT, p);
    }
    Secret {
        metadata: meta,
        data: Some(data),
        type_: Some("Opaque".into()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn policy() -> Policy {
        Policy {
            validity: 30 * MIN,
            settle: MIN,
            overlap: 3 * MIN,
        }
    }

    #[test]
    fn a_rotation_stages_switches_and_retires_without_a_gap() {
        let p = policy();
        let t0 = SystemTime::now();
        assert_eq!(plan(None, &p, t0), Some(Step::Create));
        let r = apply(None, Step::Create, &p, t0).expect("create");
        let first = r.current.cert_pem.clone();
        assert_eq!(plan(Some(&r), &p, t0), None);
        assert_eq!(plan(Some(&r), &p, t0 + 19 * MIN), None);
        // At two thirds of the life.
        let t1 = t0 + 20 * MIN;
        assert_eq!(plan(Some(&r), &p, t1), Some(Step::Stage));
        let staged = apply(Some(&r), Step::Stage, &p, t1).expect("stage");
        let second = staged.next.clone().expect("next").cert_pem;
        assert!(trust_bundle(&staged).contains(first.trim()));
        assert!(trust_bundle(&staged).contains(second.trim()));
        assert_eq!(staged.current.cert_pem, first, "the old root still signs");
        assert_eq!(plan(Some(&staged), &p, t1 + MIN / 2), None);
        let t2 = t1 + MIN;
        assert_eq!(plan(Some(&staged), &p, t2), None, "not recorded yet");
        let staged = recorded(staged, t1);
        assert_eq!(plan(Some(&staged), &p, t2), Some(Step::Switch));
        let switched = apply(Some(&staged), Step::Switch, &p, t2).expect("switch");
        assert_eq!(switched.current.cert_pem, second);
        assert!(
            trust_bundle(&switched).contains(first.trim()),
            "old root kept"
        );
        assert_eq!(plan(Some(&switched), &p, t2 + 2 * MIN), None);
        let t3 = t2 + 3 * MIN;
        assert_eq!(plan(Some(&switched), &p, t3), Some(Step::Retire));
        let retired = apply(Some(&switched), Step::Retire, &p, t3).expect("retire");
        assert_eq!(trust_bundle(&retired).trim(), second.trim());
        assert_eq!(plan(Some(&retired), &p, t3), None);
    }

    /// `r` as the leader leaves it once every bundle carries its staged root.
    fn recorded(mut r: Roots, t: SystemTime) -> Roots {
        let fp = fingerprint(&r.next.as_ref().expect("staged").cert_pem).expect("fingerprint");
        r.distributed = Some((fp, secs(t)));
        r
    }

    /// The switch waits for the leader's record that every namespace's
    /// bundle carries the staged root (of that root, not another), and for
    /// `settle` after both the stage and the record; the record survives the
    /// Secret and a new stage drops it.
    #[test]
    fn the_switch_waits_for_the_record_that_every_bundle_carries_the_root() {
        let p = policy();
        let t0 = SystemTime::now();
        let r = apply(None, Step::Create, &p, t0).expect("create");
        let staged = apply(Some(&r), Step::Stage, &p, t0).expect("stage");
        // Long after `settle`, no record: no switch.
        assert_eq!(plan(Some(&staged), &p, t0 + 10 * MIN), None);
        // A record of another root (a stage since): no switch.
        let mut other = staged.clone();
        other.distributed = Some((fingerprint(&r.current.cert_pem).expect("fp"), secs(t0)));
        assert_eq!(plan(Some(&other), &p, t0 + 10 * MIN), None);
        // Recorded late: `settle` after the record, not after the stage.
        let late = recorded(staged.clone(), t0 + 5 * MIN);
        assert_eq!(plan(Some(&late), &p, t0 + 5 * MIN + MIN / 2), None);
        assert_eq!(plan(Some(&late), &p, t0 + 6 * MIN), Some(Step::Switch));
        // Recorded at once: still not before `settle` after the stage.
        let early = recorded(staged.clone(), t0);
        assert_eq!(plan(Some(&early), &p, t0 + MIN / 2), None);
        assert_eq!(plan(Some(&early), &p, t0 + MIN), Some(Step::Switch));
        // Kept in the Secret; a timestamp lost is no record.
        let back = from_secret(&to_secret(&early, ObjectMeta::default())).expect("parsed");
        assert_eq!(back, early);
        let mut s = to_secret(&early, ObjectMeta::default());
        if let Some(a) = s.metadata.annotations.as_mut() {
            a.remove(DISTRIBUTED_AT);
        }
        let lost = from_secret(&s).expect("parsed");
        assert_eq!(plan(Some(&lost), &p, t0 + 10 * MIN), None);
        // A new stage, and the switch, drop the record.
        let mut again = early.clone();
        again.rotate = true;
        let switched = apply(Some(&early), Step::Switch, &p, t0 + MIN).expect("switch");
        assert_eq!(switched.distributed, None);
        let restaged = apply(Some(&again), Step::Stage, &p, t0 + MIN).expect("stage");
        assert_eq!(restaged.distributed, None);
    }

    #[test]
    fn asked_for_rotation_stages_at_once_and_survives_the_secret() {
        let p = policy();
        let t0 = SystemTime::now();
        let mut r = apply(None, Step::Create, &p, t0).expect("create");
        r.rotate = true;
        let s = to_secret(&r, ObjectMeta::default());
        let back = from_secret(&s).expect("parsed");
        assert_eq!(back, r);
        assert_eq!(plan(Some(&back), &p, t0), Some(Step::Stage));
        let staged = apply(Some(&back), Step::Stage, &p, t0).expect("stage");
        assert!(!staged.rotate);
        let back = from_secret(&to_secret(&staged, ObjectMeta::default())).expect("parsed");
        assert_eq!(back, staged);
    }

    #[test]
    fn lost_timestamps_never_shorten_a_step() {
        let p = policy();
        let t0 = SystemTime::now();
        let r = apply(None, Step::Create, &p, t0).expect("create");
        let mut staged = apply(Some(&r), Step::Stage, &p, t0).expect("stage");
        staged.staged_at = None;
        assert_eq!(
            plan(Some(&staged), &p, t0),
            Some(Step::Stage),
            "staged again, not switched"
        );
        let mut switched = apply(Some(&staged), Step::Switch, &p, t0).expect("switch");
        switched.switched_at = None;
        assert_eq!(
            plan(Some(&switched), &p, t0 + 10 * MIN),
            None,
            "kept until it ends"
        );
        assert_eq!(plan(Some(&switched), &p, t0 + 31 * MIN), Some(Step::Create));
    }

    #[test]
    fn an_ended_or_unreadable_root_is_replaced() {
        let p = policy();
        let t0 = SystemTime::now();
        let r = apply(None, Step::Create, &p, t0).expect("create");
        assert_eq!(plan(Some(&r), &p, t0 + 31 * MIN), Some(Step::Create));
        let mut broken = r.clone();
        broken.current.cert_pem = "garbage".into();
        assert_eq!(plan(Some(&broken), &p, t0), Some(Step::Create));
        assert!(from_secret(&Secret::default()).is_none());
    }
}
