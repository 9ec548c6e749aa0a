//! kvroute: an Envoy ext_proc endpoint picker that routes each LLM request to the
//! vLLM pod with room for it (KV-cache headroom, queue, LoRA adapter affinity).
//!
//! Data flow: `extproc` (Envoy protocol) → `request` (parse the OpenAI body) →
//! `picker` → `scheduler` (pure pick over a `state` snapshot) → `extproc` answers.
//! Beside it: `discovery` feeds `state` with endpoints, `scrape` polls each
//! endpoint's `/metrics` into `state`, `telemetry` owns kvroute's own metrics, `app`
//! wires it all, `sim` is the vLLM fleet simulator, `gateway` runs Envoy locally and
//! `demo` puts them together.
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod compare;
pub mod config;
pub mod demo;
pub mod discovery;
pub mod extproc;
pub mod gateway;
pub mod loadgen;
pub mod picker;
pub mod request;
pub mod scheduler;
pub mod scrape;
pub mod sim;
pub mod state;
pub mod telemetry;
