//! LoRA adapter slots: `max_loras` GPU slots, an LRU host cache of `max_cpu_loras` adapters.
//!
//! vLLM runs a batch with at most `max_loras` distinct adapters, each in a GPU slot. Here a slot
//! is either loading (until `ready_at`) or loaded. An adapter is loaded into a free slot, or into
//! the slot of the least recently used loaded adapter that no running request uses. Loading takes
//! the cold load time (weights from disk / remote host, `--lora-load-ms`) unless the adapter is in
//! the host cache, in which case it costs a PCIe copy (the profile's `lora_swap_in`). Loads run
//! in the background of the step loop; requests for the adapter wait (and show in
//! `waiting_lora_adapters`) until it is loaded.

use std::time::Duration;

/// Interned adapter id (index in the engine's adapter table).
pub type AdapterId = u32;

#[derive(Debug, Clone, Copy, PartialEq)]
enum SlotState {
    /// `from_host`: the weights come from the host cache (a PCIe copy), not from disk.
    Loading {
        ready_at: Duration,
        from_host: bool,
    },
    Loaded,
}

/// Adapter loads completed so far, by where the weights came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoraLoads {
    /// Cold loads (`--lora-load-ms`: not in the host cache).
    pub disk: u64,
    /// Reloads from the host cache (a PCIe copy).
    pub host: u64,
}

#[derive(Debug, Clone)]
struct Slot {
    adapter: AdapterId,
    state: SlotState,
    last_used: Duration,
}

/// The adapter slots of one engine.
#[derive(Debug, Clone)]
pub struct LoraSlots {
    max_loras: usize,
    max_cpu_loras: usize,
    cold_load: Duration,
    swap_in: Duration,
    slots: Vec<Slot>,
    /// Host cache, least recently used first.
    cpu: Vec<AdapterId>,
    loads: LoraLoads,
    /// The earliest `ready_at` of a slot loading, kept as slots change: the engine asks at
    /// every step, and reading the slots then cost a cache miss an engine visit.
    next_ready: Option<Duration>,
}

impl LoraSlots {
    /// Empty slots.
    pub fn new(
        max_loras: usize,
        max_cpu_loras: usize,
        cold_load: Duration,
        swap_in: Duration,
    ) -> LoraSlots {
        LoraSlots {
            max_loras,
            max_cpu_loras: max_cpu_loras.max(max_loras),
            cold_load,
            swap_in,
            slots: Vec::new(),
            cpu: Vec::new(),
            loads: LoraLoads::default(),
            next_ready: None,
        }
    }

    /// GPU slots (`max_loras`).
    pub fn max_loras(&self) -> usize {
        self.max_loras
    }

    /// Puts an adapter in a slot at once (startup preloading); false when no slot is free.
    pub fn preload(&mut self, adapter: AdapterId) -> bool {
        if self.slot_of(adapter).is_some() {
            return true;
        }
        if self.slots.len() >= self.max_loras {
            return false;
        }
        self.slots.push(Slot {
            adapter,
            state: SlotState::Loaded,
            last_used: Duration::ZERO,
        });
        self.cache_on_host(adapter);
        true
    }

    /// Whether the adapter is loaded in a slot (ready to run).
    pub fn is_loaded(&self, adapter: AdapterId) -> bool {
        self.slot_of(adapter)
            .is_some_and(|i| self.slots[i].state == SlotState::Loaded)
    }

    /// Adapters in slots (loaded or loading).
    pub fn resident(&self) -> impl Iterator<Item = AdapterId> + '_ {
        self.slots.iter().map(|s| s.adapter)
    }

    /// Loads completed so far.
    pub fn loads_total(&self) -> u64 {
        self.loads.disk + self.loads.host
    }

    /// Loads completed so far, from disk and from the host cache.
    pub fn loads(&self) -> LoraLoads {
        self.loads
    }

    /// Marks an adapter as used by the batch at `now` (for LRU eviction). As in vLLM, use
    /// refreshes the host cache too: adapters in GPU slots are its most recently used.
    pub fn touch(&mut self, adapter: AdapterId, now: Duration) {
        if let Some(i) = self.slot_of(adapter) {
            self.slots[i].last_used = now;
        }
        if let Some(position) = self.cpu.iter().position(|&a| a == adapter)
            && position + 1 != self.cpu.len()
        {
            let used = self.cpu.remove(position);
            self.cpu.push(used);
        }
    }

    /// Starts loading `adapter` unless it is resident. Takes a free slot, else evicts the least
    /// recently used loaded adapter for which `in_use` is false. Returns whether the adapter is
    /// now resident (loaded or loading).
    pub fn request_load(
        &mut self,
        adapter: AdapterId,
        now: Duration,
        in_use: impl Fn(AdapterId) -> bool,
    ) -> bool {
        if self.slot_of(adapter).is_some() {
            return true;
        }
        let from_host = self.cpu.contains(&adapter);
        let duration = if from_host {
            self.swap_in
        } else {
            self.cold_load
        };
        let slot = Slot {
            adapter,
            state: SlotState::Loading {
                ready_at: now + duration,
                from_host,
            },
            last_used: now,
        };
        if self.slots.len() < self.max_loras {
            self.slots.push(slot);
            self.next_ready = self.find_next_ready();
            return true;
        }
        let victim = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state == SlotState::Loaded && !in_use(s.adapter))
            .min_by_key(|(_, s)| s.last_used)
            .map(|(i, _)| i);
        match victim {
            Some(i) => {
                self.slots[i] = slot;
                self.next_ready = self.find_next_ready();
                true
            }
            None => false,
        }
    }

    /// The earliest time a load in progress completes.
    #[inline]
    pub fn next_ready(&self) -> Option<Duration> {
        self.next_ready
    }

    fn find_next_ready(&self) -> Option<Duration> {
        self.slots
            .iter()
            .filter_map(|s| match s.state {
                SlotState::Loading { ready_at, .. } => Some(ready_at),
                SlotState::Loaded => None,
            })
            .min()
    }

    /// Completes the loads due at `now`; returns how many completed.
    pub fn complete_loads(&mut self, now: Duration) -> usize {
        let mut done = Vec::new();
        for s in &mut self.slots {
            if let SlotState::Loading {
                ready_at,
                from_host,
            } = s.state
                && ready_at <= now
            {
                s.state = SlotState::Loaded;
                s.last_used = ready_at;
                done.push(s.adapter);
                if from_host {
                    self.loads.host += 1;
                } else {
                    self.loads.disk += 1;
                }
            }
        }
        for &a in &done {
            self.cache_on_host(a);
        }
        self.next_ready = self.find_next_ready();
        done.len()
    }

    /// Forgets an adapter (unload): frees its slot unless `in_use`, and drops it from the host.
    pub fn remove(&mut self, adapter: AdapterId, in_use: bool) {
        if !in_use && let Some(i) = self.slot_of(adapter) {
            self.slots.remove(i);
            self.next_ready = self.find_next_ready();
        }
        self.cpu.retain(|&a| a != adapter);
    }

    fn slot_of(&self, adapter: AdapterId) -> Option<usize> {
        self.slots.iter().position(|s| s.adapter == adapter)
    }

    /// Evicts the least recently used adapter that is not in a GPU slot: in vLLM the
    /// slot-resident adapters are a subset of the host cache.
    fn cache_on_host(&mut self, adapter: AdapterId) {
        self.cpu.retain(|&a| a != adapter);
        self.cpu.push(adapter);
        while self.cpu.len() > self.max_cpu_loras {
            let oldest_idle = self.cpu.iter().position(|&a| self.slot_of(a).is_none());
            match oldest_idle {
                Some(position) => {
                    self.cpu.remove(position);
                }
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_cold_load_takes_the_load_time_and_a_cached_one_the_swap_in() {
        let mut slots = LoraSlots::new(1, 2, 200 * MS, 2 * MS);
        assert!(slots.request_load(0, Duration::ZERO, |_| false));
        assert!(!slots.is_loaded(0));
        assert_eq!(slots.next_ready(), Some(200 * MS));
        assert_eq!(slots.complete_loads(199 * MS), 0);
        assert_eq!(slots.complete_loads(200 * MS), 1);
        assert!(slots.is_loaded(0));
        // adapter 1 evicts idle adapter 0; then 0 comes back from the host cache.
        assert!(slots.request_load(1, 300 * MS, |_| false));
        slots.complete_loads(500 * MS);
        assert!(slots.request_load(0, 600 * MS, |_| false));
        assert_eq!(slots.next_ready(), Some(602 * MS));
        slots.complete_loads(602 * MS);
        assert_eq!(slots.loads(), LoraLoads { disk: 2, host: 1 });
        assert_eq!(slots.loads_total(), 3);
    }

    #[test]
    fn the_next_load_to_complete_follows_the_slots() {
        let mut slots = LoraSlots::new(3, 3, 100 * MS, MS);
        assert_eq!(slots.next_ready(), None);
        assert!(slots.request_load(0, 50 * MS, |_| false));
        assert!(slots.request_load(1, Duration::ZERO, |_| false));
        assert_eq!(slots.next_ready(), Some(100 * MS));
        assert_eq!(slots.complete_loads(100 * MS), 1);
        assert_eq!(slots.next_ready(), Some(150 * MS));
        // Forgetting the adapter still loading leaves nothing to wait for.
        slots.remove(0, false);
        assert_eq!(slots.next_ready(), None);
    }

    #[test]
    fn an_adapter_in_use_is_never_evicted() {
        let mut slots = LoraSlots::new(2, 2, MS, MS);
        assert!(slots.preload(0));
        assert!(slots.preload(1));
        assert!(!slots.preload(2));
        assert!(!slots.request_load(2, MS, |_| true));
        assert!(slots.request_load(2, MS, |a| a == 0));
        assert!(slots.is_loaded(0));
        assert!(!slots.is_loaded(1));
    }

    #[test]
    fn an_adapter_in_a_gpu_slot_never_falls_out_of_the_host_cache() {
        let (a, b, c) = (1, 2, 3);
        let ms = Duration::from_millis;
        let mut slots = LoraSlots::new(2, 2, ms(100), ms(2));
        assert!(slots.request_load(a, ms(0), |_| false));
        assert!(slots.request_load(b, ms(0), |_| false));
        slots.complete_loads(ms(100));
        // `a` stays busy, `b` goes idle; `c` takes `b`'s slot.
        slots.touch(a, ms(200));
        assert!(slots.request_load(c, ms(300), |x| x == a));
        slots.complete_loads(ms(400));
        assert!(slots.is_loaded(a) && slots.is_loaded(c));
        // The host cache (2) keeps the resident `a` and `c`: `b` was the one to go, so
        // it reloads cold.
        assert!(slots.request_load(b, ms(500), |x| x == c));
        slots.complete_loads(ms(600));
        assert_eq!(slots.loads(), LoraLoads { disk: 4, host: 0 });
    }
}
