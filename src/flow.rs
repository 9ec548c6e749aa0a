//! Flow control at the gateway: what a request's class is (its priority and its tenant),
//! and the settings that say how long and how many requests may wait for room.
//!
//! The vocabulary is the Gateway API Inference Extension's, as the llm-d router implements
//! it, so clients and dashboards written for that picker work here:
//! - the objective header names an `InferenceObjective`; its priority orders the queue
//!   (higher first) and a negative priority marks the request *sheddable*: refused with
//!   429 rather than queued when no pod has room. kvroute reads no CRD: the map from
//!   objective to priority is configuration (`--objective-priority`), and an objective not
//!   in it gets priority 0, as the reference picker gives a request whose objective has no
//!   CRD;
//! - the fairness-id header names the tenant: tenants of one priority take turns;
//! - a request flow control drops is answered with the reason in
//!   `x-llm-d-request-dropped-reason`.
//!
//! The settings, classes and drop reasons themselves are `kvroute_core::flow`'s (the offline
//! simulation shares them); the live waiting room is in `crate::picker`.

use kvroute_core::flow::Priority;

pub use kvroute_core::flow::{
    ClassError, DEFAULT_MAX_WAIT, DEFAULT_MAX_WAITING, DEFAULT_STANDING, DEFAULT_TENANT,
    DropReason, FlowSettings, MAX_FAIRNESS_ID_BYTES, RequestClass, StandingQueue,
};

/// Headers naming the request's objective, the current spelling first.
pub const OBJECTIVE_HEADERS: [&str; 2] = [
    "x-llm-d-inference-objective",
    "x-gateway-inference-objective",
];
/// Headers naming the request's tenant, the current spelling first.
pub const FAIRNESS_HEADERS: [&str; 2] = [
    "x-llm-d-inference-fairness-id",
    "x-gateway-inference-fairness-id",
];
/// The response header that says why flow control dropped a request.
pub const DROPPED_REASON_HEADER: &str = "x-llm-d-request-dropped-reason";

/// Parses `NAME=PRIORITY` (e.g. `critical=100`, `batch=-10`).
pub fn parse_objective(text: &str) -> Result<(String, Priority), String> {
    let (name, priority) = text
        .split_once('=')
        .ok_or_else(|| format!("`{text}`: expected NAME=PRIORITY, e.g. critical=100"))?;
    let name = name.trim();
    if name.is_empty() {
        return Err(format!("`{text}`: the objective name is empty"));
    }
    let priority = priority.trim().parse::<Priority>().map_err(|_| {
        format!("`{text}`: the priority must be a whole number (negative: sheddable)")
    })?;
    Ok((name.to_owned(), priority))
}

#[cfg(test)]
mod tests;
