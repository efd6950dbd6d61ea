//! Connections accepted while no place is free: held unread, oldest first,
//! until a place frees up or their deadline passes (see the crate doc).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::Metrics;

struct Parked {
    stream: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
}

pub(crate) struct Parking {
    queue: VecDeque<Parked>,
    cap: usize,
    wait: Duration,
}

/// A parked connection holds a file descriptor: park at most a quarter of
/// what the process may open, so a flood cannot run the server out of them.
fn fd_share(max: usize) -> usize {
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
        Ok((soft, _)) => max.min(usize::try_from(soft / 4).unwrap_or(usize::MAX)),
        Err(_) => max,
    }
}

impl Parking {
    pub fn new(max: usize, wait: Duration) -> Self {
        Self {
            queue: VecDeque::new(),
            cap: fd_share(max),
            wait,
        }
    }

    #[cfg(test)]
    fn with_cap(cap: usize, wait: Duration) -> Self {
        Self {
            queue: VecDeque::new(),
            cap,
            wait,
        }
    }

    /// Holds `stream`; when full, the oldest parked one is closed for it.
    pub fn park(&mut self, stream: TcpStream, peer: SocketAddr, metrics: &Metrics) {
        if self.cap == 0 {
            metrics.refused();
            return;
        }
        if self.queue.len() >= self.cap {
            self.queue.pop_front();
            metrics.refused();
        }
        metrics.parked();
        self.queue.push_back(Parked {
            stream,
            peer,
            deadline: crate::deadline_after(self.wait),
        });
    }

    /// When the oldest parked connection is due to be closed.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.queue.front().map(|p| p.deadline)
    }

    /// Closes the connections whose deadline has passed.
    pub fn expire(&mut self, metrics: &Metrics) {
        let now = Instant::now();
        while self.queue.front().is_some_and(|p| p.deadline <= now) {
            self.queue.pop_front();
            metrics.refused();
        }
    }

    /// The oldest connection still within its deadline.
    pub fn pop(&mut self, metrics: &Metrics) -> Option<(TcpStream, SocketAddr)> {
        self.expire(metrics);
        self.queue.pop_front().map(|p| (p.stream, p.peer))
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(listener: &tokio::net::TcpListener) -> (TcpStream, SocketAddr) {
        let addr = listener.local_addr().expect("addr");
        let (_client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        accepted.expect("accept")
    }

    #[tokio::test(start_paused = true)]
    async fn parked_connections_leave_oldest_first_and_expire_at_their_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let m = Metrics::default();
        let mut p = Parking::with_cap(2, Duration::from_secs(5));
        let (s1, a1) = pair(&listener).await;
        p.park(s1, a1, &m);
        tokio::time::advance(Duration::from_secs(1)).await;
        let (s2, a2) = pair(&listener).await;
        p.park(s2, a2, &m);
        let (s3, a3) = pair(&listener).await;
        // Full: the oldest makes room.
        p.park(s3, a3, &m);
        assert_eq!((p.len(), m.refused_total(), m.parked_total()), (2, 1, 3));
        assert_eq!(p.pop(&m).map(|(_, a)| a), Some(a2));
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(p.next_deadline().map(|d| d <= Instant::now()), Some(true));
        assert!(p.pop(&m).is_none(), "past its deadline");
        assert_eq!(m.refused_total(), 2);
    }

    #[tokio::test]
    async fn a_huge_wait_does_not_panic() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let m = Metrics::default();
        let mut p = Parking::with_cap(1, Duration::MAX);
        let (s, a) = pair(&listener).await;
        p.park(s, a, &m);
        assert!(p.next_deadline().is_some_and(|d| d > Instant::now()));
    }

    #[test]
    fn the_cap_is_at_most_a_quarter_of_the_file_limit() {
        let (soft, _) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
            .expect("getrlimit");
        assert!(fd_share(usize::MAX) as u64 <= soft / 4);
        assert_eq!(fd_share(1), 1);
    }
}
