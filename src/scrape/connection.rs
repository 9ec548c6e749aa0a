//! One keep-alive HTTP/1.1 connection per pod, read and written inside the pod's poller
//! task.
//!
//! A shared client (reqwest, before) checks a connection out of its pool for every request
//! and hands the request to the connection's own task and the answer back: at 20,000
//! scrapes a second (1,000 pods every 50 ms) that plumbing and its task wake-ups cost a
//! fifth of kvroute's CPU. A poller asks its one pod one thing at a time, so it owns the
//! connection. It also asks only GETs of a pod that answers small pages, so it writes the
//! request itself and reads the answer into one buffer it keeps between scrapes, the body
//! decoded in place ([`super::http1`]): hyper's client (the version before this one) still
//! cost a channel per request between the caller and the connection, header maps and a
//! fresh body buffer each time. A connection that fails or times out is dropped and the
//! next request opens a new one.

use std::net::SocketAddr;
use std::ops::Range;
use std::time::Duration;

use hyper::Uri;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::ServerName;

use super::ApiKey;
use super::http1::{self, DechunkError, Dechunker, Framing};
use super::poller::ScrapeError;

/// A byte stream to a pod: plain TCP, or TLS over it.
pub(crate) trait PodStream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> PodStream for T {}

/// Opens a connection to the pod at `endpoint`, TLS over it with `tls`: the scrapes' and
/// the prompts' tokenization's ([`crate::tokenize`]). The caller's timeout bounds it.
pub(crate) async fn open(
    endpoint: SocketAddr,
    tls: Option<&TlsConnector>,
) -> std::io::Result<Box<dyn PodStream>> {
    let tcp = TcpStream::connect(endpoint).await?;
    // Requests are small and answered at once: no Nagle delay on them.
    let _ = tcp.set_nodelay(true);
    Ok(match tls {
        None => Box::new(tcp),
        Some(tls) => {
            // Pods are asked by IP: their certificates must name it.
            let name = ServerName::IpAddress(endpoint.ip().into());
            Box::new(tls.connect(name, tcp).await?)
        }
    })
}

/// The buffer a poller keeps between scrapes: a filtered vLLM page and its head fit.
const BUFFER: usize = 8 * 1024;
/// A buffer grown past this for one large answer is let go afterwards.
const MAX_KEPT_BUFFER: usize = 256 * 1024;
/// Free room each read asks for.
const READ_ROOM: usize = 4 * 1024;

/// The HTTP side of one pod's poller.
pub(super) struct PodClient {
    endpoint: SocketAddr,
    /// `Host:`, the pod's address.
    authority: String,
    /// HTTPS, trusting the `--pod-ca-bundle` CAs; `None`: plain HTTP.
    tls: Option<TlsConnector>,
    open: Option<Box<dyn PodStream>>,
    /// The request being sent, then the answer as read: head, then the body in place.
    request: Vec<u8>,
    buffer: Vec<u8>,
}

impl PodClient {
    pub(super) fn new(endpoint: SocketAddr, tls: Option<TlsConnector>) -> Self {
        PodClient {
            endpoint,
            authority: endpoint.to_string(),
            tls,
            open: None,
            request: Vec::new(),
            buffer: Vec::new(),
        }
    }

    /// GETs `path` (with its query) within `timeout`, reading at most `limit` bytes of
    /// body, and returns the body. A failure of any kind closes the connection. The path
    /// is parsed once by the caller, not at each of the fleet's thousands of scrapes a
    /// second.
    pub(super) async fn get(
        &mut self,
        path: &Uri,
        key: Option<&ApiKey>,
        limit: usize,
        timeout: Duration,
    ) -> Result<&[u8], ScrapeError> {
        if self.buffer.capacity() > MAX_KEPT_BUFFER {
            self.buffer = Vec::new();
        }
        let outcome = tokio::time::timeout(timeout, self.exchange(path, key, limit))
            .await
            .unwrap_or(Err(ScrapeError::Timeout(timeout)));
        match outcome {
            Ok(body) => Ok(&self.buffer[body]),
            Err(error) => {
                self.open = None;
                Err(error)
            }
        }
    }

    async fn exchange(
        &mut self,
        path: &Uri,
        key: Option<&ApiKey>,
        limit: usize,
    ) -> Result<Range<usize>, ScrapeError> {
        let kept = self.open.is_some();
        if !kept {
            self.open = Some(
                open(self.endpoint, self.tls.as_ref())
                    .await
                    .map_err(ScrapeError::Connect)?,
            );
        }
        self.write_request(path, key)?;
        match self.request(limit).await {
            // The pod closed a kept connection as the request went out (a keep-alive
            // timeout racing it) and answered nothing: a GET is safe to send again, once,
            // on a new connection.
            Err(ScrapeError::Closed) if kept && self.buffer.is_empty() => {
                self.open = Some(
                    open(self.endpoint, self.tls.as_ref())
                        .await
                        .map_err(ScrapeError::Connect)?,
                );
                self.request(limit).await
            }
            outcome => outcome,
        }
    }

    /// The GET's bytes, into `self.request`. A key that cannot be a header value (a
    /// line break would start a header of its own) is refused.
    fn write_request(&mut self, path: &Uri, key: Option<&ApiKey>) -> Result<(), ScrapeError> {
        let target = path.path_and_query().map_or("/", |p| p.as_str());
        let request = &mut self.request;
        request.clear();
        request.extend_from_slice(b"GET ");
        request.extend_from_slice(target.as_bytes());
        request.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        request.extend_from_slice(self.authority.as_bytes());
        request.extend_from_slice(b"\r\naccept: */*\r\n");
        if let Some(ApiKey(key)) = key {
            if key.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f) {
                return Err(ScrapeError::Request(
                    "the pod API key holds a control character".into(),
                ));
            }
            request.extend_from_slice(b"authorization: Bearer ");
            request.extend_from_slice(key.as_bytes());
            request.extend_from_slice(b"\r\n");
        }
        request.extend_from_slice(b"\r\n");
        Ok(())
    }

    /// Sends the request on the open connection and reads its answer; returns where the
    /// body lies in `self.buffer`. A connection the answer does not leave reusable is
    /// closed.
    async fn request(&mut self, limit: usize) -> Result<Range<usize>, ScrapeError> {
        self.buffer.clear();
        let Some(stream) = self.open.as_mut() else {
            return Err(ScrapeError::Closed);
        };
        stream.write_all(&self.request).await.map_err(closed)?;
        let buffer = &mut self.buffer;
        let head = loop {
            if let Some(head) = http1::parse_head(buffer).map_err(http)? {
                break head;
            }
            if read_more(stream, buffer, READ_ROOM).await? == 0 {
                return Err(ScrapeError::Closed);
            }
        };
        if !(200..300).contains(&head.status) {
            return Err(ScrapeError::Status(head.status));
        }
        let start = head.len;
        let (end, reusable) = match head.framing {
            Framing::Length(length) => {
                if length > limit {
                    return Err(ScrapeError::TooLarge(limit));
                }
                let end = start + length;
                while buffer.len() < end {
                    let room = (end - buffer.len()).max(READ_ROOM);
                    if read_more(stream, buffer, room).await? == 0 {
                        return Err(ScrapeError::Closed);
                    }
                }
                // Bytes past the answer: nothing was asked for them.
                (end, buffer.len() == end)
            }
            Framing::Chunked => {
                let mut chunks = Dechunker::new(start);
                loop {
                    match chunks.feed(buffer, limit) {
                        Ok(Some(end)) => break (end, chunks.consumed() == buffer.len()),
                        Ok(None) => {}
                        Err(DechunkError::TooLarge) => return Err(ScrapeError::TooLarge(limit)),
                        Err(DechunkError::Malformed) => {
                            return Err(ScrapeError::Http("malformed chunked body".into()));
                        }
                    }
                    if read_more(stream, buffer, READ_ROOM).await? == 0 {
                        return Err(ScrapeError::Closed);
                    }
                }
            }
            Framing::UntilClose => {
                // The close ends the body: a clean one, or a TLS peer's without
                // close_notify (which rustls reports as an unexpected end).
                loop {
                    match read_more(stream, buffer, READ_ROOM).await {
                        Ok(0) | Err(ScrapeError::Closed) => break,
                        Ok(_) if buffer.len() - start > limit => {
                            return Err(ScrapeError::TooLarge(limit));
                        }
                        Ok(_) => {}
                        Err(error) => return Err(error),
                    }
                }
                (buffer.len(), false)
            }
        };
        if !(reusable && head.keep_alive) {
            self.open = None;
        }
        Ok(start..end)
    }
}

/// Reads what has arrived into `buffer`'s free room (at least `room` bytes of it);
/// returns how much (0: the pod closed the connection).
async fn read_more(
    stream: &mut Box<dyn PodStream>,
    buffer: &mut Vec<u8>,
    room: usize,
) -> Result<usize, ScrapeError> {
    if buffer.capacity() == 0 {
        buffer.reserve(BUFFER.max(room));
    } else {
        buffer.reserve(room);
    }
    stream.read_buf(buffer).await.map_err(closed)
}

/// A failed read or write on the connection: the pod closed or reset it.
fn closed(error: std::io::Error) -> ScrapeError {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    match error.kind() {
        BrokenPipe | ConnectionAborted | ConnectionReset | UnexpectedEof => ScrapeError::Closed,
        _ => ScrapeError::Http(error.to_string()),
    }
}

fn http(error: http1::FramingError) -> ScrapeError {
    ScrapeError::Http(error.to_string())
}

#[cfg(test)]
mod tests;
