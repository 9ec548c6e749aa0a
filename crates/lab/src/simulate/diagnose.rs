//! `--diagnose N`: what a simulation's placement did, for finding out why it did it.
//!
//! Three files per run, beside the report: `<workload>-<policy>-decisions.jsonl`, every
//! N-th kvroute decision as a JSON line (virtual time, step, the request's tenant, the
//! winner's pod, the relaxed soft filters and the best candidates' score breakdowns, as the
//! gateway's decision trace shows them); `<workload>-<policy>-pods.csv`, each pod's state
//! at every fleet sample (queue, running requests, KV use, requests in flight and requests
//! routed to it since the step began); and `<workload>-<policy>-requests.csv`, every N-th
//! completed request's outcome (when it arrived, where it ran, which replica routed it,
//! its wait at the gateway and at the pod, its cached tokens), which finds the moments a
//! tail latency comes from. The counts of relaxed filters over every
//! decision go to `simulation.json` whether or not the files are written.

use std::fs::File;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use kvroute_core::scheduler::Decision;

use super::trace::TraceRequest;

/// One pod's state at a fleet sample.
#[derive(Debug, Clone, Copy)]
pub struct PodSample {
    pub waiting: usize,
    pub running: usize,
    pub kv_usage: f64,
    pub inflight: u32,
    pub routed: u32,
}

/// The diagnostic files of one run.
pub struct Diagnostics {
    every: u64,
    seen: u64,
    decisions: BufWriter<File>,
    pods: BufWriter<File>,
    completed: u64,
    requests: BufWriter<File>,
    /// The first failed write of a request's line, reported by [`Diagnostics::finish`]
    /// (requests complete where the simulation has no error to return).
    request_error: Option<std::io::Error>,
}

/// One completed request's outcome.
#[derive(Debug, Clone, Copy)]
pub struct RequestOutcome {
    /// Virtual seconds at which it reached the gateway.
    pub arrived: f64,
    pub step: usize,
    pub pod: usize,
    pub replica: usize,
    /// Seconds held at the gateway before it was sent.
    pub waited: f64,
    /// Seconds from reaching the pod to its first token.
    pub pod_ttft: f64,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
}

#[derive(Serialize)]
struct DecisionLine<'a> {
    t: f64,
    step: usize,
    /// The shared system prompt's tenant (a hash of its words and copy), if any.
    tenant: Option<String>,
    pod: usize,
    decision: &'a Decision,
}

/// A short name for the tenant whose system prompt `request` shares.
fn tenant(request: &TraceRequest) -> Option<String> {
    request.system.as_ref().map(|system| {
        let mut h = DefaultHasher::new();
        system.words.hash(&mut h);
        system.copy.hash(&mut h);
        format!("{:08x}", h.finish() as u32)
    })
}

impl Diagnostics {
    /// Creates the files for `stem` (`<workload>-<policy>`) in `dir`, keeping every
    /// `every`-th decision.
    pub fn create(dir: &Path, stem: &str, every: u64) -> anyhow::Result<Self> {
        let open = |name: String| -> anyhow::Result<BufWriter<File>> {
            let path = dir.join(name);
            let file =
                File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
            Ok(BufWriter::new(file))
        };
        let mut pods = open(format!("{stem}-pods.csv"))?;
        writeln!(pods, "t,step,pod,waiting,running,kv_usage,inflight,routed")?;
        let mut requests = open(format!("{stem}-requests.csv"))?;
        writeln!(
            requests,
            "arrived,step,pod,replica,waited_s,pod_ttft_s,ttft_s,prompt_tokens,cached_tokens"
        )?;
        Ok(Diagnostics {
            every: every.max(1),
            seen: 0,
            decisions: open(format!("{stem}-decisions.jsonl"))?,
            pods,
            completed: 0,
            requests,
            request_error: None,
        })
    }

    /// A kvroute decision for `request`, placed on `pod` at virtual time `t`.
    pub fn decision(
        &mut self,
        t: f64,
        step: usize,
        request: &TraceRequest,
        pod: usize,
        decision: &Decision,
    ) -> anyhow::Result<()> {
        self.seen += 1;
        if !(self.seen - 1).is_multiple_of(self.every) {
            return Ok(());
        }
        let line = DecisionLine {
            t,
            step,
            tenant: tenant(request),
            pod,
            decision,
        };
        serde_json::to_writer(&mut self.decisions, &line)?;
        self.decisions.write_all(b"\n")?;
        Ok(())
    }

    /// Every pod's state at virtual time `t`.
    pub fn pods(&mut self, t: f64, step: usize, pods: &[PodSample]) -> anyhow::Result<()> {
        for (i, p) in pods.iter().enumerate() {
            writeln!(
                self.pods,
                "{t:.3},{step},{i},{},{},{:.4},{},{}",
                p.waiting, p.running, p.kv_usage, p.inflight, p.routed
            )?;
        }
        Ok(())
    }

    /// A request that completed; every `every`-th is written.
    pub fn request(&mut self, r: &RequestOutcome) {
        self.completed += 1;
        if !(self.completed - 1).is_multiple_of(self.every) || self.request_error.is_some() {
            return;
        }
        let written = writeln!(
            self.requests,
            "{:.4},{},{},{},{:.4},{:.4},{:.4},{},{}",
            r.arrived,
            r.step,
            r.pod,
            r.replica,
            r.waited,
            r.pod_ttft,
            r.waited + r.pod_ttft,
            r.prompt_tokens,
            r.cached_tokens
        );
        if let Err(e) = written {
            self.request_error = Some(e);
        }
    }

    pub fn finish(mut self) -> anyhow::Result<()> {
        if let Some(e) = self.request_error.take() {
            return Err(e).context("cannot write a request's outcome");
        }
        self.decisions.flush()?;
        self.pods.flush()?;
        self.requests.flush()?;
        Ok(())
    }
}
