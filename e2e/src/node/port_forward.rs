//! A local TCP port that leads to a port bound inside a pod, as `kubectl
//! port-forward` gives one: the way a host-side client reaches a listener on
//! the pod's loopback (a sidecar's outbound listener on `127.0.0.1:15001`),
//! which no address outside the pod's network namespace reaches.
//!
//! [`PortForward::start`] listens on `127.0.0.1:0`; every connection it
//! accepts gets a port-forward stream of its own through the API server and
//! the kubelet (kube's `Api::<Pod>::portforward`, a WebSocket per
//! connection), and bytes are copied both ways until either side closes.
//! So a client's connections stay what they are: one TCP connection on the
//! host is one TCP connection into the pod (a keep-alive client keeps its
//! connection, an HTTP/2 client multiplexes on it), and a connection that
//! cannot be forwarded is closed at once (the client sees it fail) and its
//! reason kept in [`PortForward::errors`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::Error;

/// The longest a connection waits for its port-forward stream to open.
const OPEN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A listener on `127.0.0.1` forwarding each connection to `port` of one
/// pod. Dropping it stops accepting and cuts the connections in progress.
pub struct PortForward {
    local: SocketAddr,
    target: String,
    errors: Arc<Mutex<Vec<String>>>,
    accepted: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl PortForward {
    /// Listens on `127.0.0.1:0` and forwards every connection to `port` of
    /// pod `namespace/pod`.
    pub async fn start(
        client: &Client,
        namespace: &str,
        pod: &str,
        port: u16,
    ) -> Result<Self, Error> {
        let target = format!("{namespace}/{pod}:{port}");
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| Error::io(format!("binding the local end of a forward to {target}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("the forward's local address", e))?;
        let errors = Arc::new(Mutex::new(Vec::new()));
        let accepted = Arc::new(AtomicUsize::new(0));
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        let accept = tokio::spawn(accept_loop(
            listener,
            pods,
            pod.to_owned(),
            port,
            errors.clone(),
            accepted.clone(),
        ));
        Ok(Self {
            local,
            target,
            errors,
            accepted,
            accept,
        })
    }

    /// Where clients connect: `127.0.0.1:<ephemeral>`.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// What the forward leads to, `namespace/pod:port`.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// Connections accepted so far: each one TCP connection into the pod.
    pub fn connections(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Every connection that could not be forwarded, or whose stream the
    /// kubelet reported broken (e.g. nothing listening on the port), and
    /// why; in the order they happened.
    pub fn errors(&self) -> Vec<String> {
        self.errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        // The accept task owns the connections' JoinSet: aborting it drops
        // the set, which aborts every connection task.
        self.accept.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    pods: Api<Pod>,
    pod: String,
    port: u16,
    errors: Arc<Mutex<Vec<String>>>,
    accepted: Arc<AtomicUsize>,
) {
    let mut conns = JoinSet::new();
    loop {
        let next = tokio::select! {
            a = listener.accept() => a,
            // Reap finished connections so the set stays small.
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        match next {
            Ok((tcp, peer)) => {
                accepted.fetch_add(1, Ordering::SeqCst);
                conns.spawn(forward_one(
                    tcp,
                    peer,
                    pods.clone(),
                    pod.clone(),
                    port,
                    errors.clone(),
                ));
            }
            Err(e) => {
                push(&errors, format!("accept: {e}"));
                // Out of file descriptors and the like: do not spin.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

fn push(errors: &Mutex<Vec<String>>, e: String) {
    errors.lock().unwrap_or_else(|p| p.into_inner()).push(e);
}

/// One accepted connection: its own port-forward stream, then bytes both
/// ways until either side closes.
async fn forward_one(
    mut tcp: TcpStream,
    peer: SocketAddr,
    pods: Api<Pod>,
    pod: String,
    port: u16,
    errors: Arc<Mutex<Vec<String>>>,
) {
    let _ = tcp.set_nodelay(true);
    let opened = tokio::time::timeout(OPEN_TIMEOUT, pods.portforward(&pod, &[port])).await;
    let mut forwarder = match opened {
        Ok(Ok(f)) => f,
        Ok(Err(e)) => {
            push(&errors, format!("{peer}: opening the forward: {e}"));
            return;
        }
        Err(_) => {
            push(
                &errors,
                format!("{peer}: the forward did not open in {OPEN_TIMEOUT:?}"),
            );
            return;
        }
    };
    let (Some(mut stream), Some(error)) = (forwarder.take_stream(port), forwarder.take_error(port))
    else {
        push(&errors, format!("{peer}: no stream for port {port}"));
        forwarder.abort();
        return;
    };
    // The kubelet writes on the error channel when it cannot reach the
    // port in the pod (or loses it); the channel also ends, without a
    // message, when the forward closes normally.
    let mut reported = {
        let errors = errors.clone();
        tokio::spawn(async move {
            if let Some(msg) = error.await {
                push(&errors, format!("{peer}: kubelet: {msg}"));
            }
        })
    };
    if let Err(e) = tokio::io::copy_bidirectional(&mut tcp, &mut stream).await {
        // A peer resetting its connection is how clients and Envoy end
        // connections too; only kept as a hint, not a failure of the forward.
        if !matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ) {
            push(&errors, format!("{peer}: copying: {e}"));
        }
    }
    // Our end closed: the forward closes its WebSocket and ends, which
    // ends the error channel; wait briefly for that, so an error the
    // kubelet sent last is kept, then make sure nothing lingers.
    drop(stream);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), &mut reported).await;
    forwarder.abort();
    reported.abort();
}
