//! The Envoy ext_proc service (`envoy.service.ext_proc.v3.ExternalProcessor`): the
//! protocol only. Deciding where a request goes is behind the [`Router`] seam, so
//! tests drive this service with a stub as well as with the real picker.

mod exchange;
pub mod messages;
pub mod observe;
pub mod policy;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::StreamExt;
use futures::future::OptionFuture;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::debug;

use crate::flow::{DropReason, RequestClass};
use crate::shutdown::Phase;
use crate::telemetry;

pub use exchange::Exchange;
pub use kvroute_core::request::RouteRequest;
pub use policy::RequestPolicy;

/// A routed request: where it goes, and what it holds until its response ends.
#[derive(Debug)]
pub struct Routed<T> {
    /// The chosen endpoint first, then ordered fallbacks.
    pub endpoints: Vec<SocketAddr>,
    /// Released through [`InFlight::finish`] when the response (or the stream) ends.
    pub ticket: T,
    /// How long flow control held the request for room before routing it (reported to the
    /// client as `server-timing: kvroute-queue`); `None`: it was not held. A wait of
    /// another kind (a prompt being tokenized) is not counted.
    pub queued: Option<Duration>,
    /// The cached prompt tokens the router expects the chosen pod to find, sent on in the
    /// request's dynamic metadata and checked against the response ([`observe`]).
    pub prediction: Option<observe::PrefixPrediction>,
}

impl<T> Routed<T> {
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

/// Why a request was not routed, in the terms the protocol answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unrouted {
    pub kind: UnroutedKind,
    /// For the client, in the OpenAI error's `message`.
    pub message: String,
    /// Flow control's reason, when it dropped the request (sent in
    /// [`crate::flow::DROPPED_REASON_HEADER`]).
    pub dropped: Option<DropReason>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnroutedKind {
    /// No pod serves the requested model: 404.
    UnknownModel,
    /// Pods may serve it, but none is ready now: 503 with `retry-after`.
    Unavailable,
    /// Pods serve it, but none has room, and flow control refused to hold it longer (or
    /// at all): 429 with `retry-after`.
    Shed,
}

/// Where a request stands once the router has seen it.
#[derive(Debug)]
pub enum Placement<T> {
    Routed(Routed<T>),
    Unrouted(Unrouted),
    /// No pod has room: the request waits at the gateway until [`Waiting`] resolves.
    Waiting(Waiting<T>),
}

/// A request held at the gateway: resolves with its route, or its refusal, once flow
/// control decides. Dropping it (the client left, the stream ended) takes the request out
/// of the queue at once.
pub struct Waiting<T> {
    answer: oneshot::Receiver<Result<Routed<T>, Unrouted>>,
    /// Leaves the queue when dropped.
    _place: Box<dyn Send + Sync>,
    /// The longest the answer can take.
    pub max_wait: Duration,
}

impl<T> Waiting<T> {
    /// A wait resolved through `answer`; `place` takes the request out of the queue when
    /// dropped.
    pub fn new(
        answer: oneshot::Receiver<Result<Routed<T>, Unrouted>>,
        place: Box<dyn Send + Sync>,
        max_wait: Duration,
    ) -> Self {
        Waiting {
            answer,
            _place: place,
            max_wait,
        }
    }
}

impl<T> std::fmt::Debug for Waiting<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiting")
            .field("max_wait", &self.max_wait)
            .finish_non_exhaustive()
    }
}

impl<T> Future for Waiting<T> {
    type Output = Result<Routed<T>, Unrouted>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.answer).poll(cx).map(|answer| {
            // The waiting room went away without answering: kvroute is stopping.
            answer.unwrap_or_else(|_| {
                Err(Unrouted {
                    kind: UnroutedKind::Unavailable,
                    message: "the endpoint picker is shutting down; retry".into(),
                    dropped: Some(DropReason::ShuttingDown),
                })
            })
        })
    }
}

/// How a routed request's response went, as far as the processor saw it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResponseSummary {
    /// The response's HTTP status, if its headers passed the processor.
    pub status: Option<u16>,
    /// `completion_tokens` of the usage object, if the body passed the processor.
    pub completion_tokens: Option<u64>,
    /// `prompt_tokens_details.cached_tokens` of the usage object, if the body passed the
    /// processor and the pod reported it.
    pub cached_tokens: Option<u64>,
}

/// What a routed request holds while its response streams: in-flight accounting and
/// whatever the router wants to record when it ends.
pub trait InFlight: Send + 'static {
    /// The first response body bytes passed: the pod has finished the prompt's prefill.
    /// Called at most once.
    fn first_token(&mut self);
    /// `events` more server-sent events of the response passed (vLLM streams about one
    /// output token in each).
    fn streamed(&mut self, events: u64);
    /// The gateway reports the request was served by `endpoint` (it may differ from the
    /// pick when the gateway walked the fallbacks). Called at most once.
    fn served_by(&mut self, endpoint: std::net::SocketAddr);
    /// The gateway could not connect to the pod the request went to (its local reply
    /// carries the upstream-failure flag): the pod should leave rotation now.
    fn unreachable(&mut self);
    /// The response ended, or the stream did (the client went away).
    fn finish(self, response: ResponseSummary);
}

/// A request as the gateway sent it: which API, and its whole body (empty without one).
#[derive(Debug, Clone, Copy)]
pub struct RawRequest<'a> {
    pub api: kvroute_core::request::ApiKind,
    pub body: &'a [u8],
}

/// Chooses the destination of a request.
pub trait Router: Send + Sync + 'static {
    type Ticket: InFlight;

    /// Routes `request` of `class`, now or once a pod has room. `raw` is the request as
    /// it came (a router that needs more than the parsed form reads it there).
    /// `first_token_visible`: the gateway sends response bodies to kvroute, so
    /// [`InFlight::first_token`] will be called when the first one passes.
    fn route(
        &self,
        request: &RouteRequest<'_>,
        raw: RawRequest<'_>,
        class: &RequestClass,
        first_token_visible: bool,
    ) -> Placement<Self::Ticket>;

    /// The protocol layer refused a request to `path` before any routing (malformed or
    /// empty body, unknown path, too large, a timeout, overload, shutdown) and answered
    /// `reply`. A router that keeps a decision trace records it there.
    fn refused(&self, _path: &str, _reply: &messages::ErrorReply) {}
}

fn is_message_too_large(status: &Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
    ) && status.message().contains("too large")
}

/// An answer on its way to the gateway, boxed: the channel's storage holds 32 of them
/// per open stream, and a `ProcessingResponse` inline is hundreds of bytes.
type Answer = Box<Result<ProcessingResponse, Status>>;

/// The answers of one stream, as tonic sends them.
pub type AnswerStream =
    futures::stream::Map<ReceiverStream<Answer>, fn(Answer) -> Result<ProcessingResponse, Status>>;

fn unbox(answer: Answer) -> Result<ProcessingResponse, Status> {
    *answer
}

/// How many ext_proc streams are open: the drain ends early once none is.
#[derive(Debug, Clone)]
pub struct OpenStreams(Arc<watch::Sender<usize>>);

impl OpenStreams {
    fn new() -> OpenStreams {
        OpenStreams(Arc::new(watch::channel(0).0))
    }

    fn open(&self) -> StreamGuard {
        self.0.send_modify(|open| *open += 1);
        StreamGuard {
            streams: self.clone(),
            _gauge: telemetry::OpenStream::open(),
        }
    }

    /// Resolves when no stream is open (at once if none is now).
    pub async fn none_open(&self) {
        let mut open = self.0.subscribe();
        let _ = open.wait_for(|open| *open == 0).await;
    }
}

/// One open stream, counted until dropped.
struct StreamGuard {
    streams: OpenStreams,
    _gauge: telemetry::OpenStream,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.streams
            .0
            .send_modify(|open| *open = open.saturating_sub(1));
    }
}

/// A stream that has sent no message yet, counted in the service's silent streams until
/// dropped (at its first message, or its end).
struct SilentStream(Arc<AtomicUsize>);

impl SilentStream {
    /// Counts a new stream as silent, unless `limit` streams are already.
    fn enter(silent: &Arc<AtomicUsize>, limit: usize) -> Option<SilentStream> {
        silent
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| SilentStream(Arc::clone(silent)))
    }
}

impl Drop for SilentStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The gRPC service: one [`Exchange`] per stream.
pub struct ExtProcService<R: Router> {
    router: Arc<R>,
    policy: Arc<RequestPolicy>,
    /// Streams that have sent nothing yet ([`RequestPolicy::max_silent_streams`]).
    silent: Arc<AtomicUsize>,
    /// Fires when open streams must end (the drain deadline passed); held requests are
    /// answered 503 first.
    abort_streams: Phase,
    open_streams: OpenStreams,
}

impl<R: Router> ExtProcService<R> {
    pub fn new(router: Arc<R>, policy: RequestPolicy, abort_streams: Phase) -> Self {
        telemetry::register_silent_stream_refusals();
        ExtProcService {
            router,
            policy: Arc::new(policy),
            silent: Arc::new(AtomicUsize::new(0)),
            abort_streams,
            open_streams: OpenStreams::new(),
        }
    }

    /// The count of this service's open streams.
    pub fn open_streams(&self) -> OpenStreams {
        self.open_streams.clone()
    }

    /// The tonic server, with the message limit raised so a body of `max_body_bytes`
    /// (plus protobuf framing) is not refused by gRPC before kvroute can answer 413.
    pub fn into_server(self) -> ExternalProcessorServer<Self> {
        let limit = self.policy.max_body_bytes.saturating_add(64 * 1024);
        ExternalProcessorServer::new(self)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit)
    }
}

#[tonic::async_trait]
impl<R: Router> ExternalProcessor for ExtProcService<R> {
    type ProcessStream = AnswerStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // Refused before anything is allocated for it: streams that never speak, spread
        // over many connections, would otherwise each hold a task and a channel until the
        // read timeout.
        let Some(silent) = SilentStream::enter(&self.silent, self.policy.max_silent_streams) else {
            telemetry::record_silent_stream_refused();
            return Err(Status::resource_exhausted(
                "too many ext_proc streams have sent nothing yet",
            ));
        };
        let mut inbound = request.into_inner();
        let (answers, stream) = mpsc::channel::<Answer>(32);
        let mut exchange = Exchange::new(Arc::clone(&self.router), Arc::clone(&self.policy));
        let abort = self.abort_streams.clone();
        let open = self.open_streams.open();
        let read_by = tokio::time::Instant::now() + self.policy.read_timeout;
        tokio::spawn(async move {
            let _open = open;
            let mut silent = Some(silent);
            // One timer for the stream's life, not one per message.
            let read_deadline = tokio::time::sleep_until(read_by);
            tokio::pin!(read_deadline);
            // A request flow control holds: awaited beside the inbound stream, whose end
            // (the client left) drops it, and with it the request's place in the queue.
            let mut waiting: Option<Waiting<R::Ticket>> = None;
            'stream: loop {
                let message = tokio::select! {
                    outcome = OptionFuture::from(waiting.as_mut()), if waiting.is_some() => {
                        waiting = None;
                        if let Some(outcome) = outcome {
                            for answer in exchange.placed(outcome) {
                                if answers.send(Box::new(Ok(answer))).await.is_err() {
                                    break 'stream;
                                }
                            }
                        }
                        continue;
                    }
                    message = inbound.message() => message,
                    // A stream that never sends, or a request that never ends, does not
                    // hold its memory (and its body) for longer than the read timeout.
                    () = &mut read_deadline, if exchange.awaiting_request() => {
                        let answers_left = exchange.read_timed_out();
                        if answers_left.is_empty() {
                            let status = Status::deadline_exceeded("no request within the read timeout");
                            let _ = answers.send(Box::new(Err(status))).await;
                        }
                        for answer in answers_left {
                            let _ = answers.send(Box::new(Ok(answer))).await;
                        }
                        break;
                    }
                    () = abort.fired() => {
                        for answer in exchange.abort() {
                            let _ = answers.send(Box::new(Ok(answer))).await;
                        }
                        break;
                    }
                };
                match message {
                    Ok(Some(message)) if message.observability_mode => {
                        // A filter that only watches responses: it expects no answers.
                        drop(silent.take());
                        observe_stream(message, &mut inbound, &abort).await;
                        break;
                    }
                    Ok(Some(message)) => {
                        // It spoke: no longer counted as silent.
                        drop(silent.take());
                        for answer in exchange.handle(message) {
                            if answers.send(Box::new(Ok(answer))).await.is_err() {
                                break 'stream;
                            }
                        }
                        if waiting.is_none() {
                            waiting = exchange.take_waiting();
                        }
                    }
                    Ok(None) => break,
                    // A body chunk above the gRPC message limit: tonic refuses it from
                    // its length prefix, before buffering it. Answer 413 rather than
                    // ending the stream, which Envoy would take as "continue unrouted".
                    Err(status) if is_message_too_large(&status) => {
                        for answer in exchange.body_too_large() {
                            let _ = answers.send(Box::new(Ok(answer))).await;
                        }
                        break;
                    }
                    // A message that does not decode, or a stream broken below gRPC (an
                    // Envoy that cancels a finished stream ends it cleanly instead). The
                    // status goes back so the peer sees a failure, not an OK ending.
                    Err(status) => {
                        debug!(%status, "ext_proc stream failed");
                        let _ = answers.send(Box::new(Err(status))).await;
                        break;
                    }
                }
            }
            // Out of the queue before the request's accounting ends.
            drop(waiting);
            exchange.finish();
        });
        Ok(Response::new(ReceiverStream::new(stream).map(unbox)))
    }
}

/// Follows an observing stream (a filter in `observability_mode`): the response's cached
/// tokens against the picker's prediction ([`observe`]). Nothing is answered. The stream
/// ends as soon as the response body has: Envoy would otherwise hold it open for the
/// filter's `deferred_close_timeout` after the request (5 s by default), and those
/// streams would crowd the routing streams out of the connection's stream limit.
async fn observe_stream(
    first: ProcessingRequest,
    inbound: &mut Streaming<ProcessingRequest>,
    abort: &Phase,
) {
    let mut observer = observe::ResponseObserver::default();
    observer.handle(&first);
    loop {
        tokio::select! {
            message = inbound.message() => match message {
                Ok(Some(message)) => {
                    observer.handle(&message);
                    if observer.is_done() {
                        break;
                    }
                }
                Ok(None) | Err(_) => break,
            },
            () = abort.fired() => break,
        }
    }
    observer.finish();
}
