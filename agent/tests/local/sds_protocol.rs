//! xDS semantics of the SDS server, seen by a raw gRPC client over the Unix
//! socket: ACK/NACK, targeted pushes, watched-name changes, unknown names,
//! malformed requests, FetchSecrets, DeltaSecrets, file-* names, fan-out.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use crate::support_sds::*;
use anyhow::{Result, anyhow};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{Secret, secret};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prometheus_client::registry::Registry;
use prost::Message;
use remora_agent::certs::file::FileSource;
use remora_agent::readiness::Readiness;
use remora_agent::sds::{self, SdsHandle};
use remora_test_support::pki::serial_of_pem;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint, Uri};

const TYPE: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

async fn channel(path: PathBuf) -> Result<Channel> {
    Ok(Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }))
        .await?)
}

struct Sub {
    tx: mpsc::Sender<DiscoveryRequest>,
    rx: tonic::Streaming<DiscoveryResponse>,
    nonce: String,
    version: String,
}

impl Sub {
    async fn open(ch: &Channel, names: &[&str]) -> Result<Self> {
        let (tx, rx) = mpsc::channel(8);
        tx.send(req(names, "", "", None)).await?;
        let rx = SecretDiscoveryServiceClient::new(ch.clone())
            .stream_secrets(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(Self {
            tx,
            rx,
            nonce: String::new(),
            version: String::new(),
        })
    }
    async fn next(&mut self) -> Result<DiscoveryResponse> {
        let r = tokio::time::timeout(DEADLINE, self.rx.message())
            .await
            .map_err(|_| anyhow!("no response in time"))??
            .ok_or_else(|| anyhow!("stream closed"))?;
        assert_eq!(r.type_url, TYPE);
        assert!(!r.nonce.is_empty() && !r.version_info.is_empty());
        self.nonce = r.nonce.clone();
        self.version = r.version_info.clone();
        Ok(r)
    }
    async fn ack(&self, names: &[&str]) -> Result<()> {
        self.tx
            .send(req(names, &self.version, &self.nonce, None))
            .await?;
        Ok(())
    }
    async fn nack(&self, names: &[&str]) -> Result<()> {
        let err = RpcStatus {
            code: 3,
            message: "bad secret".into(),
            details: vec![],
        };
        self.tx
            .send(req(names, "previous", &self.nonce, Some(err)))
            .await?;
        Ok(())
    }
}

fn req(names: &[&str], version: &str, nonce: &str, err: Option<RpcStatus>) -> DiscoveryRequest {
    DiscoveryRequest {
        version_info: version.into(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        type_url: TYPE.into(),
        response_nonce: nonce.into(),
        error_detail: err,
        ..Default::default()
    }
}

fn secrets(r: &DiscoveryResponse) -> Vec<Secret> {
    r.resources
        .iter()
        .map(|a| {
            assert_eq!(a.type_url, TYPE);
            Secret::decode(a.value.as_slice()).unwrap()
        })
        .collect()
}

fn names(r: &DiscoveryResponse) -> Vec<String> {
    let mut n: Vec<String> = secrets(r).into_iter().map(|s| s.name).collect();
    n.sort();
    n
}

fn chain_of(s: &Secret) -> String {
    use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
    match &s.r#type {
        Some(secret::Type::TlsCertificate(t)) => match t
            .certificate_chain
            .as_ref()
            .and_then(|d| d.specifier.as_ref())
        {
            Some(Specifier::InlineBytes(b)) => String::from_utf8_lossy(b).into_owned(),
            _ => String::new(),
        },
        _ => String::new(),
    }
}

struct Rig {
    _tmp: tempfile::TempDir,
    certs: PathBuf,
    socket: PathBuf,
    registry: Registry,
    readiness: Readiness,
    cancel: CancellationToken,
    handle: SdsHandle,
    root: Ca,
}

async fn rig() -> Result<Rig> {
    let tmp = tempfile::tempdir()?;
    let certs = tmp.path().join("certs");
    let root = Ca::new("root");
    write_certs(&certs, &root.leaf(), &root.pem);
    let socket = tmp.path().join("sds.sock");
    // A stale socket from a previous run is replaced.
    std::os::unix::net::UnixListener::bind(&socket)?;
    let readiness = Readiness::new();
    let mut registry = Registry::default();
    let cancel = CancellationToken::new();
    let handle = sds::start_with(
        socket.clone(),
        Some(Box::new(FileSource::new(certs.clone()))),
        &mut registry,
        cancel.clone(),
    )
    .await?;
    // As the agent does when its listeners use both (`--inbound-tls`).
    handle.hold_readiness(&readiness, sds::UsedSecrets::BOTH);
    wait_until(DEADLINE, "bundle", || async { handle.current() }).await?;
    Ok(Rig {
        _tmp: tmp,
        certs,
        socket,
        registry,
        readiness,
        cancel,
        handle,
        root,
    })
}

impl Rig {
    fn rotate_leaf(&self) -> Leaf {
        let l = self.root.leaf();
        write_certs(&self.certs, &l, &self.root.pem);
        l
    }
    fn rotate_root(&mut self) -> Leaf {
        self.root = Ca::new("root-next");
        self.rotate_leaf()
    }
}

#[tokio::test]
async fn ack_nack_and_targeted_pushes() -> Result<()> {
    let mut rig = rig().await?;
    let ch = channel(rig.socket.clone()).await?;
    let mut a = Sub::open(&ch, &["default"]).await?;
    let mut b = Sub::open(&ch, &["ROOTCA"]).await?;

    let r = a.next().await?;
    assert_eq!(names(&r), vec!["default"]);
    let r = b.next().await?;
    assert_eq!(names(&r), vec!["ROOTCA"]);
    a.ack(&["default"]).await?;
    b.ack(&["ROOTCA"]).await?;
    wait_until(DEADLINE, "readiness", || async {
        rig.readiness.is_ready().then_some(())
    })
    .await?;

    // A leaf rotation goes to the `default` stream only. The next message A
    // sees is the new leaf (so the ACK was not answered).
    let v1 = a.version.clone();
    let leaf = rig.rotate_leaf();
    let r = a.next().await?;
    assert_ne!(a.version, v1);
    assert_eq!(serial_of_pem(&chain_of(&secrets(&r)[0])), leaf.serial);

    // NACK: counted, nothing resent.
    a.nack(&["default"]).await?;
    wait_until(DEADLINE, "nack counted", || async {
        (metric(&rig.registry, "sds_nacks_total") >= 1.0).then_some(())
    })
    .await?;

    // A root change reaches B; the first thing B sees after its ACK is the
    // new ROOTCA (it never got the earlier leaf rotation).
    let leaf2 = rig.rotate_root();
    let r = b.next().await?;
    assert_eq!(names(&r), vec!["ROOTCA"]);
    let r = a.next().await?;
    assert_eq!(names(&r), vec!["default"]);
    assert_eq!(serial_of_pem(&chain_of(&secrets(&r)[0])), leaf2.serial);

    // Watched names change: A adds ROOTCA and gets just that.
    a.ack(&["default", "ROOTCA"]).await?;
    let r = a.next().await?;
    assert_eq!(names(&r), vec!["ROOTCA"]);
    // A drops `default`: a leaf rotation no longer reaches it, a root change does.
    // The unknown name rides along so the test can see the server has taken the
    // narrowed set (it is counted after `default` is dropped) before it rotates:
    // the certificate wake is fast enough to beat an unacknowledged ACK.
    a.ack(&["ROOTCA", "no-such-secret"]).await?;
    wait_until(DEADLINE, "narrowed watch taken", || async {
        (metric(&rig.registry, "sds_unknown_names_total") >= 1.0).then_some(())
    })
    .await?;
    rig.rotate_leaf();
    rig.rotate_root();
    let r = a.next().await?;
    assert_eq!(names(&r), vec!["ROOTCA"], "A gets only what it watches");

    rig.cancel.cancel();
    rig.handle.join().await?;
    Ok(())
}

#[tokio::test]
async fn unknown_names_malformed_requests_fetch_and_delta() -> Result<()> {
    let rig = rig().await?;
    let ch = channel(rig.socket.clone()).await?;

    // Unknown names are skipped (and counted); known ones still served.
    let mut s = Sub::open(
        &ch,
        &["no-such-secret", "default", "file-cert:only-one-part"],
    )
    .await?;
    let r = s.next().await?;
    assert_eq!(names(&r), vec!["default"]);
    assert_eq!(metric(&rig.registry, "sds_unknown_names_total"), 2.0);

    // A request for another type is refused with InvalidArgument.
    let (tx, rx) = mpsc::channel(1);
    let mut bad = req(&["default"], "", "", None);
    bad.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
    tx.send(bad).await?;
    let mut st = SecretDiscoveryServiceClient::new(ch.clone())
        .stream_secrets(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let err = tokio::time::timeout(DEADLINE, st.message())
        .await?
        .expect_err("invalid type must fail");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // Raw garbage instead of a protobuf message: a clean error, server unharmed.
    let garbage = raw_grpc_garbage(&rig.socket).await?;
    assert_ne!(garbage, tonic::Code::Ok);

    let mut client = SecretDiscoveryServiceClient::new(ch.clone());
    let r = client
        .fetch_secrets(req(&["ROOTCA"], "", "", None))
        .await?
        .into_inner();
    assert_eq!(names(&r), vec!["ROOTCA"]);
    let err = client
        .fetch_secrets(req(&["nothing-here"], "", "", None))
        .await
        .expect_err("unknown");
    assert_eq!(err.code(), tonic::Code::NotFound);

    let (_dtx, drx) = mpsc::channel::<DeltaDiscoveryRequest>(1);
    let err = client
        .delta_secrets(ReceiverStream::new(drx))
        .await
        .expect_err("delta");
    assert_eq!(err.code(), tonic::Code::Unimplemented);

    // The first stream is still alive and serving.
    rig.rotate_leaf();
    let r = s.next().await?;
    assert_eq!(names(&r), vec!["default"]);

    rig.cancel.cancel();
    rig.handle.join().await?;
    Ok(())
}

/// Send a gRPC frame whose payload is not a protobuf; return the grpc-status.
async fn raw_grpc_garbage(socket: &Path) -> Result<tonic::Code> {
    let ch = channel(socket.to_path_buf()).await?;
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await?;
    let path = http::uri::PathAndQuery::from_static(
        "/envoy.service.secret.v3.SecretDiscoveryService/FetchSecrets",
    );
    let codec = RawCodec;
    let res: Result<tonic::Response<Vec<u8>>, tonic::Status> = grpc
        .unary(
            tonic::Request::new(vec![0xff, 0xff, 0xff, 0x01]),
            path,
            codec,
        )
        .await;
    Ok(match res {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    })
}

/// A codec that sends bytes as they are.
#[derive(Default, Clone)]
struct RawCodec;
struct RawEnc;
struct RawDec;
impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEnc;
    type Decoder = RawDec;
    fn encoder(&mut self) -> RawEnc {
        RawEnc
    }
    fn decoder(&mut self) -> RawDec {
        RawDec
    }
}
impl tonic::codec::Encoder for RawEnc {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}
impl tonic::codec::Decoder for RawDec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        let v = src.chunk().to_vec();
        src.advance(v.len());
        Ok(Some(v))
    }
}

#[tokio::test]
async fn file_cert_and_file_root_names() -> Result<()> {
    let rig = rig().await?;
    let dir = rig._tmp.path().join("other");
    std::fs::create_dir_all(&dir)?;
    let other = Ca::new("other-root");
    let leaf = other.leaf();
    std::fs::write(dir.join("c.pem"), &leaf.chain)?;
    std::fs::write(dir.join("k.pem"), &leaf.key)?;
    std::fs::write(dir.join("r.pem"), &other.pem)?;
    let cert_name = format!(
        "file-cert:{}~{}",
        dir.join("c.pem").display(),
        dir.join("k.pem").display()
    );
    let root_name = format!("file-root:{}", dir.join("r.pem").display());

    let ch = channel(rig.socket.clone()).await?;
    let mut s = Sub::open(&ch, &[&cert_name, &root_name]).await?;
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let r = s.next().await?;
        seen.extend(names(&r));
        s.ack(&[&cert_name, &root_name]).await?;
    }
    seen.sort();
    let mut want = vec![cert_name.clone(), root_name.clone()];
    want.sort();
    assert_eq!(seen, want);

    // Rewriting the files pushes the new cert.
    let next = other.leaf();
    std::fs::write(dir.join("k.pem"), &next.key)?;
    std::fs::write(dir.join("c.pem"), &next.chain)?;
    let r = loop {
        let r = s.next().await?;
        s.ack(&[&cert_name, &root_name]).await?;
        if names(&r).contains(&cert_name)
            && serial_of_pem(&chain_of(&secrets(&r)[0])) == next.serial
        {
            break r;
        }
    };
    assert_eq!(names(&r), vec![cert_name.clone()]);

    rig.cancel.cancel();
    rig.handle.join().await?;
    Ok(())
}

/// File secrets are held only while a stream (or a fetch) asks for them:
/// dropping the name from a request, closing the stream or a finished fetch
/// releases the entry and its file watch task.
#[tokio::test]
async fn file_secrets_are_released_when_no_stream_asks() -> Result<()> {
    let rig = rig().await?;
    let root_file = rig._tmp.path().join("extra-root.pem");
    std::fs::write(&root_file, &Ca::new("extra").pem)?;
    let root_name = format!("file-root:{}", root_file.display());
    let held = |n: usize| {
        let (registry, handle) = (&rig.registry, &rig.handle);
        async move {
            let m = metric(registry, "sds_file_secrets");
            (m == n as f64 && handle.file_secrets() == n).then_some(())
        }
    };
    assert!(held(0).await.is_some());

    let ch = channel(rig.socket.clone()).await?;
    let mut a = Sub::open(&ch, &["default", &root_name]).await?;
    let mut seen = Vec::new();
    while !seen.contains(&root_name) {
        seen.extend(names(&a.next().await?));
    }
    let mut b = Sub::open(&ch, &[&root_name]).await?;
    assert_eq!(names(&b.next().await?), vec![root_name.clone()]);
    assert!(held(1).await.is_some(), "one entry, shared by two streams");

    // A drops the name but keeps streaming; B still holds it.
    a.ack(&["default"]).await?;
    assert!(held(1).await.is_some());
    // B goes away: nobody asks any more.
    drop(b);
    wait_until(DEADLINE, "the file secret released", || held(0)).await?;

    // A one-shot fetch loads it and lets it go again.
    let r = SecretDiscoveryServiceClient::new(ch.clone())
        .fetch_secrets(req(&[&root_name], "", "", None))
        .await?
        .into_inner();
    assert_eq!(names(&r), vec![root_name.clone()]);
    wait_until(DEADLINE, "released after the fetch", || held(0)).await?;

    // Asked for again: a fresh entry serves it.
    a.ack(&["default", &root_name]).await?;
    let r = a.next().await?;
    assert_eq!(names(&r), vec![root_name.clone()]);
    assert!(held(1).await.is_some());
    drop(a);
    wait_until(DEADLINE, "released when the stream closed", || held(0)).await?;

    rig.cancel.cancel();
    rig.handle.join().await?;
    Ok(())
}

#[tokio::test]
async fn push_fans_out_to_100_streams() -> Result<()> {
    let rig = rig().await?;
    let mut subs = Vec::new();
    for _ in 0..4 {
        let ch = channel(rig.socket.clone()).await?;
        for _ in 0..25 {
            subs.push(Sub::open(&ch, &["default"]).await?);
        }
    }
    for s in &mut subs {
        s.next().await?;
        s.ack(&["default"]).await?;
    }
    assert_eq!(metric(&rig.registry, "sds_streams"), 100.0);
    let leaf = rig.rotate_leaf();
    for s in &mut subs {
        let r = s.next().await?;
        assert_eq!(serial_of_pem(&chain_of(&secrets(&r)[0])), leaf.serial);
    }
    drop(subs);
    wait_until(DEADLINE, "streams closed", || async {
        (metric(&rig.registry, "sds_streams") == 0.0).then_some(())
    })
    .await?;
    rig.cancel.cancel();
    rig.handle.join().await?;
    Ok(())
}

fn run_config(args: &[&str]) -> Result<remora_agent::config::RunConfig> {
    use clap::Parser;
    use remora_agent::config::{Cli, Command};
    let mut argv = vec!["remora-agent", "run"];
    argv.extend_from_slice(args);
    match Cli::try_parse_from(argv)?.command {
        Command::Run(cfg) => Ok(*cfg),
        other => Err(anyhow!("not run: {other:?}")),
    }
}

#[tokio::test]
async fn start_from_run_config_with_and_without_a_source() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let certs = tmp.path().join("certs");
    let root = Ca::new("root");
    write_certs(&certs, &root.leaf(), &root.pem);

    // --cert-dir: file source, readiness held until Envoy fetched both secrets.
    let sock = tmp.path().join("a").join("sds.sock");
    let cfg = run_config(&[
        "--cert-dir",
        certs.to_str().unwrap(),
        "--sds-socket",
        sock.to_str().unwrap(),
    ])?;
    let readiness = Readiness::new();
    let mut registry = Registry::default();
    let cancel = CancellationToken::new();
    let handle = sds::start(&cfg, &mut registry, cancel.clone()).await?;
    handle.hold_readiness(&readiness, sds::UsedSecrets::BOTH);
    wait_until(DEADLINE, "waiting-for-Envoy reason", || async {
        readiness
            .pending()
            .into_iter()
            .find(|(n, r)| n == sds::READINESS_GUARD && r.contains("default and ROOTCA"))
    })
    .await?;
    let ch = channel(sock.clone()).await?;
    let mut s = Sub::open(&ch, &["default", "ROOTCA"]).await?;
    let mut got = Vec::new();
    while got.len() < 2 {
        got.extend(names(&s.next().await?));
    }
    wait_until(DEADLINE, "ready", || async {
        readiness.is_ready().then_some(())
    })
    .await?;
    cancel.cancel();
    handle.join().await?;

    // Only `default` used: only `default` is waited for.
    let sock = tmp.path().join("c").join("sds.sock");
    let cfg = run_config(&[
        "--cert-dir",
        certs.to_str().unwrap(),
        "--sds-socket",
        sock.to_str().unwrap(),
    ])?;
    let readiness = Readiness::new();
    let mut registry = Registry::default();
    let cancel = CancellationToken::new();
    let handle = sds::start(&cfg, &mut registry, cancel.clone()).await?;
    let only_default = sds::UsedSecrets {
        workload: true,
        root_ca: false,
    };
    handle.hold_readiness(&readiness, only_default);
    wait_until(DEADLINE, "waiting for default only", || async {
        readiness
            .pending()
            .into_iter()
            .find(|(_, r)| r == "waiting for Envoy to fetch default")
    })
    .await?;
    let ch = channel(sock.clone()).await?;
    let mut s = Sub::open(&ch, &["default"]).await?;
    assert_eq!(names(&s.next().await?), vec!["default".to_string()]);
    wait_until(DEADLINE, "ready without ROOTCA", || async {
        readiness.is_ready().then_some(())
    })
    .await?;
    cancel.cancel();
    handle.join().await?;

    // No certificate flags: no guard even when a listener would use them
    // (nothing could ever be served), file-root: names still work.
    let sock = tmp.path().join("b").join("sds.sock");
    let cfg = run_config(&["--sds-socket", sock.to_str().unwrap()])?;
    let readiness = Readiness::new();
    let mut registry = Registry::default();
    let cancel = CancellationToken::new();
    let handle = sds::start(&cfg, &mut registry, cancel.clone()).await?;
    handle.hold_readiness(&readiness, sds::UsedSecrets::BOTH);
    assert!(handle.bundles().is_none());
    assert!(readiness.is_ready());
    let ch = channel(sock).await?;
    let root_name = format!("file-root:{}", certs.join("root-cert.pem").display());
    let r = SecretDiscoveryServiceClient::new(ch)
        .fetch_secrets(req(&[&root_name], "", "", None))
        .await?
        .into_inner();
    assert_eq!(names(&r), vec![root_name]);
    cancel.cancel();
    handle.join().await?;
    Ok(())
}
