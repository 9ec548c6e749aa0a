//! Stage 3: the winner and the runners-up. The best total wins; candidates within
//! [`TIE_EPSILON`] of it tie, and the tie is broken at random (the n-th tied candidate in
//! snapshot order, which is deterministic, so the choice depends only on the draw).

use super::filter::Filtered;
use super::score::Scorer;
use super::{CandidateScore, SchedulerConfig};

/// Scores within this distance count as a tie, broken at random.
pub(super) const TIE_EPSILON: f64 = 1e-9;

/// The outcome of ranking.
pub(super) struct Ranking {
    pub(super) winner: CandidateScore,
    /// The next best, best first: enough for the fallbacks and the decision trace.
    pub(super) ranked: Vec<CandidateScore>,
    /// How many candidates the soft filters accepted.
    pub(super) accepted: usize,
}

/// Ranks the accepted candidates in one pass: every total (kept for the tie-break), the
/// best total, how many share it, and the best few in order. The full breakdown is
/// computed only for the few that are kept. `draw`, uniform over `u64`, breaks the tie.
pub(super) fn rank(
    filtered: &Filtered,
    scorer: &Scorer<'_>,
    config: &SchedulerConfig,
    draw: u64,
) -> Ranking {
    let runners_up = runners_up(config);
    let mut scan = Scan::new(filtered.candidates.len(), kept(config));
    if filtered.partials.is_empty() {
        for (position, candidate) in filtered.competing() {
            scan.offer(position, scorer.total(candidate));
        }
    } else {
        // Scored in the filter's pass but for the in-flight term; every candidate competes.
        for (position, (candidate, partial)) in filtered
            .candidates
            .iter()
            .zip(&filtered.partials)
            .enumerate()
        {
            scan.offer(position, scorer.complete(partial, candidate.inflight));
        }
    }
    let Scan {
        totals,
        best,
        tied,
        top,
    } = scan;
    let nth = nth_of(draw, tied.max(1));
    // The soft filters never empty the set, so some candidate is always accepted.
    let winner = totals
        .iter()
        .filter(|(total, _)| *total >= best - TIE_EPSILON)
        .nth(nth)
        .map_or(0, |&(_, position)| position);
    let breakdown = |position: u32| scorer.breakdown(&filtered.candidates[position as usize]);
    Ranking {
        winner: breakdown(winner),
        ranked: top
            .into_sorted()
            .into_iter()
            .filter(|&position| position != winner)
            .take(runners_up)
            .map(breakdown)
            .collect(),
        accepted: filtered.accepted,
    }
}

/// `draw`, uniform over `u64`, as an index uniform over `0..n` (to within `n / 2⁶⁴`): the
/// high word of `draw × n`. One draw whatever `n`, so a pick that stops before ranking can
/// take the same draw and leave the generator where a full pick would.
fn nth_of(draw: u64, n: usize) -> usize {
    ((u128::from(draw) * n as u128) >> 64) as usize
}

/// The runners-up a decision names: its fallbacks, and the trace's candidates but the
/// winner.
fn runners_up(config: &SchedulerConfig) -> usize {
    config
        .fallbacks
        .max(config.trace_candidates.saturating_sub(1))
}

/// How many of the best totals the ranking keeps in order: one more than the runners-up,
/// in case the winner drawn from a tie is among them. A candidate whose total falls
/// below this many others' by more than [`TIE_EPSILON`] changes nothing in the ranking.
pub(super) fn kept(config: &SchedulerConfig) -> usize {
    runners_up(config) + 2
}

/// What ranking keeps of the totals, offered in candidate order.
struct Scan {
    /// Every total with its candidate's position (for the tie-break).
    totals: Vec<(f64, u32)>,
    best: f64,
    /// How many totals lie within [`TIE_EPSILON`] of `best`.
    tied: usize,
    top: TopK,
}

impl Scan {
    fn new(candidates: usize, k: usize) -> Self {
        Scan {
            totals: Vec::with_capacity(candidates),
            best: f64::NEG_INFINITY,
            tied: 0,
            top: TopK::new(k),
        }
    }

    #[inline(always)]
    fn offer(&mut self, position: usize, total: f64) {
        let position = position as u32;
        if total > self.best + TIE_EPSILON {
            self.best = total;
            self.tied = 1;
        } else if total >= self.best - TIE_EPSILON {
            self.tied += 1;
        }
        self.totals.push((total, position));
        self.top.offer(total, position);
    }
}

/// The `k` highest totals seen, best first; ties keep the earlier one.
struct TopK {
    k: usize,
    entries: Vec<(f64, u32)>,
}

impl TopK {
    fn new(k: usize) -> Self {
        TopK {
            k,
            entries: Vec::with_capacity(k + 1),
        }
    }

    #[inline]
    fn offer(&mut self, total: f64, position: u32) {
        if self.entries.len() == self.k && self.entries.last().is_some_and(|last| total <= last.0) {
            return;
        }
        let at = self.entries.partition_point(|entry| entry.0 >= total);
        self.entries.insert(at, (total, position));
        self.entries.truncate(self.k);
    }

    fn into_sorted(self) -> Vec<u32> {
        self.entries
            .into_iter()
            .map(|(_, position)| position)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::nth_of;

    #[test]
    fn a_draw_maps_onto_every_index_in_equal_shares() {
        assert_eq!(nth_of(0, 1), 0);
        assert_eq!(nth_of(u64::MAX, 1), 0);
        assert_eq!(nth_of(u64::MAX, 7), 6);
        // Draws spread evenly over the u64 range land evenly over the indexes.
        let n = 5;
        let mut shares = [0usize; 5];
        let step = u64::MAX / 1_000;
        for k in 0..1_000 {
            shares[nth_of(k * step, n)] += 1;
        }
        // (Each boundary draw falls just below its index: one draw moves per boundary.)
        assert!(shares.iter().all(|&s| s.abs_diff(200) <= 1), "{shares:?}");
    }
}
