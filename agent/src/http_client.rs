//! A small plain-HTTP/1 client for loopback calls (Envoy admin, the agent's
//! own endpoints from the `wait` and `drain` helpers).

use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("bad URL {0:?}")]
    Url(String),
    #[error("request to {url} failed: {source}")]
    Request {
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("reading the answer of {url} failed: {source}")]
    Body {
        url: String,
        #[source]
        source: hyper::Error,
    },
    #[error("{url} did not answer within {timeout:?}")]
    Timeout { url: String, timeout: Duration },
}

/// A response reduced to what callers look at.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

#[derive(Clone, Debug)]
pub struct HttpClient {
    client: Client<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
}

impl HttpClient {
    pub fn new(timeout: Duration) -> Self {
        Self::build(timeout, 2)
    }

    /// A client that opens a new connection for every request, so that each
    /// one reaches whoever listens on the port now (after an Envoy hot
    /// restart, a kept-alive connection still talks to the old epoch).
    pub fn without_keep_alive(timeout: Duration) -> Self {
        Self::build(timeout, 0)
    }

    fn build(timeout: Duration, max_idle: usize) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(max_idle)
            .build(connector);
        Self { client, timeout }
    }

    pub async fn get(&self, url: &str) -> Result<Response, HttpError> {
        self.request(hyper::Method::GET, url).await
    }

    pub async fn post(&self, url: &str) -> Result<Response, HttpError> {
        self.request(hyper::Method::POST, url).await
    }

    /// Like `post`, with its own timeout (for long-running calls such as a drain).
    pub async fn post_with_timeout(
        &self,
        url: &str,
        timeout: Duration,
    ) -> Result<Response, HttpError> {
        Self {
            client: self.client.clone(),
            timeout,
        }
        .request(hyper::Method::POST, url)
        .await
    }

    /// A POST with `Authorization: Bearer <token>`, with its own timeout.
    pub async fn post_authorized(
        &self,
        url: &str,
        token: &str,
        timeout: Duration,
    ) -> Result<Response, HttpError> {
        Self {
            client: self.client.clone(),
            timeout,
        }
        .send(hyper::Method::POST, url, Some(token))
        .await
    }

    pub async fn request(&self, method: hyper::Method, url: &str) -> Result<Response, HttpError> {
        self.send(method, url, None).await
    }

    async fn send(
        &self,
        method: hyper::Method,
        url: &str,
        bearer: Option<&str>,
    ) -> Result<Response, HttpError> {
        let uri: hyper::Uri = url.parse().map_err(|_| HttpError::Url(url.to_string()))?;
        let mut req = hyper::Request::builder().method(method).uri(uri);
        if let Some(token) = bearer {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let req = req
            .body(Empty::new())
            .map_err(|_| HttpError::Url(url.to_string()))?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|source| HttpError::Request {
                    url: url.to_string(),
                    source,
                })?;
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|source| HttpError::Body {
                    url: url.to_string(),
                    source,
                })?
                .to_bytes();
            Ok(Response {
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            })
        };
        tokio::time::timeout(self.timeout, fut)
            .await
            .map_err(|_| HttpError::Timeout {
                url: url.to_string(),
                timeout: self.timeout,
            })?
    }
}
