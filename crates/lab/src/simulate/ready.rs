//! The trace's requests drawn and made ready ahead, on the helper thread: each one drawn
//! from the trace (its arrival, lengths and words), its body as kvroute's parser reads it
//! and its prompt as the engine tokenizes it. The trace travels with each batch and comes
//! back with it, so its draws are made in the same order whoever makes them, and the
//! rest are pure functions of the request: the results are the same. At a thousand
//! requests a second making them ready was a sixteenth of the loop's time, and drawing
//! long prompts' words another twentieth.

use std::collections::VecDeque;
use std::sync::Arc;

use kvroute_core::request::InferenceRequest;

use super::pods::{Chore, Errand, Pods};
use super::trace::TraceRequest;
use crate::loadgen::workload::Api;

/// Requests made ready per chore handed to the helper: enough that the hand-over costs
/// little beside them, few enough that the loop never waits long for the first batch.
const BATCH: usize = 64;

/// A request of the trace, made ready.
pub struct Ready {
    pub request: TraceRequest,
    /// Its body as kvroute's parser reads it ([`TraceRequest::inference`]), when the
    /// router reads bodies.
    pub inference: Option<InferenceRequest>,
    /// Its prompt as the engine tokenizes it ([`TraceRequest::engine_tokens`]).
    pub tokens: Vec<u32>,
}

/// What making a request ready needs: owned, to travel to the helper.
#[derive(Clone)]
pub struct Preparation {
    pub api: Api,
    /// The base model's name.
    pub model: Arc<str>,
    /// The adapters' names by index.
    pub adapters: Arc<[String]>,
    /// Whether the router reads bodies (kvroute does; the peers route blind).
    pub bodies: bool,
}

impl Preparation {
    fn ready(&self, request: TraceRequest, words: &mut Vec<u8>) -> Ready {
        let inference = self.bodies.then(|| {
            let model = request.model(&self.model, &self.adapters);
            request.inference(self.api, model, words)
        });
        let tokens = request.engine_tokens(self.api, words);
        Ready {
            request,
            inference,
            tokens,
        }
    }
}

/// A trace whose requests are drawn and made ready a batch ahead, in the trace's order.
pub struct ReadyTrace<I> {
    /// The trace, here between batches; away while a batch is being drawn from it, and
    /// gone once a batch came back short (the trace ran out).
    trace: Option<I>,
    preparation: Preparation,
    ready: VecDeque<Ready>,
    /// The next batch, being drawn and made ready (with the trace, to come back).
    coming: Option<Errand<(I, Vec<Ready>)>>,
}

impl<I: Iterator<Item = TraceRequest> + Send + 'static> ReadyTrace<I> {
    pub fn new(trace: I, preparation: Preparation) -> Self {
        ReadyTrace {
            trace: Some(trace),
            preparation,
            ready: VecDeque::with_capacity(2 * BATCH),
            coming: None,
        }
    }

    /// The next request, made ready; the batch after the next is handed to `pods`'
    /// helper as this one is taken.
    pub fn next(&mut self, pods: &mut Pods) -> anyhow::Result<Option<Ready>> {
        if self.ready.is_empty() {
            if self.coming.is_none() {
                // The first request: its batch on this thread.
                self.order(&mut |chore| chore());
            }
            if let Some(coming) = self.coming.take() {
                let (trace, batch) = coming.result()?;
                // A short batch is the trace's last.
                self.trace = (batch.len() == BATCH).then_some(trace);
                self.ready.extend(batch);
            }
        }
        if self.coming.is_none() {
            self.order(&mut |chore| pods.hand_over(chore));
        }
        Ok(self.ready.pop_front())
    }

    /// Has the trace's next batch drawn and made ready by `hand_over`'s means.
    fn order(&mut self, hand_over: &mut dyn FnMut(Chore)) {
        let Some(mut trace) = self.trace.take() else {
            return;
        };
        let preparation = self.preparation.clone();
        let work = move || {
            let mut words = Vec::new();
            let batch = trace
                .by_ref()
                .take(BATCH)
                .map(|request| preparation.ready(request, &mut words))
                .collect();
            (trace, batch)
        };
        self.coming = Some(Errand::new(work, hand_over));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::loadgen::Workload;
    use crate::simulate::trace::{Scale, StepTrace};

    /// Each request of a shipped workload's step made ready by hand, in order, as
    /// (arrival, body, engine prompt).
    type Made = Vec<(Duration, Option<InferenceRequest>, Vec<u32>)>;

    #[test]
    fn requests_drawn_and_made_ready_on_the_helper_are_the_trace_made_ready_here_in_order() {
        let file = std::path::Path::new(crate::WORKLOADS_DIR).join("shared-prefix.yaml");
        let w = Workload::from_file(&file).expect("shipped");
        let scale = Scale {
            rate: 1.0,
            copies: 2,
        };
        let trace =
            |n: usize| StepTrace::new(&w, 3, 0, 8.0, scale, Duration::from_secs(60), Some(n));
        let preparation = Preparation {
            api: w.api,
            model: Arc::from(w.model.as_str()),
            adapters: Arc::from(scale.adapter_names(&w).as_slice()),
            bodies: true,
        };
        // A trace that ends inside a batch, and one that ends with one (its last batch,
        // drawn on the helper, is empty).
        for n in [150, 2 * BATCH] {
            let mut words = Vec::new();
            let want: Made = trace(n)
                .map(|r| {
                    let body = r.inference(w.api, &w.model, &mut words);
                    let tokens = r.engine_tokens(w.api, &mut words);
                    (r.at, Some(body), tokens)
                })
                .collect();
            assert_eq!(want.len(), n);
            let made = |helper: bool| -> Made {
                std::thread::scope(|scope| {
                    let mut pods = Pods::new(Vec::new());
                    if helper {
                        pods.start_helper(scope);
                    }
                    let mut ready = ReadyTrace::new(trace(n), preparation.clone());
                    let mut made = Vec::new();
                    while let Some(r) = ready.next(&mut pods).expect("made ready") {
                        made.push((r.request.at, r.inference, r.tokens));
                    }
                    made
                })
            };
            assert!(want == made(false), "without a helper, {n} requests");
            assert!(want == made(true), "with a helper, {n} requests");
        }
        let blind = Preparation {
            bodies: false,
            ..preparation.clone()
        };
        let mut pods = Pods::new(Vec::new());
        let first = ReadyTrace::new(trace(150), blind)
            .next(&mut pods)
            .expect("made ready")
            .expect("a request");
        assert!(
            first.inference.is_none(),
            "no body for a router that reads none"
        );
    }
}
