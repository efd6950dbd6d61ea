//! Equal values held once: the pods of one workload carry the same labels,
//! lifecycle and status, which a store of many pods would otherwise hold
//! once per pod.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;

/// The values handed out, each once. Values nobody else holds any more are
/// swept whenever the set has doubled since the last sweep, so it holds at
/// most about twice what is in use.
#[derive(Debug)]
pub struct Interned<T: ?Sized> {
    set: HashSet<Arc<T>>,
    sweep_at: usize,
}

/// Below this size the set is never swept.
const SMALLEST_SWEEP: usize = 64;

impl<T: ?Sized> Default for Interned<T> {
    fn default() -> Self {
        Self {
            set: HashSet::new(),
            sweep_at: SMALLEST_SWEEP,
        }
    }
}

impl<T: ?Sized + Hash + Eq> Interned<T> {
    /// The held value equal to `v`, or `make`'s (which must equal `v`),
    /// held from now on.
    pub fn get<Q>(&mut self, v: &Q, make: impl FnOnce() -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        if let Some(held) = self.set.get(v) {
            return Arc::clone(held);
        }
        if self.set.len() >= self.sweep_at {
            self.set.retain(|a| Arc::strong_count(a) > 1);
            self.sweep_at = self.set.len().saturating_mul(2).max(SMALLEST_SWEEP);
        }
        let made = make();
        self.set.insert(Arc::clone(&made));
        made
    }

    /// How many values are held.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_share_one_allocation() {
        let mut i = Interned::<str>::default();
        let a = i.get("drain 5s", || Arc::from("drain 5s"));
        let b = i.get("drain 5s", || Arc::from("drain 5s"));
        let c = i.get("drain 9s", || Arc::from("drain 9s"));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(i.len(), 2);
    }

    #[test]
    fn what_nobody_holds_is_swept_and_the_set_stays_bounded() {
        let mut i = Interned::<str>::default();
        let kept: Vec<Arc<str>> = (0..10)
            .map(|n| {
                let v = format!("kept {n}");
                i.get(v.as_str(), || Arc::from(v.as_str()))
            })
            .collect();
        for n in 0..10_000 {
            let v = format!("gone {n}");
            drop(i.get(v.as_str(), || Arc::from(v.as_str())));
            assert!(i.len() <= 2 * SMALLEST_SWEEP, "{} held", i.len());
        }
        for k in &kept {
            let again = i.get(&**k, || Arc::from(&**k));
            assert!(Arc::ptr_eq(k, &again), "a value in use is never swept");
        }
    }
}
