//! `POST /kvroute-sim/faults` (served only with `--fault-switch`): sets how this pod's
//! `/metrics` answers (see [`crate::fault`]).

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

use crate::fault::Faults;

use super::{ApiError, PodState, parse_json};

/// Switches the pod's faults; answers the faults now in force.
pub(crate) async fn set_faults(State(pod): PodState, body: Bytes) -> Response {
    let faults = match parse_json(&body).and_then(|v| {
        serde_json::from_value::<Faults>(v).map_err(|e| {
            ApiError::bad_request(format!(
                "expected {{\"metrics\": \"none\" | \"hang\" | \"garbage\"}}: {e}"
            ))
        })
    }) {
        Ok(faults) => faults,
        Err(e) => return e.into_response(),
    };
    pod.metrics_fault.send_replace(faults.metrics);
    axum::Json(faults).into_response()
}
