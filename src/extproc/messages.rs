//! Builders for the ext_proc answers kvroute sends, so the exchange logic reads as
//! protocol steps rather than nested protobuf literals.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
    processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, Struct, Value, value::Kind};

use std::time::Duration;

use super::observe::PrefixPrediction;
use crate::flow::{DROPPED_REASON_HEADER, DropReason};

/// Header (and metadata key) carrying the chosen endpoint, per the Gateway API
/// Inference Extension's endpoint-picker protocol.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Dynamic-metadata namespace Envoy's load balancers read the destination from.
pub const DESTINATION_METADATA_NAMESPACE: &str = "envoy.lb";
/// Header (and `envoy.lb` metadata key) naming the endpoint that actually served the
/// request, per the protocol's served-endpoint proposal.
pub const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";
/// Header the shipped gateways add to their own error replies, with Envoy's response
/// flags (`%RESPONSE_FLAGS%`): `UF` says the pod could not be connected to.
pub const UPSTREAM_FAILURE_HEADER: &str = "x-gateway-upstream-failure";
/// Metadata namespace of the gateway's subset hint.
pub const SUBSET_HINT_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint's endpoint list.
pub const SUBSET_HINT_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Largest body chunk streamed back to Envoy (Envoy recommends at most 64 KiB).
pub const MAX_STREAMED_CHUNK: usize = 62_000;

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            // Envoy reads `raw_value`; a mutation with only `value` sets an empty header.
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

fn string_value(text: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(text.to_owned())),
    }
}

/// The routing part of an answer: the destination header (overwriting anything the
/// client sent) and a route-cache flush so Envoy re-evaluates the route with it.
fn routing_common_response(destination: &str) -> CommonResponse {
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![header(DESTINATION_HEADER, destination)],
            ..HeaderMutation::default()
        }),
        clear_route_cache: true,
        ..CommonResponse::default()
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": destination}}`.
fn destination_metadata(destination: &str) -> Struct {
    let mut inner = Struct::default();
    inner
        .fields
        .insert(DESTINATION_HEADER.to_owned(), string_value(destination));
    let mut outer = Struct::default();
    outer.fields.insert(
        DESTINATION_METADATA_NAMESPACE.to_owned(),
        Value {
            kind: Some(Kind::StructValue(inner)),
        },
    );
    outer
}

/// The routing answer's dynamic metadata: the destination, and the prediction (if any)
/// for an observing filter to forward back to kvroute.
fn routing_metadata(destination: &str, prediction: Option<&PrefixPrediction>) -> Struct {
    let mut metadata = destination_metadata(destination);
    if let Some(prediction) = prediction {
        let (namespace, value) = prediction.metadata_field();
        metadata.fields.insert(namespace, value);
    }
    metadata
}

/// Answer to the request headers that routes the request.
pub fn route_in_headers(
    destination: &str,
    prediction: Option<&PrefixPrediction>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(routing_common_response(destination)),
        })),
        dynamic_metadata: Some(routing_metadata(destination, prediction)),
        ..ProcessingResponse::default()
    }
}

/// Answer to the (buffered) request body that routes the request.
pub fn route_in_body(
    destination: &str,
    prediction: Option<&PrefixPrediction>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(routing_common_response(destination)),
        })),
        dynamic_metadata: Some(routing_metadata(destination, prediction)),
        ..ProcessingResponse::default()
    }
}

/// Asks the gateway to wait up to `timeout` for the answer to the message it sent last
/// (the filter's `message_timeout` would otherwise fail the request over). Envoy accepts it
/// once per message, up to the filter's `max_message_timeout`, and ignores it while it
/// runs no timer (full duplex).
pub fn extend_message_timeout(timeout: Duration) -> ProcessingResponse {
    ProcessingResponse {
        override_message_timeout: Some(ProtoDuration {
            seconds: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            nanos: i32::try_from(timeout.subsec_nanos()).unwrap_or(0),
        }),
        ..ProcessingResponse::default()
    }
}

/// "Continue unchanged" answers for each phase.
pub fn continue_request_headers() -> ProcessingResponse {
    wrap(Response::RequestHeaders(HeadersResponse::default()))
}

pub fn continue_request_body() -> ProcessingResponse {
    wrap(Response::RequestBody(BodyResponse::default()))
}

pub fn continue_request_trailers() -> ProcessingResponse {
    wrap(Response::RequestTrailers(TrailersResponse::default()))
}

pub fn continue_response_headers() -> ProcessingResponse {
    wrap(Response::ResponseHeaders(HeadersResponse::default()))
}

/// Continues the response with the headers in `set` (added, or replacing the pod's) and
/// without those named in `remove` (kvroute's own signals, which the client must not see).
pub fn continue_response_headers_editing(
    set: &[(&str, &str)],
    remove: &[&str],
) -> ProcessingResponse {
    wrap(Response::ResponseHeaders(HeadersResponse {
        response: Some(CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers: set
                    .iter()
                    .map(|(name, value)| header(name, value))
                    .collect(),
                remove_headers: remove.iter().map(|&name| name.to_owned()).collect(),
            }),
            ..CommonResponse::default()
        }),
    }))
}

pub fn continue_response_body() -> ProcessingResponse {
    wrap(Response::ResponseBody(BodyResponse::default()))
}

pub fn continue_response_trailers() -> ProcessingResponse {
    wrap(Response::ResponseTrailers(TrailersResponse::default()))
}

fn wrap(response: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..StreamedBodyResponse::default()
                    },
                )),
            }),
            ..CommonResponse::default()
        }),
    }
}

/// Full duplex: one chunk of the request body sent back to Envoy.
pub fn streamed_request_body(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    wrap(Response::RequestBody(streamed_body(body, end_of_stream)))
}

/// Full duplex: one chunk of the response body sent back to Envoy unchanged.
pub fn streamed_response_body(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    wrap(Response::ResponseBody(streamed_body(body, end_of_stream)))
}

/// An error the client gets instead of an upstream answer, as OpenAI-style JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorReply {
    pub status: u16,
    pub error_type: &'static str,
    pub code: &'static str,
    pub message: String,
    /// Seconds after which a retry may succeed (503, 429).
    pub retry_after: Option<u32>,
    /// Why flow control dropped the request, if it did.
    pub dropped: Option<DropReason>,
}

impl ErrorReply {
    /// `{"error":{"message":..,"type":..,"code":..}}`.
    pub fn json_body(&self) -> Vec<u8> {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.error_type,
                "code": self.code,
            }
        })
        .to_string()
        .into_bytes()
    }

    pub fn into_response(self) -> ProcessingResponse {
        let mut headers = vec![header("content-type", "application/json")];
        if let Some(seconds) = self.retry_after {
            headers.push(header("retry-after", &seconds.to_string()));
        }
        if let Some(reason) = self.dropped {
            headers.push(header(DROPPED_REASON_HEADER, reason.as_str()));
        }
        wrap(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(self.status),
            }),
            headers: Some(HeaderMutation {
                set_headers: headers,
                ..HeaderMutation::default()
            }),
            body: self.json_body(),
            details: format!("kvroute_{}", self.code),
            ..ImmediateResponse::default()
        }))
    }
}
