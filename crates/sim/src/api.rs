//! The HTTP API of one simulated pod: vLLM's OpenAI-compatible endpoints and what the peer routers
//! ask of a worker (REFERENCE.md §5). Unknown request fields are ignored.
//!
//! Layout: `request` parses bodies into engine requests, `generate` serves the completion
//! endpoints and `response` writes their answers (SSE or whole JSON); `render` covers the
//! prompt-only endpoints, `models` the model list and LoRA registration, `info` the status
//! endpoints, `faults` the fault switch. The shared pieces (errors, body parsing, the endpoint kind) live here.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::server::Pod;

mod faults;
mod generate;
mod info;
mod models;
mod render;
mod request;
mod response;

pub(crate) use faults::set_faults;
pub(crate) use generate::{chat_completions, completions};
pub(crate) use info::{get_load, health, metrics, model_info, not_found, server_info, version};
pub(crate) use models::{load_lora, models, unload_lora};
pub(crate) use render::{chat_render, completions_render, tokenize_endpoint};

type PodState = State<Arc<Pod>>;

/// An error answered in vLLM's JSON shape.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "BadRequestError",
            param: None,
        }
    }

    fn not_found(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "NotFoundError",
            param,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status.as_u16(),
            }
        });
        (self.status, axum::Json(body)).into_response()
    }
}

fn parse_json(body: &Bytes) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    if v.is_object() {
        Ok(v)
    } else {
        Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}
