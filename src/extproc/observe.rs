//! A request's predicted cached prompt tokens against what its pod reports having served
//! from cache (`usage.prompt_tokens_details.cached_tokens`), one request at a time: how an
//! operator sees the prefix index drift from the engines (a wrong block size, hash seed or
//! tokenizer; evictions the approximate index cannot see).
//!
//! The response body says what the pod served. It reaches kvroute one of two ways:
//! - in the routing stream itself, where the gateway sends response bodies to kvroute
//!   (`FULL_DUPLEX_STREAMED` both ways, as the Istio manifest does);
//! - in a second, observing stream: the shipped gateways keep response bodies from the
//!   picker (a token stream never waits on kvroute), and can add a second ext_proc filter
//!   in `observability_mode` (envoy/, commented out) that copies each response to kvroute
//!   without waiting for answers. The picker leaves its prediction in the request's
//!   dynamic metadata (namespace [`PREDICTION_NAMESPACE`]), which that filter forwards,
//!   so either kvroute replica can check it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, processing_request};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value};

use super::messages::SERVED_HEADER;
use crate::telemetry::{self, PREFIX_SOURCES};

/// The dynamic-metadata namespace the picker's prediction travels in.
pub const PREDICTION_NAMESPACE: &str = "kvroute";

/// What the picker expected the chosen pod to find cached of a request's prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixPrediction {
    pub cached_tokens: u64,
    /// Where the prefix scores came from (one of [`PREFIX_SOURCES`]).
    pub source: &'static str,
    /// The pod it was predicted for.
    pub pod: SocketAddr,
    /// The pod's KV block size: the engine caches whole blocks, so a prediction within a
    /// block of the answer is as good as the engine's own rounding allows.
    pub block_tokens: u32,
}

impl PrefixPrediction {
    /// The prediction as the picker's dynamic metadata: `{"kvroute": {...}}`.
    pub fn metadata_field(&self) -> (String, Value) {
        let mut fields = Struct::default();
        let mut put = |key: &str, kind: Kind| {
            fields
                .fields
                .insert(key.to_owned(), Value { kind: Some(kind) });
        };
        // Token counts stay far below 2^53, so a JSON number holds them exactly.
        put(
            "predicted_cached_tokens",
            Kind::NumberValue(self.cached_tokens as f64),
        );
        put("prefix_source", Kind::StringValue(self.source.to_owned()));
        put("pod", Kind::StringValue(self.pod.to_string()));
        put(
            "block_tokens",
            Kind::NumberValue(f64::from(self.block_tokens)),
        );
        (
            PREDICTION_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(fields)),
            },
        )
    }

    /// Reads a prediction back from forwarded metadata; `None` when it is absent or not
    /// kvroute's shape (the observer then has nothing to check).
    pub fn from_metadata(metadata: &Metadata) -> Option<PrefixPrediction> {
        let fields = &metadata.filter_metadata.get(PREDICTION_NAMESPACE)?.fields;
        let number = |key: &str| match fields.get(key)?.kind.as_ref()? {
            Kind::NumberValue(n) if n.is_finite() && *n >= 0.0 => Some(*n),
            _ => None,
        };
        let text = |key: &str| match fields.get(key)?.kind.as_ref()? {
            Kind::StringValue(s) => Some(s.as_str()),
            _ => None,
        };
        let source = text("prefix_source")?;
        // Back to the static label, so a forged value cannot create series.
        let source = PREFIX_SOURCES.iter().copied().find(|s| *s == source)?;
        Some(PrefixPrediction {
            cached_tokens: number("predicted_cached_tokens")? as u64,
            source,
            pod: text("pod")?.parse().ok()?,
            block_tokens: (number("block_tokens")? as u32).max(1),
        })
    }
}

/// The numbers of a response's `usage` object, read from its body as it streams: the last
/// usage object wins (the final server-sent event, or the end of a JSON answer; with
/// vLLM's `continuous_usage_stats` every event carries one).
#[derive(Debug, Default)]
pub struct UsageScan {
    /// The end of the previous chunk, so a key or number split between two chunks is
    /// still read.
    carry: Vec<u8>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// Longest tail kept between chunks: a key, its colon and spaces, and a number.
const CARRY: usize = 64;

impl UsageScan {
    /// Reads one chunk of the body; `last`: no chunk follows, so a number that runs to
    /// the end of this one is whole.
    pub fn feed(&mut self, chunk: &[u8], last: bool) {
        if chunk.is_empty() && !last {
            return;
        }
        let joined;
        let text: &[u8] = if self.carry.is_empty() {
            chunk
        } else {
            let mut buffer = std::mem::take(&mut self.carry);
            buffer.extend_from_slice(chunk);
            joined = buffer;
            &joined
        };
        let keys: [(&[u8], &mut Option<u64>); 3] = [
            (b"\"prompt_tokens\"", &mut self.prompt_tokens),
            (b"\"cached_tokens\"", &mut self.cached_tokens),
            (b"\"completion_tokens\"", &mut self.completion_tokens),
        ];
        for (key, slot) in keys {
            if let Some(value) = last_number_after(text, key, last) {
                *slot = Some(value);
            }
        }
        if !last {
            let tail = text.len().saturating_sub(CARRY);
            self.carry = text[tail..].to_vec();
        }
    }
}

/// The number after the last complete `key:` in `text`. A number reaching the end of
/// `text` may go on in the next chunk: it counts only when `whole`.
fn last_number_after(text: &[u8], key: &[u8], whole: bool) -> Option<u64> {
    let mut end = text.len();
    while let Some(at) = memchr::memmem::rfind(&text[..end], key) {
        end = at;
        let rest = &text[at + key.len()..];
        let rest = rest.trim_ascii_start();
        let Some(rest) = rest.strip_prefix(b":") else {
            continue;
        };
        let rest = rest.trim_ascii_start();
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 || (digits == rest.len() && !whole) {
            continue;
        }
        return std::str::from_utf8(&rest[..digits]).ok()?.parse().ok();
    }
    None
}

/// Set once any response has carried `cached_tokens`. vLLM writes
/// `prompt_tokens_details` only with `--enable-prompt-tokens-details`, and then only when
/// something was cached: from then on a usage object without it means none was.
static DETAILS_REPORTED: AtomicBool = AtomicBool::new(false);

/// How a checked request came out (`outcome` of `kvroute_prefix_checks_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckOutcome {
    /// Served within one block of the prediction.
    AsPredicted,
    /// Served fewer than predicted: the index believed in blocks the pod no longer held
    /// (or never stored).
    Fewer,
    /// Served more than predicted: blocks kvroute did not know of.
    More,
    /// Another pod served it (a failed-over retry): the prediction was for the pick.
    OtherPod,
    /// The response said nothing of its cached tokens (no usage object: a stream without
    /// `stream_options.include_usage`, or pods without `--enable-prompt-tokens-details`).
    Unreported,
}

impl CheckOutcome {
    pub const ALL: [CheckOutcome; 5] = [
        CheckOutcome::AsPredicted,
        CheckOutcome::Fewer,
        CheckOutcome::More,
        CheckOutcome::OtherPod,
        CheckOutcome::Unreported,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CheckOutcome::AsPredicted => "as_predicted",
            CheckOutcome::Fewer => "fewer",
            CheckOutcome::More => "more",
            CheckOutcome::OtherPod => "other_pod",
            CheckOutcome::Unreported => "unreported",
        }
    }
}

/// Compares a prediction with the response's usage (`served_by`: the pod the gateway
/// says served it, if it says) and records the result; returns the served cached tokens
/// it counted, if any.
pub fn check(
    prediction: &PrefixPrediction,
    usage: &UsageScan,
    served_by: Option<SocketAddr>,
) -> (CheckOutcome, Option<u64>) {
    let (outcome, served) = compare(prediction, usage, served_by);
    telemetry::record_prefix_check(prediction.source, outcome, prediction.cached_tokens, served);
    (outcome, served)
}

fn compare(
    prediction: &PrefixPrediction,
    usage: &UsageScan,
    served_by: Option<SocketAddr>,
) -> (CheckOutcome, Option<u64>) {
    if served_by.is_some_and(|pod| pod != prediction.pod) {
        return (CheckOutcome::OtherPod, None);
    }
    let served = match (usage.cached_tokens, usage.prompt_tokens) {
        (Some(cached), _) => {
            DETAILS_REPORTED.store(true, Ordering::Relaxed);
            cached
        }
        (None, Some(_)) if DETAILS_REPORTED.load(Ordering::Relaxed) => 0,
        _ => return (CheckOutcome::Unreported, None),
    };
    let tolerance = u64::from(prediction.block_tokens);
    let outcome = if served + tolerance < prediction.cached_tokens {
        CheckOutcome::Fewer
    } else if served > prediction.cached_tokens + tolerance {
        CheckOutcome::More
    } else {
        CheckOutcome::AsPredicted
    };
    (outcome, Some(served))
}

/// One observing stream (a filter in `observability_mode`): reads the prediction the
/// picker left in the metadata, which pod served, and the response's usage; checks them
/// once the body ends (or the stream does). It answers nothing: Envoy does not wait.
#[derive(Debug, Default)]
pub struct ResponseObserver {
    prediction: Option<PrefixPrediction>,
    served_by: Option<SocketAddr>,
    usage: UsageScan,
    checked: bool,
}

impl ResponseObserver {
    pub fn handle(&mut self, message: &ProcessingRequest) {
        if self.prediction.is_none() {
            self.prediction = message
                .metadata_context
                .as_ref()
                .and_then(PrefixPrediction::from_metadata);
        }
        match &message.request {
            Some(processing_request::Request::ResponseHeaders(headers)) => {
                self.served_by = headers
                    .headers
                    .as_ref()
                    .and_then(|map| super::exchange::header_value(map, SERVED_HEADER))
                    .and_then(|value| value.trim().parse().ok());
            }
            Some(processing_request::Request::ResponseBody(body)) => {
                let last = body.end_of_stream || body.end_of_stream_without_message;
                self.usage.feed(&body.body, last);
                if last {
                    self.finish();
                }
            }
            Some(processing_request::Request::ResponseTrailers(_)) => self.finish(),
            _ => {}
        }
    }

    /// Whether the response has ended and been checked: nothing more will come.
    pub fn is_done(&self) -> bool {
        self.checked
    }

    /// The response ended, or the stream did: checks the prediction, once.
    pub fn finish(&mut self) {
        if std::mem::replace(&mut self.checked, true) {
            return;
        }
        if let Some(prediction) = &self.prediction {
            check(prediction, &self.usage, self.served_by);
        }
    }
}

#[cfg(test)]
mod tests;
