//! The shared planner and applier, on an injected clock: every time is
//! given, nothing waits.

use super::*;

const S: fn(u64) -> Duration = Duration::from_secs;

const PROFILE: Profile = Profile {
    name: "test-ca",
    organization: None,
    path_len: Some(0),
    key_usages: &[KeyUsagePurpose::KeyCertSign],
};

fn policy() -> Policy {
    Policy {
        validity: S(90),
        settle: S(3),
        overlap: S(10),
    }
}

fn t0() -> SystemTime {
    SystemTime::UNIX_EPOCH + S(1_800_000_000)
}

fn create(at: SystemTime) -> Roots {
    apply(None, Step::Create, &PROFILE, &policy(), at).expect("create")
}

fn step(r: &Roots, f: &Facts, now: SystemTime) -> Option<Step> {
    plan(Some(r), f, &policy(), now).step
}

fn has(bundle: &str, root: &str) -> bool {
    bundle.contains(root.trim())
}

#[test]
fn a_rotation_stages_switches_and_retires_without_a_gap() {
    let p = policy();
    let none = Facts::default();
    assert_eq!(plan(None, &none, &p, t0()).step, Some(Step::Create));
    let r = create(t0());
    let a = r.current.cert_pem.clone();
    assert_eq!(r.previous, None, "nothing before the first root");
    // Staged at two thirds of the root's 90 s.
    let waiting = plan(Some(&r), &none, &p, t0());
    assert_eq!((waiting.step, waiting.wake), (None, Some(t0() + S(60))));
    assert_eq!(step(&r, &none, t0() + S(59)), None);
    let t1 = t0() + S(60);
    assert_eq!(step(&r, &none, t1), Some(Step::Stage));
    let staged = apply(Some(&r), Step::Stage, &PROFILE, &p, t1).expect("stage");
    assert_eq!(staged.current, r.current, "the old root still signs");
    let b = staged.next.clone().expect("staged").cert_pem;
    let both = trust_bundle(&staged, t1);
    assert!(has(&both, &a) && has(&both, &b), "{both}");
    // Not trusted yet: no switch, however long; a look again after settle.
    let mut f = Facts {
        staged_at: Some(t1),
        ..Facts::default()
    };
    let untrusted = plan(Some(&staged), &f, &p, t1 + S(1));
    assert_eq!((untrusted.step, untrusted.wake), (None, Some(t1 + S(3))));
    assert_eq!(step(&staged, &f, t1 + S(20)), None);
    // Trusted: `settle` after the stage.
    f.trusted_since = Some(t1);
    let settling = plan(Some(&staged), &f, &p, t1 + S(1));
    assert_eq!((settling.step, settling.wake), (None, Some(t1 + S(3))));
    let t2 = t1 + S(3);
    assert_eq!(step(&staged, &f, t2), Some(Step::Switch));
    let switched = apply(Some(&staged), Step::Switch, &PROFILE, &p, t2).expect("switch");
    assert_eq!(switched.current.cert_pem, b);
    assert_eq!(switched.previous.as_deref(), Some(a.as_str()));
    assert_eq!(switched.next, None);
    // Oldest first: the bundle's text does not change at the switch.
    assert_eq!(trust_bundle(&switched, t2), both);
    // The old root stays `overlap` after the switch, then leaves.
    let f = Facts {
        switched_at: Some(t2),
        ..Facts::default()
    };
    let overlapping = plan(Some(&switched), &f, &p, t2 + S(1));
    assert_eq!(
        (overlapping.step, overlapping.wake),
        (None, Some(t2 + S(10)))
    );
    let t3 = t2 + S(10);
    assert_eq!(step(&switched, &f, t3), Some(Step::Retire));
    let retired = apply(Some(&switched), Step::Retire, &PROFILE, &p, t3).expect("retire");
    assert_eq!(retired, Roots::new(switched.current.clone()));
    assert_eq!(trust_bundle(&retired, t3), format!("{}\n", b.trim()));
    // The new root is due at two thirds of its own life, from its stage.
    let next = plan(Some(&retired), &Facts::default(), &p, t3);
    assert_eq!((next.step, next.wake), (None, Some(t1 + S(60))));
}

#[test]
fn the_switch_waits_settle_after_both_the_stage_and_the_trust() {
    let p = policy();
    let r = create(t0());
    let staged = apply(Some(&r), Step::Stage, &PROFILE, &p, t0()).expect("stage");
    let trusted = |since| Facts {
        staged_at: Some(t0()),
        trusted_since: Some(since),
        ..Facts::default()
    };
    // Trusted at once: `settle` after the stage.
    assert_eq!(step(&staged, &trusted(t0()), t0() + S(2)), None);
    assert_eq!(
        step(&staged, &trusted(t0()), t0() + S(3)),
        Some(Step::Switch)
    );
    // Trusted late: `settle` after the trust, not after the stage.
    let late = trusted(t0() + S(20));
    let p20 = plan(Some(&staged), &late, &p, t0() + S(21));
    assert_eq!((p20.step, p20.wake), (None, Some(t0() + S(23))));
    assert_eq!(step(&staged, &late, t0() + S(23)), Some(Step::Switch));
}

#[test]
fn unknown_times_never_shorten_a_step() {
    let p = policy();
    let r = create(t0());
    let staged = apply(Some(&r), Step::Stage, &PROFILE, &p, t0()).expect("stage");
    // Staged at an unknown time: staged again (the wait starts now), even
    // when trusted.
    let lost = Facts {
        trusted_since: Some(t0()),
        ..Facts::default()
    };
    assert_eq!(step(&staged, &lost, t0() + S(30)), Some(Step::Stage));
    // Switched at an unknown time: the old root stays until it ends.
    let switched = apply(Some(&staged), Step::Switch, &PROFILE, &p, t0()).expect("switch");
    let kept = plan(Some(&switched), &Facts::default(), &p, t0() + S(60));
    assert_eq!((kept.step, kept.wake), (None, Some(t0() + S(90))));
}

#[test]
fn one_previous_root_at_a_time() {
    let p = policy();
    let old = create(t0());
    let r = create(t0() + S(1));
    let both = Roots {
        previous: Some(old.current.cert_pem.clone()),
        ..apply(Some(&r), Step::Stage, &PROFILE, &p, t0() + S(1)).expect("stage")
    };
    let f = Facts {
        staged_at: Some(t0() + S(1)),
        switched_at: Some(t0()),
        trusted_since: Some(t0()),
        rotate: false,
    };
    // The previous root leaves first; the switch waits for that.
    let waiting = plan(Some(&both), &f, &p, t0() + S(5));
    assert_eq!((waiting.step, waiting.wake), (None, Some(t0() + S(5))));
    assert_eq!(step(&both, &f, t0() + S(10)), Some(Step::Retire));
    let retired = apply(Some(&both), Step::Retire, &PROFILE, &p, t0() + S(10)).expect("retire");
    assert_eq!((retired.previous, &retired.next), (None, &both.next));
    // With no previous root, nothing more is staged while one waits.
    let r = Roots {
        previous: None,
        ..both
    };
    let asked = Facts {
        staged_at: Some(t0() + S(1)),
        rotate: true,
        ..Facts::default()
    };
    assert_eq!(step(&r, &asked, t0() + S(10)), None);
}

#[test]
fn a_rotation_asked_for_stages_at_once() {
    let r = create(t0());
    let asked = Facts {
        rotate: true,
        ..Facts::default()
    };
    assert_eq!(step(&r, &asked, t0()), Some(Step::Stage));
}

#[test]
fn broken_or_ended_parts_are_replaced_or_dropped() {
    let p = policy();
    let none = Facts::default();
    let t = t0() + S(1);
    let r = create(t0());
    let other = create(t0());
    // The current root: unreadable or ended.
    let garbage = Roots::new(CaPair {
        cert_pem: "garbage".into(),
        key_pem: r.current.key_pem.clone(),
    });
    assert_eq!(step(&garbage, &none, t), Some(Step::Create));
    assert_eq!(step(&r, &none, t0() + S(90)), Some(Step::Create));
    // A new root keeps an old one that has not ended trusted: a
    // certificate it signed may be in use. An ended one goes.
    let replaced = apply(Some(&r), Step::Create, &PROFILE, &p, t).expect("create");
    assert_eq!(replaced.previous.as_ref(), Some(&r.current.cert_pem));
    let replaced = apply(Some(&r), Step::Create, &PROFILE, &p, t0() + S(90)).expect("create");
    assert_eq!(replaced.previous, None);
    // A staged root that is garbage, whose key is another's, or that has
    // ended is dropped, on its own.
    let staged = |next: CaPair| Roots {
        next: Some(next),
        previous: Some(other.current.cert_pem.clone()),
        ..r.clone()
    };
    let bad = [
        CaPair {
            cert_pem: "garbage".into(),
            key_pem: r.current.key_pem.clone(),
        },
        CaPair {
            cert_pem: other.current.cert_pem.clone(),
            key_pem: r.current.key_pem.clone(),
        },
    ];
    for next in bad {
        let s = staged(next);
        let pl = plan(Some(&s), &none, &p, t);
        assert_eq!(pl.step, Some(Step::Retire));
        assert!(pl.why.starts_with("staged root"), "{}", pl.why);
        let dropped = apply(Some(&s), Step::Retire, &PROFILE, &p, t).expect("retire");
        assert_eq!(dropped.next, None);
        assert_eq!(dropped.previous, s.previous, "the previous root stays");
    }
    // A previous root that is garbage or has ended.
    for prev in ["garbage".to_string(), other.current.cert_pem.clone()] {
        let s = Roots {
            previous: Some(prev),
            ..create(t0() + S(80))
        };
        assert_eq!(step(&s, &none, t0() + S(91)), Some(Step::Retire));
        assert_eq!(
            trust_bundle(&s, t0() + S(91)),
            format!("{}\n", s.current.cert_pem.trim())
        );
    }
}

#[test]
fn two_thirds_is_exact() {
    assert_eq!(two_thirds(t0(), t0() + S(90)), t0() + S(60));
    assert_eq!(two_thirds(t0(), t0() + S(30)), t0() + S(20));
    assert_eq!(two_thirds(t0(), t0()), t0());
}

#[test]
fn new_roots_follow_their_profile_and_have_distinct_names() {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let a = new_root(&PROFILE, S(90), t0()).expect("root");
    let b = new_root(&PROFILE, S(90), t0()).expect("root");
    assert_eq!(validity_of(&a.cert_pem), Some((t0(), t0() + S(90))));
    let subject = |pem: &str| {
        let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).expect("pem");
        let (_, c) = X509Certificate::from_der(&p.contents).expect("der");
        assert!(c.is_ca());
        c.subject().to_string()
    };
    assert!(subject(&a.cert_pem).starts_with("CN=test-ca-1800000000-"));
    assert_ne!(subject(&a.cert_pem), subject(&b.cert_pem));
    assert_eq!(pair_unusable(&a, t0()), None);
}

#[test]
fn secret_keys_round_trip_and_half_a_pair_is_none() {
    const KEYS: SecretKeys = SecretKeys {
        cert: "c",
        key: "k",
        next_cert: "nc",
        next_key: "nk",
        previous: "p",
    };
    let r = create(t0());
    let full = Roots {
        next: Some(create(t0()).current),
        previous: Some(create(t0()).current.cert_pem),
        ..r.clone()
    };
    let mut data = BTreeMap::new();
    KEYS.write(&full, &mut data);
    assert_eq!(KEYS.read(Some(&data)), full);
    data.remove("nk");
    data.insert("p".into(), ByteString(b"  \n".to_vec()));
    assert_eq!(KEYS.read(Some(&data)), r);
    // Nothing there: an empty current root, which plan() replaces.
    let empty = KEYS.read(None);
    assert_eq!(empty.current.cert_pem, "");
    assert_eq!(step(&empty, &Facts::default(), t0()), Some(Step::Create));
}
