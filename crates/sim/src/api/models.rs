//! Served models: `GET /v1/models` (the base model and its adapters) and LoRA adapter
//! registration (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`).

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{ApiError, PodState, parse_json};

/// `GET /v1/models`: the base model, then each adapter with its `parent`.
pub(crate) async fn models(State(pod): PodState) -> Response {
    let (adapters, max_model_len) = {
        let core = pod.lock();
        (core.adapters.clone(), core.engine.max_model_len())
    };
    let card = |id: &str, root: &str, parent: Option<&str>| {
        json!({
            "id": id, "object": "model", "created": pod.created, "owned_by": "vllm",
            "root": root, "parent": parent, "max_model_len": max_model_len,
            "permission": [{
                "id": format!("modelperm-{id}"), "object": "model_permission",
                "created": pod.created, "allow_create_engine": false, "allow_sampling": true,
                "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                "allow_fine_tuning": false, "organization": "*", "group": null,
                "is_blocking": false,
            }],
        })
    };
    let mut data = vec![card(&pod.model, &pod.model, None)];
    for a in &adapters {
        data.push(card(a, &format!("/adapters/{a}"), Some(&pod.model)));
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

fn lora_name(body: &Value) -> Result<String, ApiError> {
    body.get("lora_name")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .ok_or_else(|| ApiError::bad_request("'lora_name' is required"))
}

/// `POST /v1/load_lora_adapter`: registers an adapter (it loads into a slot on first use).
pub(crate) async fn load_lora(State(pod): PodState, body: Bytes) -> Response {
    let result = (|| {
        let body = parse_json(&body)?;
        let name = lora_name(&body)?;
        let mut core = pod.lock();
        if !core.engine.lora_enabled() {
            return Err(ApiError::bad_request(
                "LoRA is not enabled on this server (max_loras is 0).",
            ));
        }
        if name == pod.model || core.adapters.contains(&name) {
            return Err(ApiError {
                status: StatusCode::BAD_REQUEST,
                message: format!("The lora adapter '{name}' has already been loaded."),
                kind: "InvalidUserInput",
                param: None,
            });
        }
        core.adapters.push(name.clone());
        Ok(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    })();
    match result {
        Ok(text) => (StatusCode::OK, text).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/unload_lora_adapter`.
pub(crate) async fn unload_lora(State(pod): PodState, body: Bytes) -> Response {
    let result = (|| {
        let body = parse_json(&body)?;
        let name = lora_name(&body)?;
        let mut core = pod.lock();
        let Some(i) = core.adapters.iter().position(|a| a == &name) else {
            return Err(ApiError::not_found(
                format!("The lora adapter '{name}' cannot be found."),
                None,
            ));
        };
        core.adapters.remove(i);
        core.engine.unload_adapter(&name);
        Ok(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    })();
    match result {
        Ok(text) => (StatusCode::OK, text).into_response(),
        Err(e) => e.into_response(),
    }
}
