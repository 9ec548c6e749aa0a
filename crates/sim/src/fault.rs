//! The fault switch (`--fault-switch`): `POST /kvroute-sim/faults` with
//! `{"metrics": "hang" | "garbage" | "none"}` puts one pod's `/metrics` into a failure mode
//! until it is switched back, while the pod keeps serving completions. It lets a test show
//! what a router does with a pod whose metrics stop coming or stop parsing, the failures a
//! scraper meets in front of a real, overloaded or misconfigured vLLM.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How a pod's `/metrics` answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricsFault {
    /// Normally.
    #[default]
    None,
    /// Not at all: the request waits without a status or a byte until the fault is
    /// switched off (then it is answered normally) or [`HANG_LIMIT`] passes (then 503), so
    /// a scraper's own timeout is what ends it.
    Hang,
    /// 200 with [`GARBAGE`], which is not the exposition format.
    Garbage,
}

/// The body of `POST /kvroute-sim/faults`, and of its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    /// The mode of `/metrics` from now on.
    pub metrics: MetricsFault,
}

/// Longest a hanging `/metrics` holds a request: a scraper that never times out costs the
/// pod one task per scrape for at most this long, never forever.
pub const HANG_LIMIT: Duration = Duration::from_secs(60);

/// What a garbage `/metrics` answers: a sample line cut short, then a proxy's HTML error
/// page, as a misrouted or truncated scrape returns.
pub const GARBAGE: &str = "vllm:num_requests_running{model_name=\"meta-llama/Llama-3.1-8B-Instruct\"\n\
<html><head><title>502 Bad Gateway</title></head><body>upstream sent garbage</body></html>\n";
