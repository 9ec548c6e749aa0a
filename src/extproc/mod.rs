//! The Envoy ext_proc service (`envoy.service.ext_proc.v3.ExternalProcessor`): the
//! protocol only. Deciding where a request goes is behind the [`Router`] seam, so
//! tests drive this service with a stub as well as with the real picker.

mod exchange;
pub mod messages;

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

pub use exchange::Exchange;

use crate::request::InferenceRequest;
use crate::scheduler::PickError;
use crate::state::Reservation;
use crate::telemetry::ModelLabels;

/// What the protocol layer asks the router.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The parsed body; `None` for requests without one (any ready pod will do).
    pub inference: Option<&'a InferenceRequest>,
    /// The gateway's subset hint.
    pub subset: Option<&'a [SocketAddr]>,
}

/// A routed request: where it goes and what it holds until it finishes.
#[derive(Debug)]
pub struct Routed {
    /// The chosen endpoint first, then ordered fallbacks.
    pub endpoints: Vec<SocketAddr>,
    /// Telemetry labels of the request.
    pub labels: ModelLabels,
    /// In-flight accounting, released when dropped.
    pub reservation: Option<Reservation>,
}

impl Routed {
    /// The value of the destination header and metadata: `IP:PORT[,IP:PORT...]`.
    pub fn destination(&self) -> String {
        let mut value = String::new();
        for (index, endpoint) in self.endpoints.iter().enumerate() {
            if index > 0 {
                value.push(',');
            }
            value.push_str(&endpoint.to_string());
        }
        value
    }
}

/// Why a request could not be routed, with its telemetry labels.
#[derive(Debug, Clone)]
pub struct RouteError {
    pub error: PickError,
    pub labels: ModelLabels,
}

/// Chooses the destination of a request.
pub trait Router: Send + Sync + 'static {
    fn route(&self, request: &RouteRequest<'_>) -> Result<Routed, RouteError>;
}

fn is_message_too_large(status: &Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
    ) && status.message().contains("too large")
}

/// The gRPC service: one [`Exchange`] per stream.
pub struct ExtProcService<R: Router> {
    router: Arc<R>,
    max_body_bytes: usize,
    /// Flips to true when open streams must end (the drain deadline passed).
    abort_streams: watch::Receiver<bool>,
}

impl<R: Router> ExtProcService<R> {
    pub fn new(
        router: Arc<R>,
        max_body_bytes: usize,
        abort_streams: watch::Receiver<bool>,
    ) -> Self {
        ExtProcService {
            router,
            max_body_bytes,
            abort_streams,
        }
    }

    /// The tonic server, with the message limit raised so a body of `max_body_bytes`
    /// (plus protobuf framing) is not refused by gRPC before kvroute can answer 413.
    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        let limit = self.max_body_bytes.saturating_add(64 * 1024);
        ExternalProcessorServer::new(self)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit)
    }
}

#[tonic::async_trait]
impl<R: Router> ExternalProcessor for ExtProcService<R> {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (answers, stream) = mpsc::channel(32);
        let mut exchange = Exchange::new(Arc::clone(&self.router), self.max_body_bytes);
        let mut abort = self.abort_streams.clone();
        tokio::spawn(async move {
            'stream: loop {
                let message = tokio::select! {
                    message = inbound.message() => message,
                    _ = abort.wait_for(|abort| *abort) => break,
                };
                match message {
                    Ok(Some(message)) => {
                        for answer in exchange.handle(message) {
                            if answers.send(Ok(answer)).await.is_err() {
                                break 'stream;
                            }
                        }
                    }
                    Ok(None) => break,
                    // A body chunk above the gRPC message limit: tonic refuses it from
                    // its length prefix, before buffering it. Answer 413 rather than
                    // ending the stream, which Envoy would take as "continue unrouted".
                    Err(status) if is_message_too_large(&status) => {
                        for answer in exchange.body_too_large() {
                            let _ = answers.send(Ok(answer)).await;
                        }
                        break;
                    }
                    // Envoy resets finished streams; that is the normal end, not an error.
                    Err(status) => {
                        debug!(%status, "ext_proc stream ended by the client");
                        break;
                    }
                }
            }
            exchange.finish();
        });
        Ok(Response::new(ReceiverStream::new(stream)))
    }
}
