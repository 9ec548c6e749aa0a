//! `POST /v1/completions` and `/v1/chat/completions`: parse, submit to the pod's engine, and
//! hand the token channel to a response writer; the engine request is aborted if the client goes.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use crate::engine::{FinishReason, RequestId};
use crate::server::Pod;

use super::request::{parse, spec_of};
use super::response::{Format, complete_response, stream_response};
use super::{ApiError, Kind, PodState, parse_json};

/// Cancels the engine request if the response is dropped before it completes.
pub(super) struct AbortGuard {
    pod: Arc<Pod>,
    id: RequestId,
    pub(super) armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            self.pod.abort(self.id);
        }
    }
}

fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn generate(pod: Arc<Pod>, body: Bytes, kind: Kind) -> Result<Response, ApiError> {
    let raw = body;
    let body = parse_json(&raw)?;
    let parsed = parse(&pod, &body, &raw, kind)?;
    let max_model_len = pod.lock().engine.max_model_len();
    let spec = spec_of(&pod, &parsed, max_model_len)?;
    let output_seed = spec.output_seed;
    let max_output = spec.max_output;
    let finish = finish_str(spec.finish_reason);
    let Some((id, rx)) = pod.submit(spec) else {
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is shutting down".into(),
            kind: "ServiceUnavailableError",
            param: None,
        });
    };
    let guard = AbortGuard {
        pod: pod.clone(),
        id,
        armed: true,
    };
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let fmt = Format {
        kind,
        id: pod.response_id(prefix, id),
        created: unix_now(),
        model_json: Value::String(parsed.model.clone()).to_string(),
        output_seed,
        max_output,
        finish,
        include_usage: parsed.include_usage,
    };
    if parsed.stream {
        Ok(stream_response(fmt, rx, guard))
    } else {
        complete_response(fmt, rx, guard).await
    }
}

/// `POST /v1/completions`.
pub(crate) async fn completions(State(pod): PodState, body: Bytes) -> Response {
    generate(pod, body, Kind::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(State(pod): PodState, body: Bytes) -> Response {
    generate(pod, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}
