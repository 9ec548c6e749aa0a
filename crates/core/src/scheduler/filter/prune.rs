//! Leaving out, in the pass that scores the pods passing every filter, the pods whose
//! total cannot reach the ranking's kept few ([`Prune`]): the ranking comes out the same.

use crate::fleet::Fleet;
use crate::scheduler::filter::Candidate;
use crate::scheduler::rank::TIE_EPSILON;
use crate::scheduler::score::{Partial, Scorer};

/// The fleet size from which [`Prune`] pays for its read of every pod's in-flight count
/// and its bookkeeping.
pub(super) const PRUNE_FROM_PODS: usize = 32;

/// How far below the ranking's kept few a candidate's highest possible total must lie to
/// be dropped: far more than the tie distance plus any rounding of the bounds (scores sum
/// a few terms of at most a few units each).
const PRUNE_MARGIN: f64 = 1e-6;

/// Drops passing pods that cannot reach the ranking's kept few (`rank::kept`), so that they
/// are neither recorded nor ranked. A candidate's total is its partial score plus the
/// weighted in-flight term `1 − inflight / most`, where `most` (the most requests in
/// flight on one passing pod) is known only once every pod is read; it lies between the
/// most seen so far and the most on any pod at all (read before the pass), which bounds
/// each total from below and above. Once `kept` candidates are recorded whose lower
/// bounds reach some value, a candidate whose upper bound falls short of it by more than
/// the tie distance ranks below all of them, so it is neither among the kept few nor tied
/// with the best: the ranking is the same without it. On a fleet where every pod passes,
/// most pods go unrecorded, and the ranking reads only the rest.
pub(super) struct Prune {
    /// The most requests in flight on any pod, read before the pass (a live counter: the
    /// caller checks that no passing pod read more).
    most_anywhere: u32,
    /// `1 / most_anywhere` (0 when no request is in flight anywhere).
    inverse_most_anywhere: f64,
    /// The most requests in flight on one passing pod seen so far, and its inverse.
    most_seen: u32,
    inverse_most_seen: f64,
    /// The lower bounds of the recorded candidates with the highest ones, highest first,
    /// at most `kept` of them.
    best_lower: Vec<f64>,
    kept: usize,
}

impl Prune {
    /// Pruning for a ranking that keeps `kept` totals, with at most `most_anywhere`
    /// requests in flight on any pod.
    pub(super) fn new(most_anywhere: u32, kept: usize) -> Self {
        Prune {
            most_anywhere,
            inverse_most_anywhere: inverse(most_anywhere),
            most_seen: 0,
            inverse_most_seen: 0.0,
            best_lower: Vec::with_capacity(kept + 1),
            kept,
        }
    }

    /// Whether no passing pod had more in flight than the first read found anywhere (each
    /// one went through [`Prune::drops`]): else the upper bounds did not hold, and what was
    /// dropped must be read again.
    pub(super) fn bound_held(&self) -> bool {
        self.most_seen <= self.most_anywhere
    }

    /// Whether the passing candidate `c`, whose weighted LoRA term is `lora`, can be
    /// dropped before it is scored: even its [`Scorer::ceiling`] falls short of the kept
    /// few. Worth asking only where the LoRA term tells pods apart (an adapter request).
    /// A candidate not dropped goes on to [`Prune::drops`].
    #[inline(always)]
    pub(super) fn drops_unscored(&mut self, scorer: &Scorer<'_>, c: &Candidate, lora: f64) -> bool {
        self.saw(c.inflight);
        let Some(floor) = self.floor() else {
            return false;
        };
        let highest = 1.0 - f64::from(c.inflight) * self.inverse_most_anywhere;
        scorer.ceiling(c, lora, highest) < floor - TIE_EPSILON - PRUNE_MARGIN
    }

    /// Counts a passing pod's requests in flight in the most seen.
    #[inline(always)]
    fn saw(&mut self, inflight: u32) {
        if inflight > self.most_seen {
            self.most_seen = inflight;
            self.inverse_most_seen = inverse(inflight);
        }
    }

    /// The lowest of the kept few lower bounds, once there are that many.
    #[inline(always)]
    fn floor(&self) -> Option<f64> {
        (self.best_lower.len() == self.kept).then(|| self.best_lower[self.kept - 1])
    }

    /// Whether the passing candidate with `inflight` requests in flight and `partial`
    /// scores can be dropped; if not, its lower bound is counted.
    #[inline(always)]
    pub(super) fn drops(&mut self, scorer: &Scorer<'_>, partial: &Partial, inflight: u32) -> bool {
        self.saw(inflight);
        // The term `1 − inflight / most` with `most` at its least and its greatest.
        let lowest = 1.0 - f64::from(inflight) * self.inverse_most_seen;
        let highest = 1.0 - f64::from(inflight) * self.inverse_most_anywhere;
        let (lower, upper) = scorer.bounds(partial, lowest, highest);
        let floor = self.floor().unwrap_or(f64::NEG_INFINITY);
        if upper < floor - TIE_EPSILON - PRUNE_MARGIN {
            return true;
        }
        if lower > floor {
            let at = self.best_lower.partition_point(|&kept| kept >= lower);
            self.best_lower.insert(at, lower);
            self.best_lower.truncate(self.kept);
        }
        false
    }
}

/// Whether a pass over passing pods prunes ([`Prune`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pruning {
    /// From [`PRUNE_FROM_PODS`] pods, bounded by the most in flight anywhere, read first.
    Bounded,
    Off,
    /// As if no pod had more than this in flight when the pass began: a request that
    /// arrived at a pod between the two reads of its counter.
    #[cfg(test)]
    AssumingAtMost(u32),
}

/// The most requests in flight on any pod.
pub(super) fn most_inflight_anywhere(fleet: &Fleet) -> u32 {
    fleet
        .rows()
        .map(|(_, load)| load.inflight())
        .max()
        .unwrap_or(0)
}

/// `1 / count`, or 0 for none.
fn inverse(count: u32) -> f64 {
    if count == 0 {
        0.0
    } else {
        1.0 / f64::from(count)
    }
}
