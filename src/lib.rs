//! kvroute, the gateway: an Envoy ext_proc endpoint picker that routes each LLM request
//! to the vLLM pod with room for it (KV-cache headroom, queue, LoRA adapter affinity).
//!
//! Data flow: `extproc` (Envoy protocol; parses the body with `kvroute_core::request`) →
//! `picker` (takes the current fleet, runs `kvroute_core::scheduler::pick`, reserves the
//! winner; a request that fits no pod waits in its waiting room, ordered as `flow` says)
//! → `extproc` answers. Beside it: `discovery` feeds the `store` with endpoints,
//! `scrape` polls each endpoint's `/metrics` and `/v1/models` into the `store`, which
//! publishes fleet snapshots; `kvevents` follows each pod's KV cache events (vLLM
//! `--kv-events-config`) into the precise prefix index; `telemetry` owns kvroute's own metrics; `admin` serves the
//! decision tap and endpoint list; `config` validates flags before `app` binds and runs.
//! The simulator and the benchmarks live in the `kvroute-sim` and `kvroute-lab` crates.

pub mod admin;
pub mod app;
pub mod config;
pub mod discovery;
pub mod extproc;
pub mod flow;
pub mod kvevents;
pub mod listener;
pub mod picker;
pub mod scrape;
pub mod shutdown;
pub mod store;
pub mod telemetry;
pub mod tokenize;
