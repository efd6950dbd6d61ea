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

/// A blocking TCP connection to `to` from the address `source` (any port):
/// with 127.0.0.2 and the like a test is a second client on another address,
/// as a peer outside the pod would be.
pub fn connect_from(
    source: std::net::IpAddr,
    to: std::net::SocketAddr,
) -> std::io::Result<std::net::TcpStream> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    rt.block_on(async {
        let socket = if to.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        socket.bind(std::net::SocketAddr::new(source, 0))?;
        let stream = socket.connect(to).await?.into_std()?;
        stream.set_nonblocking(false)?;
        Ok(stream)
    })
}

/// [`try_free_port`], panicking when the kernel has no port to give.
pub fn free_port() -> u16 {
    try_free_port().unwrap_or_else(|e| panic!("no free TCP port on 0.0.0.0: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_from_uses_the_source_address() {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let to = l.local_addr().expect("addr");
        let source: std::net::IpAddr = [127, 0, 0, 2].into();
        let c = connect_from(source, to).expect("connect");
        let (_, peer) = l.accept().expect("accept");
        assert_eq!(peer.ip(), source);
        assert_eq!(c.local_addr().expect("local").ip(), source);
    }

    #[test]
    fn ports_are_bindable_and_never_repeat() {
        let ports: BTreeSet<u16> = (0..20).map(|_| free_port()).collect();
        assert_eq!(ports.len(), 20);
        let first = ports.first().copied().unwrap_or_default();
        assert!(TcpListener::bind(("127.0.0.1", first)).is_ok());
    }
}
