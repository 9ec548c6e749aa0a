//! When which fault strikes: a pure plan spread over the run, so that a run of a given
//! length and set of faults always injects the same ones at the same times.
//!
//! The run is cut into evenly spaced slots between 10 % and 90 % of its length, one per
//! `--fault-every` (at least one per kind asked for). kvroute's restarts take the slots
//! nearest 25 % and 40 % of the run, so the second half runs one kvroute process whose memory
//! can be followed; the pod faults take the other slots in turn, each on the next pod.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A kind of fault.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL a pod; start it again on the same port after [`POD_DOWN`].
    PodKill,
    /// A pod's `/metrics` hangs for [`METRICS_FAULT`] (the simulator's fault switch).
    MetricsHang,
    /// A pod's `/metrics` answers garbage for [`METRICS_FAULT`].
    MetricsGarbage,
    /// SIGTERM kvroute (it drains), then start it again on the same ports.
    KvrouteRestart,
    /// SIGKILL kvroute, then start it again on the same ports.
    KvrouteKill,
}

impl FaultKind {
    /// Every kind, in the order pod faults take turns.
    pub const ALL: [FaultKind; 5] = [
        FaultKind::PodKill,
        FaultKind::MetricsHang,
        FaultKind::MetricsGarbage,
        FaultKind::KvrouteRestart,
        FaultKind::KvrouteKill,
    ];

    /// The name used in flags and reports.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::PodKill => "pod-kill",
            FaultKind::MetricsHang => "metrics-hang",
            FaultKind::MetricsGarbage => "metrics-garbage",
            FaultKind::KvrouteRestart => "kvroute-restart",
            FaultKind::KvrouteKill => "kvroute-kill",
        }
    }

    fn hits_kvroute(self) -> bool {
        matches!(self, FaultKind::KvrouteRestart | FaultKind::KvrouteKill)
    }

    /// Where in the run (a fraction of its length) a kvroute fault goes.
    fn kvroute_fraction(self) -> f64 {
        match self {
            FaultKind::KvrouteKill => 0.40,
            _ => 0.25,
        }
    }
}

/// How long a killed pod stays down before it is started again.
pub const POD_DOWN: Duration = Duration::from_secs(3);
/// How long a `/metrics` fault lasts.
pub const METRICS_FAULT: Duration = Duration::from_secs(10);

/// One planned fault.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PlannedFault {
    /// Seconds after the load starts.
    pub at_s: f64,
    /// What.
    pub kind: FaultKind,
    /// On which pod (pod faults only).
    pub pod: Option<usize>,
}

/// The faults of a run of `duration` over `pods` pods: `kinds` (each at least once; kvroute
/// faults exactly once), one slot per `every`.
pub fn plan(
    duration: Duration,
    every: Duration,
    kinds: &[FaultKind],
    pods: usize,
) -> Vec<PlannedFault> {
    let mut kinds: Vec<FaultKind> = kinds.to_vec();
    kinds.sort();
    kinds.dedup();
    if kinds.is_empty() || pods == 0 {
        return Vec::new();
    }
    let length = duration.as_secs_f64();
    let by_interval = if every.is_zero() {
        0
    } else {
        (length / every.as_secs_f64()).floor() as usize
    };
    let slots = by_interval.max(kinds.len());
    let fraction = |slot: usize| 0.1 + 0.8 * (slot as f64 + 0.5) / slots as f64;
    let mut taken: Vec<Option<FaultKind>> = vec![None; slots];
    for kind in kinds.iter().copied().filter(|k| k.hits_kvroute()) {
        let free = (0..slots).filter(|&s| taken[s].is_none()).min_by(|&a, &b| {
            let distance = |s: usize| (fraction(s) - kind.kvroute_fraction()).abs();
            distance(a).total_cmp(&distance(b))
        });
        if let Some(slot) = free {
            taken[slot] = Some(kind);
        }
    }
    let pod_kinds: Vec<FaultKind> = kinds
        .iter()
        .copied()
        .filter(|k| !k.hits_kvroute())
        .collect();
    let mut turn = 0usize;
    let mut faults = Vec::with_capacity(slots);
    for (slot, kind) in taken.into_iter().enumerate() {
        let at_s = length * fraction(slot);
        match kind {
            Some(kind) => faults.push(PlannedFault {
                at_s,
                kind,
                pod: None,
            }),
            None if !pod_kinds.is_empty() => {
                faults.push(PlannedFault {
                    at_s,
                    kind: pod_kinds[turn % pod_kinds.len()],
                    pod: Some(turn % pods),
                });
                turn += 1;
            }
            None => {}
        }
    }
    faults
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn a_short_run_still_gets_every_kind_once_with_kvroute_in_the_first_half() {
        let faults = plan(2 * MINUTE, MINUTE, &FaultKind::ALL, 4);
        assert_eq!(faults.len(), 5);
        let mut kinds: Vec<FaultKind> = faults.iter().map(|f| f.kind).collect();
        kinds.sort();
        assert_eq!(kinds, FaultKind::ALL.to_vec());
        for f in &faults {
            assert!((12.0..=108.0).contains(&f.at_s), "{f:?} inside 10..90 %");
            assert_eq!(f.pod.is_some(), !f.kind.hits_kvroute());
            if f.kind.hits_kvroute() {
                assert!(f.at_s < 60.0, "{f:?} in the first half");
            }
        }
        // 80 % of the run shared by five slots: 19.2 s apart, longer than any fault.
        assert!(faults.windows(2).all(|w| w[1].at_s - w[0].at_s > 19.0));
    }

    #[test]
    fn a_long_run_spreads_pod_faults_over_every_pod_and_restarts_kvroute_once_each() {
        let faults = plan(30 * MINUTE, MINUTE, &FaultKind::ALL, 4);
        assert_eq!(faults.len(), 30);
        let count = |k: FaultKind| faults.iter().filter(|f| f.kind == k).count();
        assert_eq!(count(FaultKind::KvrouteRestart), 1);
        assert_eq!(count(FaultKind::KvrouteKill), 1);
        assert!(count(FaultKind::PodKill) >= 9);
        for pod in 0..4 {
            assert!(faults.iter().any(|f| f.pod == Some(pod)), "pod {pod}");
        }
        let kvroute: Vec<f64> = faults
            .iter()
            .filter(|f| f.kind.hits_kvroute())
            .map(|f| f.at_s)
            .collect();
        assert!(kvroute.iter().all(|t| *t < 900.0), "{kvroute:?}");
        // Faults never overlap: a pod is back and a metrics fault over before the next.
        let gap = faults
            .windows(2)
            .map(|w| w[1].at_s - w[0].at_s)
            .fold(f64::MAX, f64::min);
        assert!(gap > METRICS_FAULT.as_secs_f64() + 10.0, "gap {gap}");
    }

    #[test]
    fn only_the_kinds_asked_for_are_planned() {
        let faults = plan(Duration::from_secs(12), MINUTE, &[FaultKind::PodKill], 2);
        assert_eq!(
            faults,
            vec![PlannedFault {
                at_s: 6.0,
                kind: FaultKind::PodKill,
                pod: Some(0)
            }]
        );
        assert!(plan(MINUTE, MINUTE, &[], 2).is_empty());
    }
}
