//! Shutdown phases as named types. Stopping has two steps: stop (readiness turns off; the
//! health, admin and metrics servers end gracefully; decision watchers end), then, after
//! the drain timeout, abort: the ext_proc server stops accepting, requests still waiting
//! for a route are answered 503, and the open streams end. Each step is a [`Phase`]: fired once,
//! never cleared, awaited by any number of tasks.

use tokio::sync::watch;

/// Fires a [`Phase`]. Dropping it fires the phase too: whoever could fire it is gone,
/// and with it the server the phase belongs to.
#[derive(Debug)]
pub struct Trigger(watch::Sender<bool>);

/// A shutdown phase tasks wait for; cheap to clone.
#[derive(Debug, Clone)]
pub struct Phase(watch::Receiver<bool>);

/// A new, pending phase and its trigger.
pub fn phase() -> (Trigger, Phase) {
    let (trigger, phase) = watch::channel(false);
    (Trigger(trigger), Phase(phase))
}

impl Trigger {
    pub fn fire(&self) {
        self.0.send_replace(true);
    }
}

impl Phase {
    /// Resolves once the phase has fired or its trigger was dropped.
    pub async fn fired(&self) {
        let mut receiver = self.0.clone();
        let _ = receiver.wait_for(|fired| *fired).await;
    }

    /// [`Phase::fired`] as an owned future, for servers that want `'static` signals.
    pub async fn into_fired(self) {
        self.fired().await;
    }

    pub fn has_fired(&self) -> bool {
        *self.0.borrow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waiters_resolve_once_the_phase_fires_and_later_waiters_at_once() {
        let (trigger, phase) = phase();
        let waiter = tokio::spawn({
            let phase = phase.clone();
            async move { phase.fired().await }
        });
        assert!(!phase.has_fired());
        trigger.fire();
        waiter.await.expect("waiter ends");
        phase.fired().await;
        assert!(phase.has_fired());
    }

    #[tokio::test]
    async fn a_dropped_trigger_releases_the_waiters() {
        let (trigger, phase) = phase();
        let waiter = tokio::spawn({
            let phase = phase.clone();
            async move { phase.fired().await }
        });
        drop(trigger);
        waiter.await.expect("waiter ends");
    }
}
