//! Up/down state of a pod with hysteresis, so one slow scrape does not flap it.

/// How many consecutive scrape results it takes to change a pod's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthPolicy {
    /// Consecutive failed scrapes that take an up pod out.
    pub failures_to_mark_down: u32,
    /// Consecutive successful scrapes that bring a down pod back.
    pub successes_to_mark_up: u32,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy {
            failures_to_mark_down: 3,
            successes_to_mark_up: 2,
        }
    }
}

/// Scrape history of one pod.
///
/// A pod that has never been up joins on its first successful scrape: there is no
/// flapping to damp yet, and waiting would only delay a new pod's first request.
#[derive(Debug, Clone, Default)]
pub struct HealthTracker {
    up: bool,
    ever_up: bool,
    consecutive_failures: u32,
    consecutive_successes: u32,
}

impl HealthTracker {
    pub fn is_up(&self) -> bool {
        self.up
    }

    pub fn record_success(&mut self, policy: &HealthPolicy) {
        self.consecutive_failures = 0;
        self.consecutive_successes = self.consecutive_successes.saturating_add(1);
        if !self.up && (!self.ever_up || self.consecutive_successes >= policy.successes_to_mark_up)
        {
            self.up = true;
            self.ever_up = true;
        }
    }

    /// The gateway could not connect to the pod: out at once, without waiting for
    /// scrapes to fail, and back like any pod that went down.
    pub fn record_unreachable(&mut self, policy: &HealthPolicy) {
        self.consecutive_successes = 0;
        self.consecutive_failures = self.consecutive_failures.max(policy.failures_to_mark_down);
        self.up = false;
    }

    pub fn record_failure(&mut self, policy: &HealthPolicy) {
        self.consecutive_successes = 0;
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        if self.up && self.consecutive_failures >= policy.failures_to_mark_down {
            self.up = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: HealthPolicy = HealthPolicy {
        failures_to_mark_down: 3,
        successes_to_mark_up: 2,
    };

    #[test]
    fn a_new_pod_comes_up_on_its_first_success() {
        let mut tracker = HealthTracker::default();
        assert!(!tracker.is_up());
        tracker.record_success(&POLICY);
        assert!(tracker.is_up());
    }

    #[test]
    fn an_up_pod_survives_fewer_failures_than_the_threshold() {
        let mut tracker = HealthTracker::default();
        tracker.record_success(&POLICY);
        tracker.record_failure(&POLICY);
        tracker.record_failure(&POLICY);
        assert!(tracker.is_up());
        tracker.record_success(&POLICY);
        tracker.record_failure(&POLICY);
        tracker.record_failure(&POLICY);
        assert!(tracker.is_up(), "a success in between resets the count");
        tracker.record_failure(&POLICY);
        assert!(!tracker.is_up());
    }

    #[test]
    fn an_unreachable_pod_goes_down_at_once_and_returns_like_any_down_pod() {
        let mut tracker = HealthTracker::default();
        tracker.record_success(&POLICY);
        tracker.record_unreachable(&POLICY);
        assert!(!tracker.is_up());
        tracker.record_success(&POLICY);
        assert!(!tracker.is_up(), "one scrape is not enough to return");
        tracker.record_success(&POLICY);
        assert!(tracker.is_up());
    }

    #[test]
    fn a_pod_that_went_down_needs_several_successes_to_return() {
        let mut tracker = HealthTracker::default();
        tracker.record_success(&POLICY);
        for _ in 0..3 {
            tracker.record_failure(&POLICY);
        }
        assert!(!tracker.is_up());
        tracker.record_success(&POLICY);
        assert!(!tracker.is_up());
        tracker.record_success(&POLICY);
        assert!(tracker.is_up());
    }
}
