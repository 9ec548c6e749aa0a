use std::sync::Mutex;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpTrailers, ProcessingResponse, body_mutation, processing_response::Response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};

use tokio::sync::oneshot;

use super::*;
use crate::extproc::Routed;
use crate::extproc::messages::DESTINATION_HEADER;

const POD_A: &str = "10.0.0.1:8000";
const POD_B: &str = "10.0.0.2:8000";

/// What the stub router was asked: the model and the subset hint.
type Asked = (Option<String>, Option<EndpointSubset>);

/// What happened to the tickets the stub router handed out.
#[derive(Debug, Default)]
struct TicketLog {
    open: usize,
    first_tokens: usize,
    finished: Vec<ResponseSummary>,
    served: Vec<std::net::SocketAddr>,
    streamed: u64,
    unreachable: usize,
}

/// Where the stub router's held requests get their outcome.
type HeldAnswer = oneshot::Sender<Result<Routed<StubTicket>, Unrouted>>;

/// Routes everything to POD_A (fallback POD_B) and remembers what it was asked.
#[derive(Default)]
struct StubRouter {
    seen: Mutex<Vec<Asked>>,
    /// `first_token_visible` of each route call.
    first_token_visible: Mutex<Vec<bool>>,
    fail_with: Option<UnroutedKind>,
    /// Hold every request: its answer goes into `held`, for the test to give.
    hold: bool,
    held: Mutex<Vec<HeldAnswer>>,
    /// The class of each route call.
    classes: Mutex<Vec<RequestClass>>,
    /// What each route predicts the pod caches.
    prediction: Option<PrefixPrediction>,
    tickets: Arc<Mutex<TicketLog>>,
}

impl StubRouter {
    fn tickets(&self) -> std::sync::MutexGuard<'_, TicketLog> {
        self.tickets.lock().expect("lock")
    }

    /// A route to POD_A, fallback POD_B, with an open ticket.
    fn routed(&self) -> Routed<StubTicket> {
        self.tickets().open += 1;
        Routed {
            endpoints: vec![POD_A.parse().expect("addr"), POD_B.parse().expect("addr")],
            ticket: StubTicket(Arc::clone(&self.tickets)),
            queued: None,
            prediction: self.prediction,
        }
    }
}

struct StubTicket(Arc<Mutex<TicketLog>>);

impl InFlight for StubTicket {
    fn first_token(&mut self) {
        self.0.lock().expect("lock").first_tokens += 1;
    }

    fn served_by(&mut self, endpoint: std::net::SocketAddr) {
        self.0.lock().expect("lock").served.push(endpoint);
    }

    fn streamed(&mut self, events: u64) {
        self.0.lock().expect("lock").streamed += events;
    }

    fn unreachable(&mut self) {
        self.0.lock().expect("lock").unreachable += 1;
    }

    fn finish(self, response: ResponseSummary) {
        let mut log = self.0.lock().expect("lock");
        log.open -= 1;
        log.finished.push(response);
    }
}

impl Router for StubRouter {
    type Ticket = StubTicket;

    fn route(
        &self,
        request: &RouteRequest<'_>,
        _raw: RawRequest<'_>,
        class: &RequestClass,
        first_token_visible: bool,
    ) -> Placement<StubTicket> {
        self.classes.lock().expect("lock").push(class.clone());
        self.first_token_visible
            .lock()
            .expect("lock")
            .push(first_token_visible);
        self.seen.lock().expect("lock").push((
            request.inference.map(|r| r.model.clone()),
            request.subset.cloned(),
        ));
        if let Some(kind) = self.fail_with {
            return Placement::Unrouted(Unrouted {
                kind,
                message: "stubbed".into(),
                dropped: None,
            });
        }
        if self.hold {
            let (answer, answered) = oneshot::channel();
            self.held.lock().expect("lock").push(answer);
            return Placement::Waiting(Waiting::new(
                answered,
                Box::new(()),
                Duration::from_secs(5),
            ));
        }
        Placement::Routed(self.routed())
    }
}

fn policy(max_body_bytes: usize) -> Arc<RequestPolicy> {
    Arc::new(RequestPolicy::with_default_paths(max_body_bytes))
}

fn exchange(router: &Arc<StubRouter>, mode: BodySendMode) -> Exchange<StubRouter> {
    exchange_under(router, mode, policy(1 << 20))
}

/// An exchange in `mode` both ways, taking requests under `policy`.
fn exchange_under(
    router: &Arc<StubRouter>,
    mode: BodySendMode,
    policy: Arc<RequestPolicy>,
) -> Exchange<StubRouter> {
    let mut exchange = Exchange::new(Arc::clone(router), policy);
    exchange.apply_protocol_config(ProtocolConfiguration {
        request_body_mode: mode as i32,
        response_body_mode: mode as i32,
        ..ProtocolConfiguration::default()
    });
    exchange
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: (*k).to_owned(),
                        raw_value: v.as_bytes().to_vec(),
                        ..HeaderValue::default()
                    })
                    .collect(),
            }),
            end_of_stream,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn post(path: &str) -> ProcessingRequest {
    headers(&[(":method", "POST"), (":path", path)], false)
}

fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn response_body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::ResponseBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

const COMPLETION: &[u8] = br#"{"model":"llama","prompt":"hello there","max_tokens":8}"#;

/// The destination header an answer sets, and whether it clears the route cache.
fn destination_of(answer: &ProcessingResponse) -> Option<(String, bool)> {
    let common = match answer.response.as_ref()? {
        Response::RequestHeaders(h) => h.response.as_ref()?,
        Response::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    let mutation = common.header_mutation.as_ref()?;
    let header = mutation.set_headers.first()?.header.as_ref()?;
    assert_eq!(header.key, DESTINATION_HEADER);
    assert!(header.value.is_empty(), "Envoy reads raw_value");
    Some((
        String::from_utf8(header.raw_value.clone()).ok()?,
        common.clear_route_cache,
    ))
}

fn metadata_destination(answer: &ProcessingResponse) -> Option<String> {
    let outer = answer.dynamic_metadata.as_ref()?;
    let Some(Kind::StructValue(inner)) = &outer.fields.get("envoy.lb")?.kind else {
        return None;
    };
    match &inner.fields.get(DESTINATION_HEADER)?.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

fn streamed_chunk(answer: &ProcessingResponse) -> Option<(Vec<u8>, bool)> {
    let common = match answer.response.as_ref()? {
        Response::RequestBody(b) | Response::ResponseBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    match common.body_mutation.as_ref()?.mutation.as_ref()? {
        body_mutation::Mutation::StreamedResponse(s) => Some((s.body.clone(), s.end_of_stream)),
        _ => None,
    }
}

fn immediate_status(answer: &ProcessingResponse) -> Option<(i32, serde_json::Value)> {
    match answer.response.as_ref()? {
        Response::ImmediateResponse(r) => Some((
            r.status.as_ref()?.code,
            serde_json::from_slice(&r.body).ok()?,
        )),
        _ => None,
    }
}

#[test]
fn full_duplex_holds_the_headers_answer_until_the_body_ends() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::FullDuplexStreamed);
    assert!(ex.handle(post("/v1/completions")).is_empty());
    assert!(ex.handle(body(&COMPLETION[..10], false)).is_empty());
    let answers = ex.handle(body(&COMPLETION[10..], true));
    let expected = format!("{POD_A},{POD_B}");
    assert_eq!(destination_of(&answers[0]), Some((expected.clone(), true)));
    assert!(matches!(
        answers[0].response,
        Some(Response::RequestHeaders(_))
    ));
    assert_eq!(metadata_destination(&answers[0]), Some(expected));
    let echoed: Vec<u8> = answers[1..]
        .iter()
        .flat_map(|a| streamed_chunk(a).expect("chunk").0)
        .collect();
    assert_eq!(echoed, COMPLETION);
    assert_eq!(
        streamed_chunk(answers.last().expect("some")).map(|c| c.1),
        Some(true)
    );
    assert_eq!(
        router.seen.lock().expect("lock")[0].0.as_deref(),
        Some("llama")
    );
}

#[test]
fn full_duplex_streams_a_large_body_back_in_chunks_of_at_most_62000_bytes() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::FullDuplexStreamed);
    let prompt = "x".repeat(200_000);
    let large = format!(r#"{{"model":"llama","prompt":"{prompt}"}}"#);
    ex.handle(post("/v1/completions"));
    let mut answers = Vec::new();
    for piece in large.as_bytes().chunks(16_384) {
        answers.extend(ex.handle(body(piece, false)));
    }
    answers.extend(ex.handle(body(b"", true)));
    let chunks: Vec<(Vec<u8>, bool)> = answers[1..].iter().filter_map(streamed_chunk).collect();
    assert_eq!(chunks.len(), large.len().div_ceil(62_000));
    assert!(chunks.iter().all(|(c, _)| c.len() <= 62_000));
    let ends: Vec<bool> = chunks.iter().map(|c| c.1).collect();
    assert_eq!(ends.iter().filter(|e| **e).count(), 1);
    assert_eq!(ends.last(), Some(&true));
    let joined: Vec<u8> = chunks.into_iter().flat_map(|c| c.0).collect();
    assert_eq!(joined, large.as_bytes());
}

#[test]
fn full_duplex_trailers_end_the_body_and_are_answered_last() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::FullDuplexStreamed);
    ex.handle(post("/v1/completions"));
    assert!(ex.handle(body(COMPLETION, false)).is_empty());
    let answers = ex.handle(ProcessingRequest {
        request: Some(Request::RequestTrailers(HttpTrailers::default())),
        ..ProcessingRequest::default()
    });
    assert!(destination_of(&answers[0]).is_some());
    assert_eq!(
        streamed_chunk(&answers[1]),
        Some((COMPLETION.to_vec(), false))
    );
    assert!(matches!(
        answers.last().and_then(|a| a.response.as_ref()),
        Some(Response::RequestTrailers(_))
    ));
}

#[test]
fn buffered_mode_answers_headers_at_once_and_routes_in_the_body_answer() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::Buffered);
    let first = ex.handle(post("/v1/chat/completions"));
    assert_eq!(first.len(), 1);
    assert!(destination_of(&first[0]).is_none());
    let chat = br#"{"model":"llama","messages":[{"role":"user","content":"hi"}]}"#;
    let answers = ex.handle(body(chat, true));
    assert_eq!(answers.len(), 1);
    assert!(matches!(
        answers[0].response,
        Some(Response::RequestBody(_))
    ));
    assert!(destination_of(&answers[0]).is_some());
    assert!(metadata_destination(&answers[0]).is_some());
}

#[test]
fn a_request_without_a_body_is_routed_in_the_headers_answer() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::FullDuplexStreamed);
    let answers = ex.handle(headers(
        &[(":method", "GET"), (":path", "/v1/models")],
        true,
    ));
    assert_eq!(answers.len(), 1);
    assert!(destination_of(&answers[0]).is_some());
    assert_eq!(router.seen.lock().expect("lock")[0].0, None);
}

#[test]
fn a_path_outside_the_inference_api_is_answered_404_and_never_routed() {
    for mode in [BodySendMode::FullDuplexStreamed, BodySendMode::Buffered] {
        let router = Arc::new(StubRouter::default());
        for (method, path, ends) in [
            ("POST", "/v1/load_lora_adapter", false),
            ("POST", "/v1/unload_lora_adapter", false),
            ("GET", "/metrics", true),
            ("POST", "/v1/completions/../load_lora_adapter", false),
        ] {
            let mut ex = exchange(&router, mode);
            let answers = ex.handle(headers(&[(":method", method), (":path", path)], ends));
            assert_eq!(answers.len(), 1, "{path}");
            let (status, error) = immediate_status(&answers[0]).expect("immediate answer");
            assert_eq!(status, 404, "{path}");
            assert_eq!(error["error"]["code"], "unknown_path", "{path}");
            // Whatever body chunks Envoy had in flight get no answer.
            assert!(ex.handle(body(br#"{"lora_name":"x"}"#, true)).is_empty());
        }
        assert!(router.seen.lock().expect("lock").is_empty());
    }
}

#[test]
fn an_inference_request_without_a_body_is_answered_400() {
    let router = Arc::new(StubRouter::default());
    for (path, mode) in [
        ("/v1/completions", BodySendMode::FullDuplexStreamed),
        ("/v1/chat/completions", BodySendMode::Buffered),
        ("/v1/embeddings", BodySendMode::FullDuplexStreamed),
    ] {
        // No body at all: the headers end the request.
        let mut ex = exchange(&router, mode);
        let answers = ex.handle(headers(&[(":method", "POST"), (":path", path)], true));
        let (status, error) = immediate_status(&answers[0]).expect("immediate answer");
        assert_eq!(
            (status, &error["error"]["code"]),
            (400, &"empty_body".into()),
            "{path}"
        );
        // A body that ends empty (chunked, no data).
        let mut ex = exchange(&router, mode);
        ex.handle(post(path));
        let answers = ex.handle(body(b"", true));
        assert_eq!(answers.len(), 1, "{path}");
        let (status, error) = immediate_status(&answers[0]).expect("immediate answer");
        assert_eq!(
            (status, &error["error"]["code"]),
            (400, &"empty_body".into()),
            "{path}"
        );
    }
    assert!(router.seen.lock().expect("lock").is_empty());
}

#[test]
fn a_body_over_the_limit_is_answered_413_without_keeping_it() {
    let router = Arc::new(StubRouter::default());
    let mut ex = Exchange::new(Arc::clone(&router), policy(1_000));
    ex.apply_protocol_config(ProtocolConfiguration {
        request_body_mode: BodySendMode::FullDuplexStreamed as i32,
        ..ProtocolConfiguration::default()
    });
    ex.handle(post("/v1/completions"));
    assert!(ex.handle(body(&[b'a'; 600], false)).is_empty());
    let answers = ex.handle(body(&[b'a'; 600], false));
    let (status, json) = immediate_status(&answers[0]).expect("immediate response");
    assert_eq!(status, 413);
    assert_eq!(json["error"]["code"], "request_too_large");
    assert!(ex.body.capacity() == 0, "the partial body is dropped");
    assert!(
        ex.handle(body(&[b'a'; 600], true)).is_empty(),
        "later chunks are ignored"
    );
    assert!(router.seen.lock().expect("lock").is_empty());
}

#[test]
fn malformed_json_is_answered_400_with_an_openai_error() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::Buffered);
    ex.handle(post("/v1/completions"));
    let answers = ex.handle(body(br#"{"model": "llama", "prompt": "#, true));
    let (status, json) = immediate_status(&answers[0]).expect("immediate response");
    assert_eq!(status, 400);
    assert_eq!(json["error"]["type"], "invalid_request_error");
    assert!(
        json["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
}

#[test]
fn an_unknown_model_is_answered_404_and_no_capacity_503_with_retry_after() {
    for (kind, status) in [
        (UnroutedKind::UnknownModel, 404),
        (UnroutedKind::Unavailable, 503),
    ] {
        let router = Arc::new(StubRouter {
            fail_with: Some(kind),
            ..StubRouter::default()
        });
        let mut ex = exchange(&router, BodySendMode::Buffered);
        ex.handle(post("/v1/completions"));
        let answers = ex.handle(body(COMPLETION, true));
        assert_eq!(immediate_status(&answers[0]).map(|s| s.0), Some(status));
        let Some(Response::ImmediateResponse(reply)) = &answers[0].response else {
            panic!("immediate response expected");
        };
        let has_retry_after = reply.headers.as_ref().is_some_and(|h| {
            h.set_headers
                .iter()
                .any(|o| o.header.as_ref().is_some_and(|h| h.key == "retry-after"))
        });
        assert_eq!(has_retry_after, status == 503);
    }
}

#[test]
fn modes_a_request_cannot_be_routed_in_are_refused_at_the_headers_with_a_500() {
    for mode in [BodySendMode::Streamed, BodySendMode::Grpc] {
        let router = Arc::new(StubRouter::default());
        let mut ex = exchange(&router, mode);
        let answers = ex.handle(post("/v1/completions"));
        let (status, json) = immediate_status(&answers[0]).expect("immediate response");
        assert_eq!(status, 500, "{mode:?}");
        assert_eq!(json["error"]["code"], "unsupported_body_mode");
        assert!(
            json["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(mode.as_str_name())),
            "{json}"
        );
        assert!(
            ex.handle(body(COMPLETION, true)).is_empty(),
            "nothing after"
        );
        assert!(router.seen.lock().expect("lock").is_empty(), "never routed");
    }
}

#[test]
fn a_partial_buffered_body_is_answered_413_instead_of_parsed_as_whole() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::BufferedPartial);
    ex.handle(post("/v1/completions"));
    let answers = ex.handle(body(&COMPLETION[..20], false));
    let (status, json) = immediate_status(&answers[0]).expect("immediate response");
    assert_eq!(status, 413);
    assert_eq!(json["error"]["code"], "request_too_large");
    assert!(router.seen.lock().expect("lock").is_empty());
}

#[test]
fn the_router_learns_whether_the_first_token_will_be_seen() {
    for (response_mode, visible) in [
        (BodySendMode::FullDuplexStreamed, true),
        (BodySendMode::None, false),
        (BodySendMode::Buffered, false),
    ] {
        let router = Arc::new(StubRouter::default());
        let mut ex = Exchange::new(Arc::clone(&router), policy(1 << 20));
        ex.apply_protocol_config(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            response_body_mode: response_mode as i32,
            ..ProtocolConfiguration::default()
        });
        ex.handle(post("/v1/completions"));
        ex.handle(body(COMPLETION, true));
        assert_eq!(
            *router.first_token_visible.lock().expect("lock"),
            vec![visible],
            "response body mode {response_mode:?}"
        );
    }
}

#[test]
fn the_subset_hint_is_passed_to_the_router() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::Buffered);
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: vec![Value {
                kind: Some(Kind::StringValue(POD_B.into())),
            }],
        })),
    };
    let mut hint = Struct::default();
    hint.fields.insert(SUBSET_HINT_KEY.into(), list);
    let mut message = post("/v1/completions");
    let mut metadata = Metadata::default();
    metadata
        .filter_metadata
        .insert(SUBSET_HINT_NAMESPACE.into(), hint);
    message.metadata_context = Some(metadata);
    ex.handle(message);
    ex.handle(body(COMPLETION, true));
    let seen = router.seen.lock().expect("lock");
    assert_eq!(seen[0].1, Some(EndpointSubset::parse([POD_B])));
}

#[test]
fn response_chunks_are_echoed_at_once_in_full_duplex_and_the_end_releases_the_request() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::FullDuplexStreamed);
    ex.handle(post("/v1/completions"));
    ex.handle(body(COMPLETION, true));
    assert_eq!(router.tickets().open, 1);
    ex.handle(headers(&[(":status", "200")], false));
    assert_eq!(router.tickets().first_tokens, 0, "no token yet");
    let sse = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
    let answers = ex.handle(response_body(sse, false));
    assert_eq!(streamed_chunk(&answers[0]), Some((sse.to_vec(), false)));
    assert_eq!(router.tickets().open, 1, "still streaming");
    assert_eq!(
        router.tickets().first_tokens,
        1,
        "the first token ends the prefill"
    );
    ex.handle(response_body(sse, false));
    assert_eq!(router.tickets().first_tokens, 1, "told once");
    let last =
        b"data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":17}}\n\ndata: [DONE]\n\n";
    let answers = ex.handle(response_body(last, true));
    assert_eq!(streamed_chunk(&answers[0]), Some((last.to_vec(), true)));
    let log = router.tickets();
    assert_eq!(log.open, 0);
    assert_eq!(log.finished.len(), 1);
    assert_eq!(log.finished[0].completion_tokens, Some(17));
}

#[test]
fn the_prediction_goes_out_in_the_routing_metadata_and_the_response_usage_is_read_across_chunks() {
    let prediction = PrefixPrediction {
        cached_tokens: 2992,
        source: "kv_events",
        pod: POD_A.parse().expect("addr"),
        block_tokens: 16,
    };
    let router = Arc::new(StubRouter {
        prediction: Some(prediction),
        ..StubRouter::default()
    });
    for mode in [BodySendMode::Buffered, BodySendMode::FullDuplexStreamed] {
        let mut ex = exchange(&router, mode);
        let mut answers = ex.handle(post("/v1/completions"));
        answers.extend(ex.handle(body(COMPLETION, true)));
        let metadata = answers
            .iter()
            .find_map(|a| a.dynamic_metadata.clone())
            .expect("the routing answer's metadata");
        let Some(Kind::StructValue(fields)) = metadata
            .fields
            .get(observe::PREDICTION_NAMESPACE)
            .and_then(|v| v.kind.clone())
        else {
            panic!("{mode:?}: no prediction in {metadata:?}")
        };
        let mut forwarded = Metadata::default();
        forwarded
            .filter_metadata
            .insert(observe::PREDICTION_NAMESPACE.into(), fields);
        assert_eq!(
            PrefixPrediction::from_metadata(&forwarded),
            Some(prediction),
            "{mode:?}"
        );
        ex.handle(headers(&[(":status", "200")], false));
        let usage = br#"data: {"choices":[],"usage":{"prompt_tokens":3200,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":2992}}}"#;
        let (first, rest) = usage.split_at(usage.len() - 9);
        ex.handle(response_body(first, false));
        ex.handle(response_body(rest, true));
    }
    // An API whose answers carry no cached tokens gets no prediction to check.
    let mut ex = exchange(&router, BodySendMode::Buffered);
    ex.handle(post("/v1/embeddings"));
    let answers = ex.handle(body(br#"{"model":"llama","input":"hello"}"#, true));
    let metadata = answers[0]
        .dynamic_metadata
        .as_ref()
        .expect("the route's metadata");
    assert!(
        !metadata.fields.contains_key(observe::PREDICTION_NAMESPACE),
        "{metadata:?}"
    );
    ex.finish();
    let log = router.tickets();
    // Buffered both ways: the (whole) body passed kvroute too.
    for summary in &log.finished[..2] {
        assert_eq!(summary.cached_tokens, Some(2992));
        assert_eq!(summary.completion_tokens, Some(8));
    }
    assert_eq!(log.finished.len(), 3);
}

#[test]
fn when_response_phases_are_not_sent_the_end_of_the_stream_releases_the_request() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::Buffered);
    ex.handle(post("/v1/completions"));
    ex.handle(body(COMPLETION, true));
    assert_eq!(router.tickets().open, 1);
    ex.finish();
    assert_eq!(router.tickets().open, 0);
    ex.finish();
    assert_eq!(router.tickets().finished.len(), 1, "finished once");
}

#[test]
fn other_allowed_paths_with_a_non_json_body_are_routed_without_a_model() {
    let router = Arc::new(StubRouter::default());
    let paths = ["/v1/audio/transcriptions".to_owned()];
    let mut ex = Exchange::new(
        Arc::clone(&router),
        Arc::new(RequestPolicy::new(1 << 20, &paths)),
    );
    ex.handle(post("/v1/audio/transcriptions"));
    let answers = ex.handle(body(b"\x00\x01binary", true));
    assert!(destination_of(&answers[0]).is_some());
    assert_eq!(router.seen.lock().expect("lock")[0].0, None);
}

fn response_headers(pairs: &[(&str, &str)], metadata: Option<Metadata>) -> ProcessingRequest {
    let mut message = headers(pairs, false);
    if let Some(Request::RequestHeaders(h)) = message.request.take() {
        message.request = Some(Request::ResponseHeaders(h));
    }
    message.metadata_context = metadata;
    message
}

/// The headers an answer to the response headers removes.
fn removed_headers(answer: &ProcessingResponse) -> Vec<String> {
    let Some(Response::ResponseHeaders(headers)) = &answer.response else {
        panic!("headers answer: {answer:?}");
    };
    headers
        .response
        .as_ref()
        .and_then(|r| r.header_mutation.as_ref())
        .expect("mutation")
        .remove_headers
        .clone()
}

#[test]
fn the_served_endpoint_moves_the_request_and_its_header_is_stripped() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::Buffered);
    ex.handle(post("/v1/completions"));
    ex.handle(body(COMPLETION, true));
    let answers = ex.handle(response_headers(
        &[(":status", "200"), (SERVED_HEADER, POD_B)],
        None,
    ));
    assert_eq!(router.tickets().served, vec![POD_B.parse().expect("addr")]);
    assert_eq!(removed_headers(&answers[0]), vec![SERVED_HEADER.to_owned()]);

    // The protocol's metadata form, without the header: nothing to strip.
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::Buffered);
    ex.handle(post("/v1/completions"));
    ex.handle(body(COMPLETION, true));
    let mut lb = Struct::default();
    lb.fields.insert(
        SERVED_HEADER.into(),
        Value {
            kind: Some(Kind::StringValue(POD_B.into())),
        },
    );
    let mut metadata = Metadata::default();
    metadata
        .filter_metadata
        .insert(DESTINATION_METADATA_NAMESPACE.into(), lb);
    let answers = ex.handle(response_headers(&[(":status", "200")], Some(metadata)));
    assert_eq!(router.tickets().served, vec![POD_B.parse().expect("addr")]);
    assert_eq!(answers, vec![messages::continue_response_headers()]);
}

#[test]
fn streamed_events_are_counted_as_they_pass() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::FullDuplexStreamed);
    ex.handle(post("/v1/completions"));
    ex.handle(body(COMPLETION, true));
    ex.handle(response_body(
        b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
        false,
    ));
    ex.handle(response_body(
        b"data: {\"choices\":[{\"text\":\"b data: c\"}]}\n\ndata: {\"choices\":[]}\n\n",
        false,
    ));
    assert_eq!(
        router.tickets().streamed,
        3,
        "a `data:` inside a text is not an event"
    );
    assert_eq!(router.tickets().first_tokens, 1);
}

#[test]
fn a_gateway_reply_for_a_pod_it_could_not_reach_takes_the_pod_out() {
    for (flags, unreachable) in [
        ("UF", 1),
        ("UF,URX", 1),
        ("URX, UF", 1),
        ("UC", 0),
        ("-", 0),
    ] {
        let router = Arc::new(StubRouter::default());
        let mut ex = exchange(&router, BodySendMode::Buffered);
        ex.handle(post("/v1/completions"));
        ex.handle(body(COMPLETION, true));
        let answers = ex.handle(response_headers(
            &[(":status", "503"), (UPSTREAM_FAILURE_HEADER, flags)],
            None,
        ));
        assert_eq!(router.tickets().unreachable, unreachable, "flags {flags}");
        assert_eq!(
            removed_headers(&answers[0]),
            vec![UPSTREAM_FAILURE_HEADER.to_owned()],
            "the flags are not the client's"
        );
    }
    // A pod's own 503 says nothing about reaching it.
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::Buffered);
    ex.handle(post("/v1/completions"));
    ex.handle(body(COMPLETION, true));
    ex.handle(response_headers(&[(":status", "503")], None));
    assert_eq!(router.tickets().unreachable, 0);
}

#[test]
fn bodies_held_across_streams_stay_within_the_budget_and_are_given_back() {
    let router = Arc::new(StubRouter::default());
    let policy = Arc::new(RequestPolicy::with_default_paths(1 << 20).with_held_body_budget(200));
    // A stream holding 100 bytes of an unfinished body...
    let mut first = exchange_under(
        &router,
        BodySendMode::FullDuplexStreamed,
        Arc::clone(&policy),
    );
    first.handle(post("/v1/completions"));
    assert!(first.handle(body(&[b' '; 100], false)).is_empty());
    assert_eq!(policy.held_body_budget.held(), 100);
    // ...leaves 100 for the next: 150 more is refused 503, retryable, and nothing kept.
    let mut second = exchange_under(&router, BodySendMode::Buffered, Arc::clone(&policy));
    second.handle(post("/v1/completions"));
    let answers = second.handle(body(&[b' '; 150], true));
    let (status, error) = immediate_status(&answers[0]).expect("immediate answer");
    assert_eq!(
        (status, &error["error"]["code"]),
        (503, &"overloaded".into())
    );
    assert_eq!(policy.held_body_budget.held(), 100);
    // A buffered request that fits is routed and lets go of its body at once.
    let mut third = exchange_under(&router, BodySendMode::Buffered, Arc::clone(&policy));
    third.handle(post("/v1/completions"));
    assert!(COMPLETION.len() <= 100);
    let answers = third.handle(body(COMPLETION, true));
    assert!(destination_of(&answers[0]).is_some());
    assert_eq!(policy.held_body_budget.held(), 100);
    // The first stream's body goes back when it is routed, or when the stream dies.
    drop(first);
    assert_eq!(policy.held_body_budget.held(), 0);
}

#[test]
fn a_request_that_does_not_arrive_in_time_is_answered_408_once_its_headers_came() {
    let router = Arc::new(StubRouter::default());
    let mut silent = exchange(&router, BodySendMode::FullDuplexStreamed);
    assert!(silent.awaiting_request());
    assert!(silent.read_timed_out().is_empty(), "no request to answer");

    let mut stalled = exchange(&router, BodySendMode::FullDuplexStreamed);
    stalled.handle(post("/v1/completions"));
    stalled.handle(body(b"{\"model\":", false));
    let answers = stalled.read_timed_out();
    let (status, error) = immediate_status(&answers[0]).expect("immediate answer");
    assert_eq!(
        (status, &error["error"]["code"]),
        (408, &"request_timeout".into())
    );
    assert!(!stalled.awaiting_request());
    assert!(router.seen.lock().expect("lock").is_empty());
}

fn holding_router() -> Arc<StubRouter> {
    Arc::new(StubRouter {
        hold: true,
        ..StubRouter::default()
    })
}

/// Gives the held request its outcome, as the waiting room would.
fn answer_held(router: &StubRouter, outcome: Result<Routed<StubTicket>, Unrouted>) {
    let answer = router.held.lock().expect("lock").remove(0);
    assert!(answer.send(outcome).is_ok(), "the exchange still waits");
}

/// The immediate response's header `name`, if any.
fn immediate_header(answer: &ProcessingResponse, name: &str) -> Option<String> {
    let Some(Response::ImmediateResponse(reply)) = answer.response.as_ref() else {
        return None;
    };
    reply
        .headers
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == name)
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
}

/// Drives a held request's wait to its outcome, as the stream does.
fn settle(ex: &mut Exchange<StubRouter>) -> Vec<ProcessingResponse> {
    let waiting = ex.take_waiting().expect("the request waits");
    let outcome = futures::executor::block_on(waiting);
    ex.placed(outcome)
}

#[test]
fn a_held_buffered_request_extends_the_gateway_timeout_then_routes_in_the_body_answer() {
    let router = holding_router();
    let mut ex = exchange(&router, BodySendMode::Buffered);
    ex.handle(post("/v1/completions"));
    let answers = ex.handle(body(COMPLETION, true));
    assert_eq!(answers.len(), 1);
    let extended = answers[0]
        .override_message_timeout
        .expect("asks the gateway to wait longer");
    assert_eq!(extended.seconds, 6, "the stub's 5 s wait plus the margin");
    assert!(
        answers[0].response.is_none(),
        "nothing else in that message"
    );
    answer_held(&router, Ok(router.routed()));
    let answers = settle(&mut ex);
    assert!(matches!(
        answers[0].response,
        Some(Response::RequestBody(_))
    ));
    assert_eq!(
        destination_of(&answers[0]),
        Some((format!("{POD_A},{POD_B}"), true))
    );
}

#[test]
fn a_held_full_duplex_request_sends_nothing_until_routed_then_its_body() {
    let router = holding_router();
    let mut ex = exchange(&router, BodySendMode::FullDuplexStreamed);
    ex.handle(post("/v1/completions"));
    assert!(
        ex.handle(body(COMPLETION, true)).is_empty(),
        "full duplex runs no timer"
    );
    answer_held(&router, Ok(router.routed()));
    let answers = settle(&mut ex);
    assert!(matches!(
        answers[0].response,
        Some(Response::RequestHeaders(_))
    ));
    let echoed: Vec<u8> = answers[1..]
        .iter()
        .filter_map(streamed_chunk)
        .flat_map(|(bytes, _)| bytes)
        .collect();
    assert_eq!(echoed, COMPLETION, "the held body goes on whole");
    assert_eq!(router.tickets().open, 1);
}

#[test]
fn a_dropped_held_request_is_answered_429_with_the_reason_and_retry_after() {
    let router = holding_router();
    let mut ex = exchange(&router, BodySendMode::Buffered);
    ex.handle(post("/v1/completions"));
    ex.handle(body(COMPLETION, true));
    answer_held(
        &router,
        Err(Unrouted {
            kind: UnroutedKind::Shed,
            message: "waited too long".into(),
            dropped: Some(DropReason::TtlExpired),
        }),
    );
    let answers = settle(&mut ex);
    let (status, json) = immediate_status(&answers[0]).expect("an immediate response");
    assert_eq!(status, 429);
    assert_eq!(json["error"]["code"], "queue_wait_exceeded");
    assert_eq!(
        immediate_header(&answers[0], crate::flow::DROPPED_REASON_HEADER).as_deref(),
        Some("rejected-ttl-expired")
    );
    assert_eq!(
        immediate_header(&answers[0], "retry-after").as_deref(),
        Some("1")
    );
}

#[test]
fn the_drain_answers_a_held_request_503_shutting_down() {
    let router = holding_router();
    let mut ex = exchange(&router, BodySendMode::FullDuplexStreamed);
    ex.handle(post("/v1/completions"));
    ex.handle(body(COMPLETION, true));
    let answers = ex.abort();
    let (status, _) = immediate_status(&answers[0]).expect("an immediate response");
    assert_eq!(status, 503);
    assert_eq!(
        immediate_header(&answers[0], crate::flow::DROPPED_REASON_HEADER).as_deref(),
        Some("rejected-shutting-down")
    );
    assert!(
        ex.take_waiting().is_none(),
        "the wait is let go: the request leaves the queue"
    );
}

#[test]
fn the_objective_and_fairness_headers_give_the_request_its_class() {
    let router = Arc::new(StubRouter::default());
    let flow = crate::flow::FlowSettings {
        objectives: std::collections::HashMap::from([("critical".to_owned(), 100)]),
        ..crate::flow::FlowSettings::default()
    };
    let policy = Arc::new(RequestPolicy::with_default_paths(1 << 20).with_flow(Arc::new(flow)));
    let mut ex = exchange_under(&router, BodySendMode::Buffered, policy);
    ex.handle(headers(
        &[
            (":method", "POST"),
            (":path", "/v1/completions"),
            ("x-gateway-inference-objective", "critical"),
            ("x-gateway-inference-fairness-id", "team-a"),
        ],
        false,
    ));
    ex.handle(body(COMPLETION, true));
    let classes = router.classes.lock().expect("lock").clone();
    assert_eq!(
        classes,
        [RequestClass {
            priority: 100,
            tenant: "team-a".into()
        }]
    );
}

#[test]
fn a_fairness_id_over_the_bound_is_answered_400() {
    let router = Arc::new(StubRouter::default());
    let mut ex = exchange(&router, BodySendMode::Buffered);
    let long = "t".repeat(crate::flow::MAX_FAIRNESS_ID_BYTES + 1);
    let answers = ex.handle(headers(
        &[
            (":method", "POST"),
            (":path", "/v1/completions"),
            ("x-llm-d-inference-fairness-id", &long),
        ],
        false,
    ));
    let (status, json) = immediate_status(&answers[0]).expect("refused");
    assert_eq!(status, 400);
    assert_eq!(json["error"]["code"], "invalid_fairness_id");
    assert!(router.seen.lock().expect("lock").is_empty(), "never routed");
}
