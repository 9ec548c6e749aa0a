//! One ext_proc stream, i.e. one HTTP request through Envoy, as a synchronous state
//! machine: each message from Envoy goes in, the answers to send come out. Keeping it
//! free of async makes every protocol path unit-testable.
//!
//! Body modes, as Envoy announces in `protocol_config` on the first message:
//! - `FULL_DUPLEX_STREAMED`: Envoy streams the body without waiting for answers. We hold
//!   the answer to the request headers until the body has ended (a body chunk with
//!   `end_of_stream`, or the trailers), then answer the headers with the destination
//!   and stream the body back in chunks of at most 62,000 bytes. Response chunks are
//!   echoed back at once so streams (SSE) are never stalled.
//! - `BUFFERED` / `BUFFERED_PARTIAL`: the headers are answered at once; the destination
//!   goes in the answer to the body.
//! - `NONE` (or a request without a body): routed on the headers alone.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    processing_request::Request,
};
use envoy_types::pb::google::protobuf::value::Kind;

use super::messages::{
    self, DESTINATION_METADATA_NAMESPACE, ErrorReply, MAX_STREAMED_CHUNK, SERVED_HEADER,
    SUBSET_HINT_KEY, SUBSET_HINT_NAMESPACE, UPSTREAM_FAILURE_HEADER,
};
use super::policy::{RequestPolicy, needs_body};
use tracing::{debug, warn};

use kvroute_core::request::{
    ApiKind, EndpointSubset, InferenceRequest, RequestError, parse_request,
};

use super::observe::{self, PrefixPrediction, UsageScan};
use super::{
    InFlight, Placement, RawRequest, ResponseSummary, RouteRequest, Routed, Router, Unrouted,
    UnroutedKind, Waiting,
};
use crate::flow::{ClassError, DropReason, FAIRNESS_HEADERS, OBJECTIVE_HEADERS, RequestClass};
use crate::telemetry::{self, ModelLabels, Outcome};

/// How Envoy sends a body, from `protocol_config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyMode {
    None,
    /// BUFFERED, or BUFFERED_PARTIAL: the body in one message (all of it, or all Envoy
    /// would buffer).
    Buffered,
    FullDuplex,
    /// A mode a request cannot be routed in, by its wire name. In STREAMED mode Envoy has
    /// passed the headers on to its router before the body (and so the model) is known;
    /// GRPC and modes newer than this build are not modelled.
    Unroutable(&'static str),
}

impl BodyMode {
    fn from_wire(mode: i32) -> BodyMode {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::None) => BodyMode::None,
            Ok(BodySendMode::Buffered | BodySendMode::BufferedPartial) => BodyMode::Buffered,
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            Ok(other) => BodyMode::Unroutable(other.as_str_name()),
            Err(_) => BodyMode::Unroutable("unknown"),
        }
    }
}

/// Set once the unroutable-mode warning has been logged: it is a configuration error,
/// worth one line, not one per request.
static WARNED_UNROUTABLE_MODE: AtomicBool = AtomicBool::new(false);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the request headers.
    Start,
    /// Collecting the request body.
    ReadingBody,
    /// The request waits at the gateway for a pod with room (see [`Waiting`]).
    Waiting,
    /// The request has been routed and forwarded; response phases may follow.
    Forwarded,
    /// An error reply was sent; Envoy ends the request.
    Rejected,
}

/// State of one ext_proc stream.
pub struct Exchange<R: Router> {
    router: Arc<R>,
    policy: Arc<RequestPolicy>,
    request_mode: BodyMode,
    response_mode: BodyMode,
    path: String,
    subset: Option<EndpointSubset>,
    class: RequestClass,
    body: Vec<u8>,
    phase: Phase,
    /// How the routing answer goes out, once the request waiting for it is placed.
    answer_in: AnswerIn,
    /// The wait of a request held by flow control, until the stream takes it.
    waiting: Option<Waiting<R::Ticket>>,
    /// When flow control started holding the request, then how long it held it: told to
    /// the client in `server-timing` on the response.
    held_since: Option<Instant>,
    queued: Option<Duration>,
    /// What the routed request holds until its response ends.
    ticket: Option<R::Ticket>,
    /// The response's HTTP status, once its headers passed.
    status: Option<u16>,
    first_token_seen: bool,
    /// What the router expected the pod to find cached, checked against the response's
    /// usage when the response body passes kvroute ([`observe`](super::observe)).
    prediction: Option<PrefixPrediction>,
    served_by: Option<std::net::SocketAddr>,
    usage: UsageScan,
}

impl<R: Router> Exchange<R> {
    pub fn new(router: Arc<R>, policy: Arc<RequestPolicy>) -> Self {
        Exchange {
            router,
            policy,
            // Envoy always sends protocol_config first; buffered is the safe guess if not.
            request_mode: BodyMode::Buffered,
            response_mode: BodyMode::None,
            path: String::new(),
            subset: None,
            class: RequestClass::default(),
            body: Vec::new(),
            phase: Phase::Start,
            answer_in: AnswerIn::Headers,
            waiting: None,
            held_since: None,
            queued: None,
            ticket: None,
            status: None,
            first_token_seen: false,
            prediction: None,
            served_by: None,
            usage: UsageScan::default(),
        }
    }

    /// Handles one message from Envoy; returns the answers to send, in order.
    pub fn handle(&mut self, message: ProcessingRequest) -> Vec<ProcessingResponse> {
        if let Some(config) = message.protocol_config {
            self.apply_protocol_config(config);
        }
        match message.request {
            Some(Request::RequestHeaders(headers)) => {
                self.on_request_headers(headers, message.metadata_context)
            }
            Some(Request::RequestBody(body)) => self.on_request_body(body),
            Some(Request::RequestTrailers(_)) => self.on_request_trailers(),
            Some(Request::ResponseHeaders(headers)) => {
                self.on_response_headers(&headers, message.metadata_context.as_ref())
            }
            Some(Request::ResponseBody(body)) => self.on_response_body(body),
            Some(Request::ResponseTrailers(_)) => {
                self.complete();
                vec![messages::continue_response_trailers()]
            }
            None => Vec::new(),
        }
    }

    /// The stream ended (normally after the response, or early when the client went
    /// away): releases the request's in-flight accounting if the response phases did
    /// not already.
    pub fn finish(&mut self) {
        self.complete();
    }

    /// The drain deadline passed and the stream is about to end. Envoy reads a stream that
    /// ends cleanly as "continue without the processor", so a request still waiting for
    /// its route is answered 503 (with `retry-after`) here instead of passing unrouted; a
    /// routed request keeps its pod, and its response passes on unprocessed.
    pub fn abort(&mut self) -> Vec<ProcessingResponse> {
        match self.phase {
            Phase::Start | Phase::ReadingBody => {
                self.drop_body();
                vec![self.refuse(shutting_down(None), Outcome::NoCapacity)]
            }
            Phase::Waiting => {
                self.waiting = None;
                self.drop_body();
                let reply = shutting_down(Some(DropReason::ShuttingDown));
                vec![self.refuse(reply, Outcome::NoCapacity)]
            }
            Phase::Forwarded | Phase::Rejected => Vec::new(),
        }
    }

    /// Whether the request is still being read (nothing has answered it yet).
    pub fn awaiting_request(&self) -> bool {
        matches!(self.phase, Phase::Start | Phase::ReadingBody)
    }

    /// The request took longer to arrive than the read timeout allows. A request whose
    /// headers came is answered 408; for a stream that sent nothing there is no request
    /// to answer (empty: the caller ends the stream with an error status).
    pub fn read_timed_out(&mut self) -> Vec<ProcessingResponse> {
        match self.phase {
            Phase::ReadingBody => {
                self.drop_body();
                vec![self.refuse(read_timeout(), Outcome::BadRequest)]
            }
            Phase::Start | Phase::Waiting | Phase::Forwarded | Phase::Rejected => Vec::new(),
        }
    }

    /// The wait of a request flow control holds, for the stream to await; then
    /// [`Exchange::placed`] answers with its outcome.
    pub fn take_waiting(&mut self) -> Option<Waiting<R::Ticket>> {
        self.waiting.take()
    }

    /// The held request's wait resolved: answers with its route or its refusal.
    pub fn placed(
        &mut self,
        outcome: Result<Routed<R::Ticket>, Unrouted>,
    ) -> Vec<ProcessingResponse> {
        if self.phase != Phase::Waiting {
            // Answered meanwhile (the drain aborted it): a late route is dropped here,
            // which releases what it reserved.
            return Vec::new();
        }
        self.queued = match &outcome {
            Ok(routed) => routed.queued,
            Err(_) => self.held_since.map(|since| since.elapsed()),
        };
        match outcome {
            Ok(routed) => self.forward(routed),
            Err(unrouted) => {
                self.drop_body();
                vec![self.reject(no_route(unrouted))]
            }
        }
    }

    /// Lets go of the body read so far and gives its bytes back to the budget.
    fn drop_body(&mut self) {
        self.policy.held_body_budget.give_back(self.body.len());
        self.body = Vec::new();
    }

    /// A body chunk was refused by the gRPC layer for its size: answers 413 unless the
    /// request was already answered.
    pub fn body_too_large(&mut self) -> Vec<ProcessingResponse> {
        match self.phase {
            Phase::Rejected | Phase::Waiting | Phase::Forwarded => Vec::new(),
            Phase::Start | Phase::ReadingBody => {
                self.drop_body();
                vec![self.refuse(too_large(self.policy.max_body_bytes), Outcome::TooLarge)]
            }
        }
    }

    fn apply_protocol_config(&mut self, config: ProtocolConfiguration) {
        self.request_mode = BodyMode::from_wire(config.request_body_mode);
        self.response_mode = BodyMode::from_wire(config.response_body_mode);
    }

    fn on_request_headers(
        &mut self,
        headers: HttpHeaders,
        metadata: Option<Metadata>,
    ) -> Vec<ProcessingResponse> {
        if let BodyMode::Unroutable(mode) = self.request_mode {
            if !WARNED_UNROUTABLE_MODE.swap(true, Ordering::Relaxed) {
                warn!(
                    request_body_mode = mode,
                    "the gateway's ext_proc filter sends request bodies in a mode kvroute cannot \
                     route in; every request gets 500 until it uses FULL_DUPLEX_STREAMED, \
                     BUFFERED or NONE (see envoy/)"
                );
            }
            return vec![self.refuse(unroutable_mode(mode), Outcome::Misconfigured)];
        }
        if let Some(map) = &headers.headers {
            self.path = header_value(map, ":path").unwrap_or_default();
        }
        // Before anything else reads the request: a path outside the inference API never
        // reaches a pod, and an inference request without a body is the client's error,
        // not a model-less request any pod may take.
        if !self.policy.allows(&self.path) {
            return vec![self.refuse(unknown_path(&self.path), Outcome::NotFound)];
        }
        if headers.end_of_stream && needs_body(&self.path) {
            return vec![self.refuse(bad_request(&RequestError::EmptyBody), Outcome::BadRequest)];
        }
        self.subset = metadata.as_ref().and_then(subset_hint);
        let (objective, fairness_id) = headers.headers.as_ref().map_or((None, None), |map| {
            (
                first_header(map, &OBJECTIVE_HEADERS),
                first_header(map, &FAIRNESS_HEADERS),
            )
        });
        match self
            .policy
            .flow
            .classify(objective.as_deref(), fairness_id.as_deref())
        {
            Ok(class) => self.class = class,
            Err(error) => return vec![self.refuse(bad_class(&error), Outcome::BadRequest)],
        }
        if headers.end_of_stream || self.request_mode == BodyMode::None {
            // Nothing to read (GET /v1/models, or a filter that sends no body): any
            // ready pod can answer.
            return self.route(None, AnswerIn::Headers);
        }
        self.phase = Phase::ReadingBody;
        match self.request_mode {
            BodyMode::FullDuplex => Vec::new(),
            _ => vec![messages::continue_request_headers()],
        }
    }

    fn on_request_body(&mut self, body: HttpBody) -> Vec<ProcessingResponse> {
        if self.phase != Phase::ReadingBody {
            // After a rejection Envoy may still deliver chunks already in flight.
            return match (self.phase, self.request_mode) {
                (Phase::Rejected | Phase::Waiting, _) | (_, BodyMode::FullDuplex) => Vec::new(),
                _ => vec![messages::continue_request_body()],
            };
        }
        if self.body.len().saturating_add(body.body.len()) > self.policy.max_body_bytes {
            self.drop_body();
            return vec![self.refuse(too_large(self.policy.max_body_bytes), Outcome::TooLarge)];
        }
        if !self.policy.held_body_budget.try_take(body.body.len()) {
            self.drop_body();
            return vec![self.refuse(overloaded(), Outcome::NoCapacity)];
        }
        self.body.extend_from_slice(&body.body);
        let ended = body.end_of_stream || body.end_of_stream_without_message;
        match self.request_mode {
            BodyMode::FullDuplex if ended => self.route_full_duplex(false),
            BodyMode::FullDuplex => Vec::new(),
            // BUFFERED_PARTIAL sends what fits in Envoy's buffer without the end of the
            // stream: not a whole request to parse.
            BodyMode::Buffered if !ended => {
                self.drop_body();
                vec![self.refuse(partial_body(), Outcome::TooLarge)]
            }
            // Buffered modes deliver the whole body at once; once routed, Envoy holds
            // it, not kvroute (the router reads it while routing, for one).
            _ => {
                let parsed = self.parse_body();
                let answers = self.route_parsed(parsed, AnswerIn::Body);
                self.drop_body();
                answers
            }
        }
    }

    fn on_request_trailers(&mut self) -> Vec<ProcessingResponse> {
        match (self.phase, self.request_mode) {
            // Trailers end the body in full duplex: route, stream the body back, then
            // answer the trailers.
            (Phase::ReadingBody, BodyMode::FullDuplex) => self.route_full_duplex(true),
            (Phase::Rejected | Phase::Waiting, _) => Vec::new(),
            _ => vec![messages::continue_request_trailers()],
        }
    }

    fn on_response_headers(
        &mut self,
        headers: &HttpHeaders,
        metadata: Option<&Metadata>,
    ) -> Vec<ProcessingResponse> {
        let map = headers.headers.as_ref();
        self.status = map
            .and_then(|map| header_value(map, ":status"))
            .and_then(|status| status.parse().ok());
        // Which pod served: the gateway's metadata, else the header the shipped fail-open
        // gateway adds (its retries walk the fallbacks, so it may not be the pick).
        let served_header = map.and_then(|map| header_value(map, SERVED_HEADER));
        let served = metadata
            .and_then(served_metadata)
            .or_else(|| served_header.clone());
        if let Some(endpoint) = served {
            match endpoint.trim().parse() {
                Ok(endpoint) => {
                    self.served_by = Some(endpoint);
                    if let Some(ticket) = self.ticket.as_mut() {
                        ticket.served_by(endpoint);
                    }
                }
                Err(_) => debug!(%endpoint, "unreadable served endpoint"),
            }
        }
        // The gateway's own error reply for a pod it could not connect to: passive
        // health, so the next requests go elsewhere before any scrape fails.
        let failure = map.and_then(|map| header_value(map, UPSTREAM_FAILURE_HEADER));
        if let (Some(ticket), Some(flags)) = (self.ticket.as_mut(), &failure)
            && flags.split(',').any(|flag| flag.trim() == "UF")
        {
            ticket.unreachable();
        }
        if headers.end_of_stream {
            self.complete();
        }
        // Both headers are between the gateway and kvroute, not for the client.
        let mut strip = Vec::new();
        if served_header.is_some() {
            strip.push(SERVED_HEADER);
        }
        if failure.is_some() {
            strip.push(UPSTREAM_FAILURE_HEADER);
        }
        // How long the request waited at the gateway, in the header browsers and tools read
        // for server-side time (W3C Server Timing): the client's TTFT includes it.
        let timing = self
            .queued
            .map(|queued| format!("{QUEUE_TIMING};dur={:.1}", queued.as_secs_f64() * 1e3));
        let answer = match (&timing, strip.is_empty()) {
            (None, true) => messages::continue_response_headers(),
            (timing, _) => messages::continue_response_headers_editing(
                timing
                    .as_deref()
                    .map(|value| ("server-timing", value))
                    .as_slice(),
                &strip,
            ),
        };
        vec![answer]
    }

    fn on_response_body(&mut self, body: HttpBody) -> Vec<ProcessingResponse> {
        // vLLM streams nothing before the first token (the chat role chunk goes out with
        // it), so the first body bytes mean the pod has finished this prompt's prefill.
        // Only the first non-empty chunk counts: the ticket is told once.
        if !body.body.is_empty()
            && !self.first_token_seen
            && let Some(ticket) = self.ticket.as_mut()
        {
            ticket.first_token();
            self.first_token_seen = true;
        }
        if let Some(ticket) = self.ticket.as_mut() {
            let events = count_events(&body.body);
            if events > 0 {
                ticket.streamed(events);
            }
        }
        let ended = body.end_of_stream || body.end_of_stream_without_message;
        self.usage.feed(&body.body, ended);
        let answer = match self.response_mode {
            BodyMode::FullDuplex => messages::streamed_response_body(body.body, body.end_of_stream),
            _ => messages::continue_response_body(),
        };
        if ended {
            self.complete();
        }
        vec![answer]
    }

    /// Full duplex: the body has ended (by its last chunk, or by trailers); routes it.
    fn route_full_duplex(&mut self, ended_by_trailers: bool) -> Vec<ProcessingResponse> {
        let parsed = self.parse_body();
        self.route_parsed(
            parsed,
            AnswerIn::Streamed {
                trailers: ended_by_trailers,
            },
        )
    }

    /// Sends a routed request on: the routing answer, and in full duplex the body streamed
    /// back (then the trailers' answer, if they ended it).
    fn forward(&mut self, routed: Routed<R::Ticket>) -> Vec<ProcessingResponse> {
        let destination = routed.destination();
        self.ticket = Some(routed.ticket);
        self.phase = Phase::Forwarded;
        // Only the completion APIs report cached prompt tokens in their usage: a model
        // listing or an embedding would only ever read as "unreported".
        self.prediction = routed.prediction.filter(|_| {
            matches!(
                ApiKind::from_path(&self.path),
                ApiKind::Completions | ApiKind::ChatCompletions
            )
        });
        let prediction = self.prediction.as_ref();
        let trailers = match self.answer_in {
            AnswerIn::Headers => return vec![messages::route_in_headers(&destination, prediction)],
            AnswerIn::Body => return vec![messages::route_in_body(&destination, prediction)],
            AnswerIn::Streamed { trailers } => trailers,
        };
        let body = std::mem::take(&mut self.body);
        self.policy.held_body_budget.give_back(body.len());
        let mut answers = Vec::with_capacity(3 + body.len() / MAX_STREAMED_CHUNK);
        answers.push(messages::route_in_headers(&destination, prediction));
        if body.is_empty() {
            answers.push(messages::streamed_request_body(Vec::new(), !trailers));
        }
        let chunks = body.len().div_ceil(MAX_STREAMED_CHUNK);
        for (index, chunk) in body.chunks(MAX_STREAMED_CHUNK).enumerate() {
            let last = index + 1 == chunks;
            answers.push(messages::streamed_request_body(
                chunk.to_vec(),
                last && !trailers,
            ));
        }
        if trailers {
            answers.push(messages::continue_request_trailers());
        }
        answers
    }

    /// Parses the collected body. For the OpenAI inference APIs a body that does not
    /// parse is the client's error; for other paths it is routed without a model.
    fn parse_body(&self) -> Result<Option<InferenceRequest>, RequestError> {
        let api = ApiKind::from_path(&self.path);
        if self.body.is_empty() && needs_body(&self.path) {
            return Err(RequestError::EmptyBody);
        }
        match parse_request(api, &self.body) {
            Ok(request) => Ok(Some(request)),
            Err(_) if matches!(api, ApiKind::Other) => Ok(None),
            Err(error) => Err(error),
        }
    }

    fn route_parsed(
        &mut self,
        parsed: Result<Option<InferenceRequest>, RequestError>,
        answer_in: AnswerIn,
    ) -> Vec<ProcessingResponse> {
        match parsed {
            Ok(request) => self.route(request.as_ref(), answer_in),
            Err(error) => {
                self.drop_body();
                vec![self.refuse(bad_request(&error), Outcome::BadRequest)]
            }
        }
    }

    fn route(
        &mut self,
        request: Option<&InferenceRequest>,
        answer_in: AnswerIn,
    ) -> Vec<ProcessingResponse> {
        let route_request = RouteRequest {
            inference: request,
            subset: self.subset.as_ref(),
        };
        self.answer_in = answer_in;
        // The router records routed and unrouted requests itself: it knows their models.
        // Only a streamed response body shows its first token as it leaves the pod; a
        // buffered one arrives whole, at the end.
        let first_token_visible = self.response_mode == BodyMode::FullDuplex;
        let raw = RawRequest {
            api: ApiKind::from_path(&self.path),
            body: &self.body,
        };
        match self
            .router
            .route(&route_request, raw, &self.class, first_token_visible)
        {
            Placement::Routed(routed) => self.forward(routed),
            Placement::Unrouted(unrouted) => {
                self.drop_body();
                vec![self.reject(no_route(unrouted))]
            }
            Placement::Waiting(waiting) => {
                self.phase = Phase::Waiting;
                self.held_since = Some(Instant::now());
                let max_wait = waiting.max_wait;
                self.waiting = Some(waiting);
                match answer_in {
                    // Full duplex runs no message timer; the others would fail the
                    // request over after `message_timeout` without this.
                    AnswerIn::Streamed { .. } => Vec::new(),
                    AnswerIn::Headers | AnswerIn::Body => {
                        vec![messages::extend_message_timeout(max_wait + ANSWER_MARGIN)]
                    }
                }
            }
        }
    }

    /// Refuses a request the protocol layer itself finds wrong (before any routing), and
    /// records it.
    fn refuse(&mut self, reply: ErrorReply, outcome: Outcome) -> ProcessingResponse {
        telemetry::record_request(&ModelLabels::other(), outcome);
        self.router.refused(&self.path, &reply);
        self.reject(reply)
    }

    fn reject(&mut self, reply: ErrorReply) -> ProcessingResponse {
        self.phase = Phase::Rejected;
        reply.into_response()
    }

    /// Ends the routed request's ticket, once: its in-flight accounting is released. When
    /// the response body passed kvroute, the prediction is checked against its usage.
    fn complete(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            ticket.finish(ResponseSummary {
                status: self.status,
                completion_tokens: self.usage.completion_tokens,
                cached_tokens: self.usage.cached_tokens,
            });
            if self.response_mode != BodyMode::None
                && let Some(prediction) = self.prediction.take()
            {
                observe::check(&prediction, &self.usage, self.served_by);
            }
        }
    }
}

impl<R: Router> Drop for Exchange<R> {
    fn drop(&mut self) {
        self.policy.held_body_budget.give_back(self.body.len());
    }
}

/// Which answer carries the destination: the one to the request headers (Envoy has not
/// picked a host yet), or the one to the buffered body.
#[derive(Debug, Clone, Copy)]
enum AnswerIn {
    /// A request without a body: the headers' answer.
    Headers,
    /// The buffered body's answer.
    Body,
    /// Full duplex: the headers' answer, then the body streamed back, then (`trailers`:
    /// they ended the body) the trailers' answer.
    Streamed { trailers: bool },
}

/// The `server-timing` metric that says how long flow control held a request.
pub const QUEUE_TIMING: &str = "kvroute-queue";

/// How much longer than flow control's own bound the gateway is asked to wait for the
/// answer to a held request: flow control answers at its bound, and the answer must reach
/// Envoy before Envoy gives up on it.
const ANSWER_MARGIN: Duration = Duration::from_secs(1);

/// The value of the first of `names` present.
fn first_header(map: &HeaderMap, names: &[&str]) -> Option<String> {
    names.iter().find_map(|name| header_value(map, name))
}

pub(super) fn header_value(map: &HeaderMap, name: &str) -> Option<String> {
    map.headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| {
            // Envoy sends `raw_value`; older versions used `value`.
            if h.raw_value.is_empty() {
                h.value.clone()
            } else {
                String::from_utf8_lossy(&h.raw_value).into_owned()
            }
        })
}

/// The gateway's subset hint, when it sent one (see [`EndpointSubset`] for what its
/// entries admit). The protocol sends a list of strings; a single string is read as a
/// comma-separated list.
fn subset_hint(metadata: &Metadata) -> Option<EndpointSubset> {
    let hint = metadata.filter_metadata.get(SUBSET_HINT_NAMESPACE)?;
    let value = hint.fields.get(SUBSET_HINT_KEY)?;
    let subset = match &value.kind {
        Some(Kind::ListValue(list)) => {
            EndpointSubset::parse(list.values.iter().filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.as_str()),
                _ => None,
            }))
        }
        Some(Kind::StringValue(s)) => EndpointSubset::parse(s.split(',')),
        _ => EndpointSubset::default(),
    };
    Some(subset)
}

/// The served endpoint in the gateway's `envoy.lb` metadata, if set.
fn served_metadata(metadata: &Metadata) -> Option<String> {
    let lb = metadata
        .filter_metadata
        .get(DESTINATION_METADATA_NAMESPACE)?;
    match &lb.fields.get(SERVED_HEADER)?.kind {
        Some(Kind::StringValue(endpoint)) => Some(endpoint.clone()),
        _ => None,
    }
}

/// Server-sent events that start in `chunk` (`data:` at the start of a line; an event
/// split across chunks at exactly that prefix is missed, which only delays the count).
fn count_events(chunk: &[u8]) -> u64 {
    const FIELD: &[u8] = b"data:";
    let starts = chunk
        .windows(FIELD.len())
        .enumerate()
        .filter(|(at, window)| *window == FIELD && (*at == 0 || chunk[at - 1] == b'\n'))
        .count();
    starts as u64
}

fn bad_request(error: &RequestError) -> ErrorReply {
    ErrorReply {
        status: 400,
        error_type: error.openai_type(),
        code: error.code(),
        message: error.to_string(),
        retry_after: None,
        dropped: None,
    }
}

fn unknown_path(path: &str) -> ErrorReply {
    // The path is the client's own input: echo a bounded, printable part of it.
    let shown: String = path
        .chars()
        .take(200)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    ErrorReply {
        status: 404,
        error_type: "invalid_request_error",
        code: "unknown_path",
        message: format!(
            "`{shown}` is not served by this gateway; it serves the inference API \
             (POST /v1/completions, POST /v1/chat/completions, GET /v1/models, ...)"
        ),
        retry_after: None,
        dropped: None,
    }
}

fn unroutable_mode(mode: &str) -> ErrorReply {
    ErrorReply {
        status: 500,
        error_type: "server_error",
        code: "unsupported_body_mode",
        message: format!(
            "the gateway sends request bodies to kvroute in {mode} mode, in which a request \
             cannot be routed; configure FULL_DUPLEX_STREAMED, BUFFERED or NONE"
        ),
        retry_after: None,
        dropped: None,
    }
}

fn shutting_down(dropped: Option<DropReason>) -> ErrorReply {
    ErrorReply {
        status: 503,
        error_type: "service_unavailable",
        code: "shutting_down",
        message: "the endpoint picker is shutting down; retry".into(),
        retry_after: Some(1),
        dropped,
    }
}

fn bad_class(error: &ClassError) -> ErrorReply {
    ErrorReply {
        status: 400,
        error_type: "invalid_request_error",
        code: "invalid_fairness_id",
        message: error.to_string(),
        retry_after: None,
        dropped: None,
    }
}

fn overloaded() -> ErrorReply {
    ErrorReply {
        status: 503,
        error_type: "service_unavailable",
        code: "overloaded",
        message: "the endpoint picker holds as many request bodies as it may; retry".into(),
        retry_after: Some(1),
        dropped: None,
    }
}

fn read_timeout() -> ErrorReply {
    ErrorReply {
        status: 408,
        error_type: "invalid_request_error",
        code: "request_timeout",
        message: "the request body did not arrive in time".into(),
        retry_after: None,
        dropped: None,
    }
}

fn partial_body() -> ErrorReply {
    ErrorReply {
        status: 413,
        error_type: "invalid_request_error",
        code: "request_too_large",
        message: "request body exceeds what the gateway buffers for routing".into(),
        retry_after: None,
        dropped: None,
    }
}

fn too_large(limit: usize) -> ErrorReply {
    ErrorReply {
        status: 413,
        error_type: "invalid_request_error",
        code: "request_too_large",
        message: format!("request body exceeds the limit of {limit} bytes"),
        retry_after: None,
        dropped: None,
    }
}

fn no_route(unrouted: Unrouted) -> ErrorReply {
    let dropped = unrouted.dropped;
    match unrouted.kind {
        UnroutedKind::UnknownModel => ErrorReply {
            status: 404,
            error_type: "invalid_request_error",
            code: "model_not_found",
            message: unrouted.message,
            retry_after: None,
            dropped,
        },
        UnroutedKind::Unavailable => ErrorReply {
            status: 503,
            error_type: "service_unavailable",
            code: if dropped == Some(DropReason::ShuttingDown) {
                "shutting_down"
            } else {
                "no_ready_endpoint"
            },
            message: unrouted.message,
            retry_after: Some(1),
            dropped,
        },
        // OpenAI's clients read 429 as "slow down and retry".
        UnroutedKind::Shed => ErrorReply {
            status: 429,
            error_type: "rate_limit_error",
            code: if dropped == Some(DropReason::TtlExpired) {
                "queue_wait_exceeded"
            } else {
                "overloaded"
            },
            message: unrouted.message,
            retry_after: Some(1),
            dropped,
        },
    }
}

#[cfg(test)]
mod tests;
