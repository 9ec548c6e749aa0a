//! One keep-alive HTTP/1.1 connection per pod, polled inside the pod's poller task.
//!
//! A shared client (reqwest, before) checks a connection out of its pool for every request
//! and hands the request to the connection's own task and the answer back: at 20,000
//! scrapes a second (1,000 pods every 50 ms) that plumbing and its task wake-ups cost a
//! fifth of kvroute's CPU. A poller asks its one pod one thing at a time, so it owns the
//! connection and drives it in place; a connection that fails or times out is dropped and
//! the next request opens a new one.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{AUTHORIZATION, HOST, HeaderValue};
use hyper::{Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::ServerName;

use super::ApiKey;
use super::poller::ScrapeError;

/// A byte stream to a pod: plain TCP, or TLS over it.
trait PodStream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> PodStream for T {}

/// The connection's protocol state machine, polled while a request is out.
type Driver = Pin<Box<dyn Future<Output = hyper::Result<()>> + Send>>;

struct Open {
    sender: SendRequest<Empty<Bytes>>,
    /// `None` once the connection has ended (what it delivered can still be read).
    driver: Option<Driver>,
}

impl Open {
    /// Whether a kept connection can take a request: the pod may have closed it while it
    /// sat idle (its keep-alive timeout), which shows once the connection reads the close.
    fn usable(&mut self) -> bool {
        !self.sender.is_closed()
            && self
                .driver
                .as_mut()
                .is_some_and(|driver| driver.as_mut().now_or_never().is_none())
    }
}

/// The HTTP side of one pod's poller.
pub(super) struct PodClient {
    endpoint: SocketAddr,
    /// `Host:`, the pod's address.
    authority: HeaderValue,
    /// HTTPS, trusting the `--pod-ca-bundle` CAs; `None`: plain HTTP.
    tls: Option<TlsConnector>,
    open: Option<Open>,
}

impl PodClient {
    pub(super) fn new(endpoint: SocketAddr, tls: Option<TlsConnector>) -> Self {
        PodClient {
            endpoint,
            authority: HeaderValue::from_str(&endpoint.to_string())
                .unwrap_or_else(|_| HeaderValue::from_static("localhost")),
            tls,
            open: None,
        }
    }

    /// GETs `path` (with its query) within `timeout`, reading at most `limit` bytes of
    /// body. A failure of any kind closes the connection. The path is parsed once by the
    /// caller, not at each of the fleet's thousands of scrapes a second.
    pub(super) async fn get(
        &mut self,
        path: &Uri,
        key: Option<&ApiKey>,
        limit: usize,
        timeout: Duration,
    ) -> Result<Vec<u8>, ScrapeError> {
        let outcome = tokio::time::timeout(timeout, self.exchange(path, key, limit))
            .await
            .unwrap_or(Err(ScrapeError::Timeout(timeout)));
        if outcome.is_err() {
            self.open = None;
        }
        outcome
    }

    async fn exchange(
        &mut self,
        path: &Uri,
        key: Option<&ApiKey>,
        limit: usize,
    ) -> Result<Vec<u8>, ScrapeError> {
        let kept = self.open.as_mut().is_some_and(Open::usable);
        if !kept {
            self.open = Some(Self::connect(self.endpoint, self.tls.clone()).await?);
        }
        match self.request(path, key, limit).await {
            // The pod closed a kept connection as the request went out (a keep-alive
            // timeout racing it): a GET is safe to send again, once, on a new one.
            Err(ScrapeError::Closed | ScrapeError::Http(_)) if kept => {
                self.open = Some(Self::connect(self.endpoint, self.tls.clone()).await?);
                self.request(path, key, limit).await
            }
            outcome => outcome,
        }
    }

    /// One GET on the open connection.
    async fn request(
        &mut self,
        path: &Uri,
        key: Option<&ApiKey>,
        limit: usize,
    ) -> Result<Vec<u8>, ScrapeError> {
        let Some(Open { sender, driver }) = self.open.as_mut() else {
            return Err(ScrapeError::Closed);
        };
        let mut request = Request::get(path.clone()).header(HOST, self.authority.clone());
        if let Some(ApiKey(key)) = key {
            request = request.header(AUTHORIZATION, format!("Bearer {key}"));
        }
        let request = request
            .body(Empty::new())
            .map_err(|e| ScrapeError::Request(e.to_string()))?;
        drive(driver, sender.ready()).await??;
        let mut response = drive(driver, sender.send_request(request)).await??;
        if !response.status().is_success() {
            return Err(ScrapeError::Status(response.status().as_u16()));
        }
        let mut body = Vec::new();
        while let Some(frame) = drive(driver, response.body_mut().frame()).await? {
            if let Ok(data) = frame?.into_data() {
                if body.len() + data.len() > limit {
                    return Err(ScrapeError::TooLarge(limit));
                }
                body.extend_from_slice(&data);
            }
        }
        Ok(body)
    }

    /// Opens a connection to the pod (TLS over it with `tls`); [`PodClient::get`]'s
    /// timeout bounds it with the request.
    async fn connect(endpoint: SocketAddr, tls: Option<TlsConnector>) -> Result<Open, ScrapeError> {
        let tcp = TcpStream::connect(endpoint)
            .await
            .map_err(ScrapeError::Connect)?;
        // Requests are small and answered at once: no Nagle delay on them.
        let _ = tcp.set_nodelay(true);
        let stream: Box<dyn PodStream> = match &tls {
            None => Box::new(tcp),
            Some(tls) => {
                // Pods are scraped by IP: their certificates must name it.
                let name = ServerName::IpAddress(endpoint.ip().into());
                Box::new(tls.connect(name, tcp).await.map_err(ScrapeError::Connect)?)
            }
        };
        let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
        Ok(Open {
            sender,
            driver: Some(Box::pin(connection)),
        })
    }
}

/// Awaits `work` while polling the connection it needs. When the connection ends, `work`
/// gets one more look (the connection's last act may have been to deliver what it waits
/// for), then it is an error; the ended connection is dropped, so what it delivered can
/// still be read to the end.
async fn drive<F: Future>(driver: &mut Option<Driver>, work: F) -> Result<F::Output, ScrapeError> {
    let mut work = std::pin::pin!(work);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(output) = work.as_mut().poll(cx) {
            return Poll::Ready(Ok(output));
        }
        let Some(connection) = driver.as_mut() else {
            return Poll::Pending;
        };
        let Poll::Ready(ended) = connection.as_mut().poll(cx) else {
            return Poll::Pending;
        };
        *driver = None;
        if let Poll::Ready(output) = work.as_mut().poll(cx) {
            return Poll::Ready(Ok(output));
        }
        Poll::Ready(Err(match ended {
            Ok(()) => ScrapeError::Closed,
            Err(error) => ScrapeError::Http(error),
        }))
    })
    .await
}

#[cfg(test)]
mod tests;
