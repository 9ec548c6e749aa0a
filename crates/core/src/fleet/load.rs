//! Optimistic in-flight accounting for one pod.
//!
//! A scrape tells us the pod's KV use *as of when the scrape started*, and only the blocks
//! allocated then: not requests still in the pod's queue, nor the output a running request
//! has yet to generate. kvroute therefore keeps three token sums per pod, from the KV each
//! request will need there (its uncached prompt plus its expected output):
//!
//! - **unscraped**: requests sent since the last scrape that started after them. A burst
//!   between two scrapes sees these at once instead of herding onto the same pod. They
//!   leave this sum when such a scrape succeeds, or when the request finishes.
//! - **committed**: every request in flight, until it finishes. vLLM allocates a request's
//!   blocks as it goes and preempts when they run out, so the pod's peak need is what
//!   kvroute sent it, not what it reports now.
//! - **growth**: for streaming requests whose response kvroute sees, the output they will
//!   still add: their expected output less the tokens streamed so far. What they hold
//!   already is in the pod's report (their prompts, once running, are in it too; a queued
//!   request's prompt is in `committed`).
//!
//! The scheduler takes the largest of `reported + queued + unscraped`, `committed` and
//! `reported + growth` as the pod's use, where `queued` is the pod's reported queue at the
//! mean need of kvroute's requests here ([`PodLoad::mean_need`]) and `reported` is the
//! report less what kvroute's requests in it freed since, as they finished
//! ([`PodLoad::released_tokens`]): each is a lower bound of what the pod will need, and
//! none counts a request the pod already reports twice (see
//! [`crate::scheduler::free_kv_tokens`]). The in-flight request count is held until the
//! request finishes.
//!
//! Prompt tokens also count as *queued prefill* until the pod has taken them in: for a
//! streaming request, until its first response bytes (vLLM sends nothing before the first
//! token); a non-streaming request sends nothing until it is complete, so its prefill ends
//! instead when a scrape started after it was sent has succeeded, by when the pod's own
//! queue and batch report it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Load counters of one pod, shared by the pod store, snapshots and reservations.
///
/// A pick reads every pod's counters, mostly from cache lines that the traffic in between
/// has evicted, so the layout is fixed: the counters a pick reads share the first cache
/// line (the pod's `Arc` puts it on a line of its own), and the remembered adapters, read
/// only for adapter requests, the second. Left to the compiler they spread over three.
#[derive(Debug, Default)]
#[repr(C, align(64))]
pub struct PodLoad {
    unscraped_tokens: AtomicU64,
    /// KV tokens of every request in flight here (uncached prompt + expected output).
    committed_tokens: AtomicU64,
    /// Output tokens the observed streaming requests here have yet to generate.
    growth_tokens: AtomicU64,
    /// Prompt tokens of streaming requests sent here that have not yet streamed a first
    /// token: the prefill work queued ahead of a new request, known without a scrape.
    prefill_tokens: AtomicU64,
    /// Prompt tokens of non-streaming requests that no successful scrape has seen yet.
    prefill_unscraped: AtomicU64,
    /// KV tokens of requests that finished since the last successful scrape started, sent
    /// before it: the pod's report still counts blocks they have freed.
    released_tokens: AtomicU64,
    inflight: AtomicU32,
    /// `committed_tokens / inflight` (at most `u32::MAX`), kept as they change so that a
    /// pick over thousands of pods divides nothing.
    mean_need: AtomicU32,
    /// `recent_adapters` summed up on the line a pick reads anyway ([`RecentSummary`]):
    /// for most pods it tells a pick where an adapter stands without reading the line
    /// that lists them.
    recent_summary: AtomicU64,
    /// Keys of the LoRA adapters kvroute last sent here, most recent first (0: empty).
    /// vLLM reports only the adapters of requests running *now*; an adapter whose
    /// requests just finished usually still sits in a GPU slot, and this remembers it.
    /// Readers load the slots without the lock: a torn read only blurs a heuristic.
    recent_adapters: RecentAdapters,
    recent_adapters_lock: Mutex<()>,
    ledger: Mutex<Ledger>,
}

/// [`PodLoad`]'s remembered adapters, on a cache line of their own.
#[derive(Debug, Default)]
#[repr(C, align(64))]
struct RecentAdapters([AtomicU64; RECENT_ADAPTERS]);

/// How many adapters [`PodLoad`] remembers per pod (vLLM's `--max-loras` is rarely more).
pub const RECENT_ADAPTERS: usize = 8;

/// [`PodLoad`]'s remembered adapters in 64 bits: how many there are (the top 8 bits)
/// and, in the other 56, one bit set for each ([`AdapterProbe`]). A clear bit rules an
/// adapter out; a set one may stand for another adapter.
struct RecentSummary;

impl RecentSummary {
    const COUNT_SHIFT: u32 = 56;

    fn of(keys: impl Iterator<Item = u64>) -> u64 {
        let (mut bits, mut count) = (0, 0u64);
        for key in keys.filter(|&key| key != 0) {
            bits |= AdapterProbe::of(key).0;
            count += 1;
        }
        bits | count << Self::COUNT_SHIFT
    }
}

/// An adapter's bit in a [`PodLoad`]'s summary of remembered adapters: its key's high
/// bits, mixed, modulo 56 (FNV-1a's low bits follow the names' last bytes). Computed
/// once per request and asked of every pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterProbe(u64);

impl AdapterProbe {
    pub fn of(key: u64) -> AdapterProbe {
        let position = (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) % 56;
        AdapterProbe(1 << position)
    }
}

const _: () = assert!(RECENT_ADAPTERS < 1 << (64 - RecentSummary::COUNT_SHIFT));

/// A non-zero key for an adapter name (FNV-1a), computed once per request.
pub fn adapter_key(name: &str) -> u64 {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    hash.max(1)
}

/// When a request's prompt stops counting as queued prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillEnd {
    /// At its first response bytes (streaming requests).
    FirstToken,
    /// When a scrape started after it was sent succeeds (non-streaming requests, which
    /// answer only once complete), or at its response, whichever comes first.
    NextScrape,
}

#[derive(Debug, Default)]
struct Ledger {
    /// Number of scrapes started so far; a request sent now is tagged with it.
    scrapes_started: u64,
    /// Tokens of live requests not yet covered by a successful scrape, per tag.
    /// Holds one or two entries in practice (one per scrape in progress).
    pending: Vec<(u64, u64)>,
    /// The same for the prompt tokens of non-streaming requests' queued prefill.
    prefill_pending: Vec<(u64, u64)>,
    /// KV tokens of requests a scrape had seen that finished since, per the number of
    /// scrapes started when they finished: a scrape started after a finish shows it.
    released: Vec<(u64, u64)>,
}

fn total(entries: &[(u64, u64)]) -> u64 {
    entries.iter().map(|(_, tokens)| tokens).sum()
}

/// Adds `tokens` to the entry of `tag`.
fn add(entries: &mut Vec<(u64, u64)>, tag: u64, tokens: u64) {
    match entries.iter_mut().find(|(t, _)| *t == tag) {
        Some((_, sum)) => *sum += tokens,
        None => entries.push((tag, tokens)),
    }
}

/// Takes `tokens` off the entry of `tag`, if a scrape has not absorbed it already;
/// whether there was one.
fn subtract(entries: &mut Vec<(u64, u64)>, tag: u64, tokens: u64) -> bool {
    let Some(index) = entries.iter().position(|(t, _)| *t == tag) else {
        return false;
    };
    let sum = &mut entries[index].1;
    *sum = sum.saturating_sub(tokens);
    if *sum == 0 {
        entries.swap_remove(index);
    }
    true
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

    /// KV tokens the requests in flight here will need at their peak, scraped or not.
    pub fn committed_tokens(&self) -> u64 {
        self.committed_tokens.load(Ordering::Relaxed)
    }

    /// KV tokens of kvroute's requests here that finished after the last successful scrape
    /// saw them: the report still counts what they held, and the pod has freed it. Each
    /// counts its whole need; one that was still queued at that scrape, or never reached
    /// the pod, held nothing in the report, so the estimate errs toward room until the next
    /// scrape.
    pub fn released_tokens(&self) -> u64 {
        self.released_tokens.load(Ordering::Relaxed)
    }

    /// KV tokens a request in flight here needs on average (uncached prompt + expected
    /// output); 0 with none in flight.
    pub fn mean_need(&self) -> u32 {
        self.mean_need.load(Ordering::Relaxed)
    }

    /// Sets [`PodLoad::mean_need`] after a request came or went. Concurrent changes may
    /// interleave between the two loads: the mean is an estimate, and the next change
    /// sets it again.
    fn refresh_mean_need(&self) {
        let inflight = u64::from(self.inflight.load(Ordering::Relaxed));
        let committed = self.committed_tokens.load(Ordering::Relaxed);
        let mean = committed.checked_div(inflight).unwrap_or(0);
        self.mean_need
            .store(u32::try_from(mean).unwrap_or(u32::MAX), Ordering::Relaxed);
    }

    /// Output tokens the streaming requests kvroute watches here have yet to generate:
    /// KV the pod will allocate that its report cannot show.
    pub fn growth_tokens(&self) -> u64 {
        self.growth_tokens.load(Ordering::Relaxed)
    }

    /// Prompt tokens of requests sent here whose prefill the pod has not shown yet.
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill_tokens.load(Ordering::Relaxed) + self.prefill_unscraped.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Ledger> {
        // A panic while holding this lock cannot leave the ledger inconsistent in a way
        // worse than a stale estimate, so recover from poisoning instead of propagating.
        self.ledger
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Counts a request needing `tokens` of KV (uncached prompt + expected output),
    /// `prompt_tokens` of which wait for prefill until `prefill_end`, as sent to this pod.
    /// Dropping the returned reservation releases it; [`Reservation::first_token`] ends its
    /// prefill earlier.
    pub fn reserve(
        self: &Arc<Self>,
        tokens: u64,
        prompt_tokens: u64,
        prefill_end: PrefillEnd,
    ) -> Reservation {
        let tag = {
            let mut ledger = self.lock();
            let tag = ledger.scrapes_started;
            add(&mut ledger.pending, tag, tokens);
            self.unscraped_tokens
                .store(total(&ledger.pending), Ordering::Relaxed);
            if prefill_end == PrefillEnd::NextScrape {
                add(&mut ledger.prefill_pending, tag, prompt_tokens);
                self.prefill_unscraped
                    .store(total(&ledger.prefill_pending), Ordering::Relaxed);
            }
            tag
        };
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.committed_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.refresh_mean_need();
        // Only a request whose first token and streamed tokens kvroute sees can say how
        // much it has yet to allocate.
        let growth = if prefill_end == PrefillEnd::FirstToken {
            self.prefill_tokens
                .fetch_add(prompt_tokens, Ordering::Relaxed);
            let output = tokens.saturating_sub(prompt_tokens);
            self.growth_tokens.fetch_add(output, Ordering::Relaxed);
            Some(output)
        } else {
            None
        };
        Reservation {
            load: Arc::clone(self),
            tag,
            tokens,
            prefill: Some((prefill_end, prompt_tokens)),
            growth,
        }
    }

    /// Remembers that a request for the adapter with `key` was sent here.
    pub fn note_adapter(&self, key: u64) {
        let _writer = self
            .recent_adapters_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let slots = &self.recent_adapters.0;
        let current: [u64; RECENT_ADAPTERS] =
            std::array::from_fn(|i| slots[i].load(Ordering::Relaxed));
        let others = current.into_iter().filter(|&k| k != key && k != 0);
        let order = std::iter::once(key)
            .chain(others)
            .chain(std::iter::repeat(0));
        let mut listed = [0; RECENT_ADAPTERS];
        for ((slot, value), listed) in slots.iter().zip(order).zip(&mut listed) {
            slot.store(value, Ordering::Relaxed);
            *listed = value;
        }
        // After the list, as readers of the list without the lock see it: a torn read
        // of the two only blurs the heuristic, as a torn read of the list does.
        self.recent_summary
            .store(RecentSummary::of(listed.into_iter()), Ordering::Relaxed);
    }

    /// [`PodLoad::adapter_standing`] read from the summary on the counters' cache line
    /// where it can tell: the adapter `probe` stands for not remembered, and how many
    /// are; `None` where the summary may stand for it (ask `adapter_standing` then).
    #[inline]
    pub fn standing_if_not_remembered(
        &self,
        probe: AdapterProbe,
    ) -> Option<(Option<usize>, usize)> {
        let summary = self.recent_summary.load(Ordering::Relaxed);
        (summary & probe.0 == 0).then_some((None, (summary >> RecentSummary::COUNT_SHIFT) as usize))
    }

    /// How recently the adapter with `key` was sent here among the remembered ones:
    /// 0 for the most recent; `None` if not remembered.
    pub fn adapter_recency(&self, key: u64) -> Option<usize> {
        self.adapter_standing(key).0
    }

    /// [`PodLoad::adapter_recency`], and how many distinct adapters kvroute sent here
    /// lately (at most [`RECENT_ADAPTERS`]), in one pass: remembered adapters fill the
    /// list from its start.
    #[inline]
    pub fn adapter_standing(&self, key: u64) -> (Option<usize>, usize) {
        let mut rank = None;
        for (position, slot) in self.recent_adapters.0.iter().enumerate() {
            let remembered = slot.load(Ordering::Relaxed);
            if remembered == 0 {
                return (rank, position);
            }
            if remembered == key {
                rank = Some(position);
            }
        }
        (rank, RECENT_ADAPTERS)
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
        ledger.prefill_pending.retain(|(tag, _)| *tag >= ticket.0);
        ledger.released.retain(|(tag, _)| *tag >= ticket.0);
        self.unscraped_tokens
            .store(total(&ledger.pending), Ordering::Relaxed);
        self.prefill_unscraped
            .store(total(&ledger.prefill_pending), Ordering::Relaxed);
        self.released_tokens
            .store(total(&ledger.released), Ordering::Relaxed);
    }

    /// A non-streaming request answered: its prefill is over, absorbed or not.
    fn end_unscraped_prefill(&self, tag: u64, tokens: u64) {
        let mut ledger = self.lock();
        subtract(&mut ledger.prefill_pending, tag, tokens);
        self.prefill_unscraped
            .store(total(&ledger.prefill_pending), Ordering::Relaxed);
    }

    fn release(&self, tag: u64, tokens: u64) {
        {
            let mut ledger = self.lock();
            if subtract(&mut ledger.pending, tag, tokens) {
                self.unscraped_tokens
                    .store(total(&ledger.pending), Ordering::Relaxed);
            } else {
                // A scrape saw it (running, or queued), and the report still counts it
                // until a scrape that starts from now on.
                let now = ledger.scrapes_started;
                add(&mut ledger.released, now, tokens);
                self.released_tokens
                    .store(total(&ledger.released), Ordering::Relaxed);
            }
        }
        // Never underflow: every decrement pairs with the increment in `reserve`.
        self.committed_tokens.fetch_sub(tokens, Ordering::Relaxed);
        self.inflight.fetch_sub(1, Ordering::Relaxed);
        self.refresh_mean_need();
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
    /// Prompt tokens still counted as waiting for prefill, and until when; `None` after
    /// the first token.
    prefill: Option<(PrefillEnd, u64)>,
    /// What this request still counts in the pod's growth (`None`: not observed).
    growth: Option<u64>,
}

impl Reservation {
    /// The pod answered the request (its first token, or for a non-streaming request the
    /// whole answer): its prefill is done. Idempotent.
    pub fn first_token(&mut self) {
        match self.prefill.take() {
            // Never underflows: pairs with the increment in `reserve`.
            Some((PrefillEnd::FirstToken, tokens)) => {
                self.load
                    .prefill_tokens
                    .fetch_sub(tokens, Ordering::Relaxed);
            }
            Some((PrefillEnd::NextScrape, tokens)) => {
                self.load.end_unscraped_prefill(self.tag, tokens);
            }
            None => {}
        }
    }

    /// `tokens` more output tokens streamed (each SSE event of vLLM carries about one):
    /// the pod has allocated them. A no-op for requests kvroute does not observe.
    pub fn streamed(&mut self, tokens: u64) {
        self.shrink_growth(tokens);
    }

    fn shrink_growth(&mut self, tokens: u64) {
        if let Some(left) = self.growth.as_mut() {
            let taken = tokens.min(*left);
            *left -= taken;
            self.load.growth_tokens.fetch_sub(taken, Ordering::Relaxed);
        }
    }

    /// The gateway served the request from another pod than the one reserved (it walked
    /// the fallbacks): the request counts there from now on, as if just sent, and no
    /// longer here.
    #[must_use]
    pub fn move_to(self, load: &Arc<PodLoad>) -> Reservation {
        if Arc::ptr_eq(&self.load, load) {
            return self;
        }
        let (prefill, growth) = (self.prefill, self.growth);
        let tokens = self.tokens;
        drop(self);
        // A request kvroute watches (it has a growth) ends its prefill at its first token;
        // the others at the next scrape. Past its prefill, it moves without a prompt.
        let end = if growth.is_some() {
            PrefillEnd::FirstToken
        } else {
            PrefillEnd::NextScrape
        };
        let prompt = prefill.map_or(0, |(_, prompt)| prompt);
        let mut moved = load.reserve(tokens, prompt, end);
        if prefill.is_none() {
            moved.first_token();
        }
        // Carry over what is left to grow, not the whole output again.
        if let (Some(now), Some(left)) = (moved.growth, growth) {
            moved.shrink_growth(now.saturating_sub(left));
        }
        moved
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.first_token();
        if let Some(left) = self.growth.take() {
            self.load.growth_tokens.fetch_sub(left, Ordering::Relaxed);
        }
        self.load.release(self.tag, self.tokens);
    }
}

#[cfg(test)]
mod tests;
