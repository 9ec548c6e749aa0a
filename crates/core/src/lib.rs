//! kvroute's routing core: everything that decides where a request goes, and nothing that
//! moves bytes. No async runtime, no network, no clock reads, no metrics recorder: the
//! crate's dependencies make that a compiler guarantee, so the live gateway, the
//! benchmarks and offline simulations run the same code.
//!
//! - [`request`]: the OpenAI request body → [`request::InferenceRequest`], and
//!   [`request::RouteRequest`], the one shape a request has from the protocol to the pick.
//! - [`exposition`] and [`vllm`]: Prometheus text, and vLLM's `/metrics` and `/v1/models`
//!   → [`fleet::PodMetrics`], [`fleet::ServedModels`].
//! - [`fleet`]: the snapshot types, and the per-pod bookkeeping kvroute keeps (in-flight
//!   load, prefix memory, health hysteresis).
//! - [`scheduler`]: `pick`, a pure function of request, fleet and configuration.
//! - [`kvevents`]: vLLM's KV cache events decoded, and applied per pod to a prefix index
//!   of what each engine really caches.
//! - [`flow`]: the waiting room of flow control: requests that fit no pod now, served by
//!   priority, tenant in turn and arrival.

pub mod exposition;
pub mod fleet;
pub mod flow;
pub mod kvevents;
pub mod request;
pub mod scheduler;
pub mod vllm;

#[cfg(test)]
mod testing;
