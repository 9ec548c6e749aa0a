//! `--diagnose N`: what a simulation's placement did, for finding out why it did it.
//!
//! Two files per run, beside the report: `<workload>-<policy>-decisions.jsonl`, every N-th
//! kvroute decision as a JSON line (virtual time, step, the request's tenant, the winner's
//! pod, the relaxed soft filters and the best candidates' score breakdowns, as the
//! gateway's decision trace shows them); and `<workload>-<policy>-pods.csv`, each pod's
//! state at every fleet sample (queue, running requests, KV use, requests in flight and
//! requests routed to it since the step began). The counts of relaxed filters over every
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
        Ok(Diagnostics {
            every: every.max(1),
            seen: 0,
            decisions: open(format!("{stem}-decisions.jsonl"))?,
            pods,
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

    pub fn finish(mut self) -> anyhow::Result<()> {
        self.decisions.flush()?;
        self.pods.flush()?;
        Ok(())
    }
}
