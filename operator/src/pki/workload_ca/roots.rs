//! The workload CA's half of a rotation ([`crate::pki::rotation`]): its
//! signing roots in one Secret that every replica reads, and its switch
//! condition. The leader records on the Secret ([`DISTRIBUTED`], the staged
//! root's fingerprint, and [`DISTRIBUTED_AT`]) that every injected
//! namespace's bundle carries the staged root; the switch waits `settle`
//! after both that record and the stage (the time it takes the kubelet's
//! ConfigMap refresh and the agent's call to the CA that it prompts). The
//! old root is retired once every certificate it signed has ended (the
//! longest lifetime granted, plus `settle`). Setting the annotation
//! [`ROTATE`] on the Secret asks for a rotation now.

use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use rcgen::KeyUsagePurpose;

use crate::pki::rotation::{self, Facts, Profile, Roots, SecretKeys};
pub use crate::pki::rotation::{Policy, Step};

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

const KEYS: SecretKeys = SecretKeys {
    cert: ROOT_CERT,
    key: ROOT_KEY,
    next_cert: NEXT_CERT,
    next_key: NEXT_KEY,
    previous: PREVIOUS_CERT,
};

/// The signing roots.
pub const PROFILE: Profile = Profile {
    name: "remora-workload-ca",
    organization: Some("remora.dev"),
    path_len: None,
    key_usages: &[
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ],
};

#[derive(Debug, thiserror::Error)]
pub enum RootsError {
    #[error("making a root: {0}")]
    Generate(String),
}

/// What the Secret holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub roots: Roots,
    /// Unix seconds.
    pub staged_at: Option<u64>,
    pub switched_at: Option<u64>,
    pub rotate: bool,
    /// The staged root every bundle carries ([`fingerprint`]), and since when.
    pub distributed: Option<(String, u64)>,
}

impl Stored {
    /// What the planner needs beside the roots; the switch condition is the
    /// leader's record of this staged root (not another) in every bundle.
    fn facts(&self) -> Facts {
        let staged = self
            .roots
            .next
            .as_ref()
            .and_then(|n| fingerprint(&n.cert_pem));
        Facts {
            staged_at: self.staged_at.map(at),
            switched_at: self.switched_at.map(at),
            rotate: self.rotate,
            trusted_since: match &self.distributed {
                Some((fp, t)) if staged.as_deref() == Some(fp.as_str()) => Some(at(*t)),
                _ => None,
            },
        }
    }
}

/// SHA-256 of a certificate's DER, hex; `None` when `pem` is not one.
pub fn fingerprint(pem: &str) -> Option<String> {
    use sha2::{Digest, Sha256};
    let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).ok()?;
    Some(format!("{:x}", Sha256::digest(&p.contents)))
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

/// The next step for `stored` at `now`, if any.
pub fn plan(stored: Option<&Stored>, p: &Policy, now: SystemTime) -> Option<Step> {
    let facts = stored.map(Stored::facts).unwrap_or_default();
    rotation::plan(stored.map(|s| &s.roots), &facts, p, now).step
}

/// `stored` after `step` at `now`.
pub fn apply(
    stored: Option<&Stored>,
    step: Step,
    p: &Policy,
    now: SystemTime,
) -> Result<Stored, RootsError> {
    let roots = rotation::apply(stored.map(|s| &s.roots), step, &PROFILE, p, now)
        .map_err(|e| RootsError::Generate(e.to_string()))?;
    let mut out = match stored {
        Some(s) if step != Step::Create => Stored { roots, ..s.clone() },
        _ => Stored {
            roots,
            staged_at: None,
            switched_at: None,
            rotate: false,
            distributed: None,
        },
    };
    // The marks follow the roots: a root staged or switched to is so now,
    // and a record of a staged root that is gone goes too.
    let before = stored.map(|s| &s.roots);
    let at = Some(secs(now));
    if before.map(|r| &r.next) != Some(&out.roots.next) {
        out.staged_at = out.roots.next.as_ref().and(at);
        out.distributed = None;
    }
    if before.map(|r| &r.previous) != Some(&out.roots.previous) {
        out.switched_at = out.roots.previous.as_ref().and(at);
    }
    if step == Step::Stage {
        out.rotate = false;
    }
    Ok(out)
}

/// `None` when the Secret lacks the current root or its key.
pub fn from_secret(s: &Secret) -> Option<Stored> {
    let roots = KEYS.read(Some(s.data.as_ref()?));
    if roots.current.cert_pem.is_empty() || roots.current.key_pem.is_empty() {
        return None;
    }
    let ann = s.metadata.annotations.clone().unwrap_or_default();
    let num = |k: &str| ann.get(k).and_then(|v| v.parse::<u64>().ok());
    Some(Stored {
        roots,
        staged_at: num(STAGED_AT),
        switched_at: num(SWITCHED_AT),
        rotate: ann.contains_key(ROTATE),
        distributed: ann.get(DISTRIBUTED).cloned().zip(num(DISTRIBUTED_AT)),
    })
}

/// The Secret for `s`; `base` keeps name, namespace, resourceVersion and
/// the annotations and labels that are not ours.
pub fn to_secret(s: &Stored, base: ObjectMeta) -> Secret {
    let mut meta = base;
    let mut ann = meta.annotations.take().unwrap_or_default();
    for k in [STAGED_AT, SWITCHED_AT, ROTATE, DISTRIBUTED, DISTRIBUTED_AT] {
        ann.remove(k);
    }
    if let Some((fp, t)) = &s.distributed {
        ann.insert(DISTRIBUTED.into(), fp.clone());
        ann.insert(DISTRIBUTED_AT.into(), t.to_string());
    }
    if let Some(t) = s.staged_at {
        ann.insert(STAGED_AT.into(), t.to_string());
    }
    if let Some(t) = s.switched_at {
        ann.insert(SWITCHED_AT.into(), t.to_string());
    }
    if s.rotate {
        ann.insert(ROTATE.into(), "requested".into());
    }
    meta.annotations = (!ann.is_empty()).then_some(ann);
    let mut data = Default::default();
    KEYS.write(&s.roots, &mut data);
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

    /// `s` as the leader leaves it once every bundle carries its staged root.
    fn recorded(mut s: Stored, t: SystemTime) -> Stored {
        let next = s.roots.next.as_ref().expect("staged");
        let fp = fingerprint(&next.cert_pem).expect("fingerprint");
        s.distributed = Some((fp, secs(t)));
        s
    }

    #[test]
    fn a_rotation_keeps_its_timestamps_and_record_in_the_secret() {
        let p = policy();
        let t0 = SystemTime::now();
        assert_eq!(plan(None, &p, t0), Some(Step::Create));
        let r = apply(None, Step::Create, &p, t0).expect("create");
        assert_eq!(plan(Some(&r), &p, t0), None);
        let t1 = t0 + 20 * MIN;
        assert_eq!(plan(Some(&r), &p, t1), Some(Step::Stage));
        let staged = apply(Some(&r), Step::Stage, &p, t1).expect("stage");
        assert_eq!(staged.staged_at, Some(secs(t1)));
        let staged = recorded(staged, t1);
        let t2 = t1 + MIN;
        assert_eq!(plan(Some(&staged), &p, t2), Some(Step::Switch));
        let switched = apply(Some(&staged), Step::Switch, &p, t2).expect("switch");
        assert_eq!(
            (
                switched.staged_at,
                switched.switched_at,
                &switched.distributed
            ),
            (None, Some(secs(t2)), &None)
        );
        let t3 = t2 + 3 * MIN;
        assert_eq!(plan(Some(&switched), &p, t3 - MIN), None);
        assert_eq!(plan(Some(&switched), &p, t3), Some(Step::Retire));
        let retired = apply(Some(&switched), Step::Retire, &p, t3).expect("retire");
        assert_eq!(retired.switched_at, None);
        assert_eq!(plan(Some(&retired), &p, t3), None);
        for s in [&r, &staged, &switched, &retired] {
            let back = from_secret(&to_secret(s, ObjectMeta::default())).expect("parsed");
            assert_eq!(&back, s);
        }
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
        let fp = fingerprint(&r.roots.current.cert_pem).expect("fp");
        other.distributed = Some((fp, secs(t0)));
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
    fn a_secret_without_a_root_or_its_key_holds_none() {
        let p = policy();
        let r = apply(None, Step::Create, &p, SystemTime::now()).expect("create");
        let mut s = to_secret(&r, ObjectMeta::default());
        assert!(from_secret(&s).is_some());
        if let Some(d) = s.data.as_mut() {
            d.remove(ROOT_KEY);
        }
        assert!(from_secret(&s).is_none());
        assert!(from_secret(&Secret::default()).is_none());
    }
}
