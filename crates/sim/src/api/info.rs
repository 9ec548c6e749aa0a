//! Status endpoints the routers and Prometheus poll: health, `/metrics`, `/get_load`, server and
//! model info, version, and the 404 fallback.

use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::{ApiError, PodState};
use crate::fault::{GARBAGE, HANG_LIMIT, MetricsFault};

/// What Prometheus' Python client answers `/metrics` with, as vLLM does.
const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// `GET /health`: 200 with an empty body.
pub(crate) async fn health() -> StatusCode {
    StatusCode::OK
}

/// `GET /metrics`, unless the fault switch says otherwise. `?name[]=A&name[]=B` renders only
/// the samples named, as prometheus_client's ASGI app (vLLM's `/metrics`) does.
pub(crate) async fn metrics(
    State(pod): PodState,
    Query(params): Query<Vec<(String, String)>>,
) -> Response {
    let fault = *pod.metrics_fault.borrow();
    match fault {
        MetricsFault::None => {}
        MetricsFault::Garbage => {
            return ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], GARBAGE).into_response();
        }
        MetricsFault::Hang => {
            let mut fault = pod.metrics_fault.subscribe();
            let cleared = fault.wait_for(|f| *f != MetricsFault::Hang);
            if !matches!(tokio::time::timeout(HANG_LIMIT, cleared).await, Ok(Ok(_))) {
                return ApiError {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    message: "/metrics hung (fault switch)".into(),
                    kind: "ServiceUnavailableError",
                    param: None,
                }
                .into_response();
            }
        }
    }
    let text = pod.metrics();
    let names: Vec<&str> = params
        .iter()
        .filter(|(key, _)| key == "name[]")
        .map(|(_, value)| value.as_str())
        .collect();
    let text = if names.is_empty() {
        text
    } else {
        crate::metrics::restrict(&text, &names)
    };
    ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], text).into_response()
}

/// `GET /get_load` (SGLang's shape, used by power-of-two routing).
pub(crate) async fn get_load(State(pod): PodState) -> Response {
    let l = pod.load();
    axum::Json(json!([{
        "dp_rank": 0,
        "num_reqs": l.running + l.waiting,
        "num_waiting_reqs": l.waiting,
        "num_tokens": l.tokens_in_use,
    }]))
    .into_response()
}

/// `GET /server_info`, `/get_server_info`.
pub(crate) async fn server_info(State(pod): PodState) -> Response {
    let core = pod.lock();
    let cfg = core.engine.config();
    let body = json!({
        "model_path": pod.model,
        "served_model_name": pod.model,
        "max_total_num_tokens": u64::from(cfg.num_gpu_blocks) * u64::from(cfg.block_size),
        "max_running_requests": cfg.max_num_seqs,
        "chunked_prefill_size": cfg.max_num_batched_tokens,
        "page_size": cfg.block_size,
        "context_length": core.engine.max_model_len(),
        "max_loras_per_batch": cfg.max_loras,
        "dp_size": 1,
        "tp_size": 1,
        "profile": core.engine.profile().name,
        "simulated": true,
    });
    drop(core);
    axum::Json(body).into_response()
}

/// `GET /model_info`, `/get_model_info`.
pub(crate) async fn model_info(State(pod): PodState) -> Response {
    axum::Json(json!({
        "model_path": pod.model,
        "tokenizer_path": pod.model,
        "is_generation": true,
    }))
    .into_response()
}

/// `GET /version`.
pub(crate) async fn version() -> Response {
    axum::Json(json!({"version": concat!("kvroute-sim-", env!("CARGO_PKG_VERSION"))}))
        .into_response()
}

/// Anything else: 404 in vLLM's error shape.
pub(crate) async fn not_found() -> Response {
    ApiError::not_found("Not Found", None).into_response()
}
