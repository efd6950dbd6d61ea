//! The ADS service as tonic serves it: the routing of the generated
//! `AggregatedDiscoveryServiceServer` (envoy-types), with one difference,
//! the codec. The generated server encodes and decodes with tonic's
//! default buffers, 8 KiB allocated up front each way for every stream,
//! and tonic's buffers never shrink: each keeps the largest size it grew
//! to for as long as the stream lives, on every proxy. Here they start at
//! [`BUFFER_BYTES`] and grow to what a message needs:
//! - responses are handed to h2 one at a time once they pass
//!   [`BUFFER_BYTES`] (tonic's default gathers up to 32 KiB of ready
//!   responses into one buffer first, so a stream's first pushes, sent
//!   back to back, grew it to their sum), and each is reserved at its
//!   exact encoded size (prost would grow the buffer field by field,
//!   doubling); so the encode buffer keeps about the largest single
//!   response, not the largest burst;
//! - requests (ACKs, about 150 bytes; the first, with the node, a few
//!   hundred) are read into a buffer that grows to the largest request.
//!
//! h2 copies or chains every chunk into its own write buffer either way,
//! so a response per chunk costs no extra copy; DATA frames are still
//! packed up to 16 KiB.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, SERVICE_NAME,
};
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::codegen::{Body, BoxFuture, Service, StdError};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Each stream's encode and decode buffers start this large, and ready
/// responses are gathered into one chunk for h2 up to this size. An ACK is
/// about 150 bytes, an EDS change of one Service a few hundred.
pub const BUFFER_BYTES: usize = 512;

fn settings() -> BufferSettings {
    BufferSettings::new(BUFFER_BYTES, BUFFER_BYTES)
}

const STREAM_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// Prost's codec with [`BUFFER_BYTES`] buffers.
#[derive(Debug)]
pub struct SmallBuffers<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SmallBuffers<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for SmallBuffers<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ExactEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ExactEncoder(ProstCodec::<T, U>::raw_encoder(settings()))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(settings())
    }
}

/// Prost's encoder, reserving each message's encoded size before it
/// writes: one growth to what the message needs.
#[derive(Debug)]
pub struct ExactEncoder<T>(ProstEncoder<T>);

impl<T: prost::Message> Encoder for ExactEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.reserve(item.encoded_len());
        self.0.encode(item, dst)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// The ADS service `T` for tonic's router, with message size caps.
pub struct AdsServer<T> {
    inner: Arc<T>,
    max_decoding: usize,
    max_encoding: usize,
}

impl<T> AdsServer<T> {
    /// `inner`, taking requests up to `max_decoding` bytes and sending
    /// responses up to `max_encoding` (larger ones end the stream).
    pub fn new(inner: T, max_decoding: usize, max_encoding: usize) -> Self {
        Self {
            inner: Arc::new(inner),
            max_decoding,
            max_encoding,
        }
    }

    fn grpc<Req, Res>(&self) -> Grpc<SmallBuffers<Res, Req>>
    where
        Res: prost::Message + Send + 'static,
        Req: prost::Message + Default + Send + 'static,
    {
        Grpc::new(SmallBuffers::default())
            .apply_max_message_size_config(Some(self.max_decoding), Some(self.max_encoding))
    }
}

impl<T> Clone for AdsServer<T> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            max_decoding: self.max_decoding,
            max_encoding: self.max_encoding,
        }
    }
}

impl<T> NamedService for AdsServer<T> {
    const NAME: &'static str = SERVICE_NAME;
}

/// State of the world ADS, one stream.
struct Sotw<T>(Arc<T>);

impl<T: AggregatedDiscoveryService> StreamingService<DiscoveryRequest> for Sotw<T> {
    type Response = envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;
    type ResponseStream = T::StreamAggregatedResourcesStream;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, tonic::Status>;

    fn call(
        &mut self,
        request: tonic::Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { inner.stream_aggregated_resources(request).await })
    }
}

/// Delta ADS, one stream.
struct Delta<T>(Arc<T>);

impl<T: AggregatedDiscoveryService> StreamingService<DeltaDiscoveryRequest> for Delta<T> {
    type Response = envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryResponse;
    type ResponseStream = T::DeltaAggregatedResourcesStream;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, tonic::Status>;

    fn call(
        &mut self,
        request: tonic::Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { inner.delta_aggregated_resources(request).await })
    }
}

impl<T, B> Service<http::Request<B>> for AdsServer<T>
where
    T: AggregatedDiscoveryService,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match req.uri().path() {
            STREAM_PATH => {
                let (mut grpc, method) = (self.grpc(), Sotw(Arc::clone(&self.inner)));
                Box::pin(async move { Ok(grpc.streaming(method, req).await) })
            }
            DELTA_PATH => {
                let (mut grpc, method) = (self.grpc(), Delta(Arc::clone(&self.inner)));
                Box::pin(async move { Ok(grpc.streaming(method, req).await) })
            }
            _ => Box::pin(async {
                Ok(tonic::Status::unimplemented("not a method of the ADS service").into_http())
            }),
        }
    }
}
