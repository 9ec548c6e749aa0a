//! Accepting connections under a cap. Every listener of kvroute holds at most a set number
//! of connections open; past it a new connection is closed as soon as it is accepted (and
//! counted), so no number of idle connections from anywhere can exhaust kvroute's memory
//! or file descriptors. Streams within a connection are bounded separately (HTTP/2
//! `max_concurrent_streams`, the read timeout).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::warn;

use crate::telemetry;

/// How many connections one listener holds open at most.
#[derive(Debug, Clone)]
pub struct ConnectionCap {
    /// The listener, in logs and the refusal counter's `listener` label.
    what: &'static str,
    permits: Arc<Semaphore>,
    /// When the last refusal was logged: a flood is logged once a second, not per
    /// connection.
    last_warning: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl ConnectionCap {
    pub fn new(what: &'static str, max_connections: usize) -> ConnectionCap {
        telemetry::register_connection_refusals(what);
        ConnectionCap {
            what,
            permits: Arc::new(Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS))),
            last_warning: Arc::default(),
        }
    }

    /// The listener, as logs name it.
    pub fn name(&self) -> &'static str {
        self.what
    }

    /// `stream` with its place under the cap, or `None` (the stream is closed) when the
    /// listener is full.
    fn admit(&self, stream: TcpStream) -> Option<CappedStream> {
        match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(permit) => Some(CappedStream {
                stream,
                _permit: permit,
            }),
            Err(_) => {
                telemetry::record_connection_refused(self.what);
                let mut last = self
                    .last_warning
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                    *last = Some(Instant::now());
                    let peer = stream.peer_addr().ok();
                    warn!(
                        listener = self.what,
                        ?peer,
                        "connection limit reached: closing new connections (--max-connections)"
                    );
                }
                None
            }
        }
    }

    /// The gRPC server's accepted connections, capped.
    pub fn incoming<S>(self, incoming: S) -> impl Stream<Item = io::Result<CappedStream>>
    where
        S: Stream<Item = io::Result<TcpStream>>,
    {
        incoming.filter_map(move |accepted| {
            let admitted = match accepted {
                Ok(stream) => self.admit(stream).map(Ok),
                Err(error) => Some(Err(error)),
            };
            std::future::ready(admitted)
        })
    }

    /// An HTTP listener (axum) whose connections are capped.
    pub fn listener(self, listener: TcpListener) -> CappedListener {
        CappedListener {
            listener,
            cap: self,
        }
    }
}

/// An accepted connection holding its place under its listener's cap until dropped.
#[derive(Debug)]
pub struct CappedStream {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
}

impl AsyncRead for CappedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for CappedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl Connected for CappedStream {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

/// A TCP listener for axum whose connections are capped.
pub struct CappedListener {
    listener: TcpListener,
    cap: ConnectionCap,
}

impl axum::serve::Listener for CappedListener {
    type Io = CappedStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (CappedStream, SocketAddr) {
        loop {
            let (stream, peer) = axum::serve::Listener::accept(&mut self.listener).await;
            if let Some(admitted) = self.cap.admit(stream) {
                return (admitted, peer);
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}
