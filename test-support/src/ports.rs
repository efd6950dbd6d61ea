//! Free TCP ports.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::sync::Mutex;

/// A port free right now on every address (so on 127.0.0.1 too), never
/// handed out before by this process: tests that pick several ports before
/// binding any would otherwise get the same one twice. Another process may
/// still take it before the caller binds it.
pub fn try_free_port() -> std::io::Result<u16> {
    static USED: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        let port = TcpListener::bind("0.0.0.0:0")?.local_addr()?.port();
        if USED.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return Ok(port);
        }
    }
}

/// [`try_free_port`], panicking when the kernel has no port to give.
pub fn free_port() -> u16 {
    try_free_port().unwrap_or_else(|e| panic!("no free TCP port on 0.0.0.0: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_bindable_and_never_repeat() {
        let ports: BTreeSet<u16> = (0..20).map(|_| free_port()).collect();
        assert_eq!(ports.len(), 20);
        let first = ports.first().copied().unwrap_or_default();
        assert!(TcpListener::bind(("127.0.0.1", first)).is_ok());
    }
}
