//! Optimistic in-flight accounting for one pod.
//!
//! A scrape tells us the pod's KV use *as of when the scrape started*. Requests kvroute
//! sent after that moment are invisible in it, so a burst between two scrapes would all
//! see the same free KV and herd onto the same pod. Each routed request therefore
//! reserves its token estimate here; the reservation stops counting against the pod's
//! free KV once a scrape that *started after* the request was sent has succeeded (the pod
//! then reports the request itself), or when the request finishes, whichever comes first.
//! The in-flight request count is held until the request finishes.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Load counters of one pod, shared by the pod store, snapshots and reservations.
#[derive(Debug, Default)]
pub struct PodLoad {
    inflight: AtomicU32,
    unscraped_tokens: AtomicU64,
    /// Prompt tokens of requests sent here that have not yet streamed a first token: the
    /// prefill work queued ahead of a new request, known without waiting for a scrape.
    prefill_tokens: AtomicU64,
    ledger: Mutex<Ledger>,
    /// Keys of the LoRA adapters kvroute last sent here, most recent first (0: empty).
    /// vLLM reports only the adapters of requests running *now*; an adapter whose
    /// requests just finished usually still sits in a GPU slot, and this remembers it.
    /// Readers load the slots without the lock: a torn read only blurs a heuristic.
    recent_adapters: [AtomicU64; RECENT_ADAPTERS],
    recent_adapters_lock: Mutex<()>,
}

/// How many adapters [`PodLoad`] remembers per pod (vLLM's `--max-loras` is rarely more).
pub const RECENT_ADAPTERS: usize = 8;

/// A non-zero key for an adapter name (FNV-1a), computed once per request.
pub fn adapter_key(name: &str) -> u64 {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    hash.max(1)
}

#[derive(Debug, Default)]
struct Ledger {
    /// Number of scrapes started so far; a request sent now is tagged with it.
    scrapes_started: u64,
    /// Tokens of live requests not yet covered by a successful scrape, per tag.
    /// Holds one or two entries in practice (one per scrape in progress).
    pending: Vec<(u64, u64)>,
}

impl Ledger {
    fn total(&self) -> u64 {
        self.pending.iter().map(|(_, tokens)| tokens).sum()
    }
}

impl PodLoad {
    /// Counters with given values, for snapshots built by hand (tests, benchmarks,
    /// offline simulation).
    pub fn with_values(inflight: u32, unscraped_tokens: u64) -> Self {
        let load = PodLoad::default();
        load.inflight.store(inflight, Ordering::Relaxed);
        load.unscraped_tokens
            .store(unscraped_tokens, Ordering::Relaxed);
        if unscraped_tokens > 0 {
            load.lock().pending.push((0, unscraped_tokens));
        }
        load
    }

    /// Requests kvroute sent to this pod that have not finished.
    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Tokens of in-flight requests that the last successful scrape cannot have seen.
    pub fn unscraped_tokens(&self) -> u64 {
        self.unscraped_tokens.load(Ordering::Relaxed)
    }

    /// Prompt tokens of requests sent here still waiting for their first token.
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Ledger> {
        // A panic while holding this lock cannot leave the ledger inconsistent in a way
        // worse than a stale estimate, so recover from poisoning instead of propagating.
        self.ledger
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Counts a request of `tokens` (prompt + expected output), `prompt_tokens` of which
    /// wait for prefill, as sent to this pod. Dropping the returned reservation releases
    /// it; [`Reservation::first_token`] ends its prefill earlier.
    pub fn reserve(self: &Arc<Self>, tokens: u64, prompt_tokens: u64) -> Reservation {
        let tag = {
            let mut ledger = self.lock();
            let tag = ledger.scrapes_started;
            match ledger.pending.iter_mut().find(|(t, _)| *t == tag) {
                Some((_, sum)) => *sum += tokens,
                None => ledger.pending.push((tag, tokens)),
            }
            self.unscraped_tokens
                .store(ledger.total(), Ordering::Relaxed);
            tag
        };
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.prefill_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        Reservation {
            load: Arc::clone(self),
            tag,
            tokens,
            prefill_tokens: prompt_tokens,
        }
    }

    /// Remembers that a request for the adapter with `key` was sent here.
    pub fn note_adapter(&self, key: u64) {
        let _writer = self
            .recent_adapters_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let current: Vec<u64> = self
            .recent_adapters
            .iter()
            .map(|slot| slot.load(Ordering::Relaxed))
            .collect();
        let others = current.into_iter().filter(|&k| k != key && k != 0);
        let order = std::iter::once(key)
            .chain(others)
            .chain(std::iter::repeat(0));
        for (slot, value) in self.recent_adapters.iter().zip(order) {
            slot.store(value, Ordering::Relaxed);
        }
    }

    /// How recently the adapter with `key` was sent here among the remembered ones:
    /// 0 for the most recent; `None` if not remembered.
    pub fn adapter_recency(&self, key: u64) -> Option<usize> {
        self.recent_adapters
            .iter()
            .position(|slot| slot.load(Ordering::Relaxed) == key)
    }

    /// Marks the start of a scrape; pass the ticket to [`PodLoad::scrape_succeeded`].
    pub fn scrape_started(&self) -> ScrapeTicket {
        let mut ledger = self.lock();
        ledger.scrapes_started += 1;
        ScrapeTicket(ledger.scrapes_started)
    }

    /// A scrape that started with `ticket` succeeded: every request sent before it started
    /// is now part of the pod's own report.
    pub fn scrape_succeeded(&self, ticket: ScrapeTicket) {
        let mut ledger = self.lock();
        ledger.pending.retain(|(tag, _)| *tag >= ticket.0);
        self.unscraped_tokens
            .store(ledger.total(), Ordering::Relaxed);
    }

    fn release(&self, tag: u64, tokens: u64) {
        {
            let mut ledger = self.lock();
            if let Some(index) = ledger.pending.iter().position(|(t, _)| *t == tag) {
                let sum = &mut ledger.pending[index].1;
                *sum = sum.saturating_sub(tokens);
                if *sum == 0 {
                    ledger.pending.swap_remove(index);
                }
            }
            self.unscraped_tokens
                .store(ledger.total(), Ordering::Relaxed);
        }
        // Never underflows: every decrement pairs with the increment in `reserve`.
        self.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Proof that a scrape started at a given point of the ledger.
#[derive(Debug, Clone, Copy)]
pub struct ScrapeTicket(u64);

/// A request counted against a pod; released when dropped.
#[derive(Debug)]
pub struct Reservation {
    load: Arc<PodLoad>,
    tag: u64,
    tokens: u64,
    /// Prompt tokens still counted as waiting for prefill (0 after the first token).
    prefill_tokens: u64,
}

impl Reservation {
    /// The pod streamed the request's first token: its prefill is done. Idempotent.
    pub fn first_token(&mut self) {
        let tokens = std::mem::take(&mut self.prefill_tokens);
        if tokens > 0 {
            // Never underflows: pairs with the increment in `reserve`.
            self.load
                .prefill_tokens
                .fetch_sub(tokens, Ordering::Relaxed);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.first_token();
        self.load.release(self.tag, self.tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_counts_until_dropped() {
        let load = Arc::new(PodLoad::default());
        let first = load.reserve(100, 0);
        let second = load.reserve(50, 0);
        assert_eq!(load.inflight(), 2);
        assert_eq!(load.unscraped_tokens(), 150);
        drop(first);
        assert_eq!(load.inflight(), 1);
        assert_eq!(load.unscraped_tokens(), 50);
        drop(second);
        assert_eq!(load.inflight(), 0);
        assert_eq!(load.unscraped_tokens(), 0);
    }

    #[test]
    fn a_scrape_started_after_the_request_absorbs_its_tokens_but_not_its_count() {
        let load = Arc::new(PodLoad::default());
        let request = load.reserve(100, 0);
        let ticket = load.scrape_started();
        load.scrape_succeeded(ticket);
        assert_eq!(load.unscraped_tokens(), 0);
        assert_eq!(load.inflight(), 1);
        drop(request);
        assert_eq!(load.unscraped_tokens(), 0);
        assert_eq!(load.inflight(), 0);
    }

    #[test]
    fn a_scrape_started_before_the_request_does_not_absorb_it() {
        let load = Arc::new(PodLoad::default());
        let ticket = load.scrape_started();
        let _request = load.reserve(100, 0);
        load.scrape_succeeded(ticket);
        assert_eq!(load.unscraped_tokens(), 100);
        let next = load.scrape_started();
        load.scrape_succeeded(next);
        assert_eq!(load.unscraped_tokens(), 0);
    }

    #[test]
    fn recently_sent_adapters_are_remembered_most_recent_first() {
        let load = PodLoad::default();
        let (a, b, c) = (adapter_key("a"), adapter_key("b"), adapter_key("c"));
        assert_eq!(load.adapter_recency(a), None);
        load.note_adapter(a);
        load.note_adapter(b);
        load.note_adapter(c);
        load.note_adapter(a);
        assert_eq!(load.adapter_recency(a), Some(0));
        assert_eq!(load.adapter_recency(c), Some(1));
        assert_eq!(load.adapter_recency(b), Some(2));
        for n in 0..RECENT_ADAPTERS {
            load.note_adapter(adapter_key(&format!("other-{n}")));
        }
        assert_eq!(
            load.adapter_recency(a),
            None,
            "only the last few are remembered"
        );
    }

    #[test]
    fn prompt_tokens_wait_for_prefill_until_the_first_token_or_the_end() {
        let load = Arc::new(PodLoad::default());
        let mut streaming = load.reserve(300, 200);
        let failed = load.reserve(90, 80);
        assert_eq!(load.prefill_tokens(), 280);
        streaming.first_token();
        streaming.first_token();
        assert_eq!(load.prefill_tokens(), 80, "counted off once");
        drop(failed);
        assert_eq!(load.prefill_tokens(), 0, "a request that ends unstreamed");
        drop(streaming);
        assert_eq!(load.prefill_tokens(), 0);
    }

    #[test]
    fn a_failed_scrape_absorbs_nothing() {
        let load = Arc::new(PodLoad::default());
        let _request = load.reserve(100, 0);
        let _failed = load.scrape_started();
        let _also_failed = load.scrape_started();
        assert_eq!(load.unscraped_tokens(), 100);
    }

    #[test]
    fn releasing_after_absorption_does_not_subtract_twice() {
        let load = Arc::new(PodLoad::default());
        let old = load.reserve(100, 0);
        let ticket = load.scrape_started();
        let new = load.reserve(40, 0);
        load.scrape_succeeded(ticket);
        drop(old);
        assert_eq!(load.unscraped_tokens(), 40);
        drop(new);
        assert_eq!(load.unscraped_tokens(), 0);
    }
}
