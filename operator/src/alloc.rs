//! The allocator's settings. The operator runs on mimalloc (see main.rs),
//! whose v3 keeps freed memory resident for a second (`purge_delay`) before
//! giving it back. Under a stream of large reviews (up to 4 MiB each) that
//! is many bodies freed but still resident, counted against the pod's
//! memory limit. Purging at once costs an madvise per freed span, small
//! next to parsing a review.

/// mimalloc's `mi_option_purge_delay` (`mimalloc.h`; libmimalloc-sys names
/// no constant for it). The test below checks the index against mimalloc's
/// documented default, so a renumbering would fail it.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// mimalloc v3's default `purge_delay`, in milliseconds.
pub const DEFAULT_PURGE_DELAY_MS: std::ffi::c_long = 1000;

/// Give freed memory back to the OS as soon as it is freed (no delay).
/// Call first thing in `main`; the option is read at each purge, so it
/// also applies to what was allocated before.
// An FFI call into the allocator: the second documented `unsafe` exception.
#[allow(unsafe_code)]
pub fn purge_freed_memory_at_once() {
    // SAFETY: mi_option_set only stores an integer in mimalloc's option
    // table; any value is valid for purge_delay (0: purge at once).
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) }
}

/// The current `purge_delay`, in milliseconds.
#[allow(unsafe_code)]
pub fn purge_delay_ms() -> std::ffi::c_long {
    // SAFETY: reads mimalloc's option table (initialised on first read).
    unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_memory_is_purged_at_once_once_configured() {
        // The index names purge_delay: its default is mimalloc's documented
        // one (unless the environment overrides it, as MIMALLOC_PURGE_DELAY may).
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(purge_delay_ms(), DEFAULT_PURGE_DELAY_MS);
        }
        purge_freed_memory_at_once();
        assert_eq!(purge_delay_ms(), 0);
    }
}
