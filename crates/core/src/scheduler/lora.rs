//! LoRA adapter affinity: which pods can serve an adapter and how cheaply.
//!
//! vLLM reports, in `vllm:lora_requests_info`, the adapters of its running and waiting
//! requests and `max_lora`, the number of adapters a batch may hold. A pod already
//! running the adapter serves it with no load; a pod with a free slot pays one load; a
//! pod where the adapter is queued will load it soon; a pod with all slots busy must
//! first finish or evict another adapter's requests.

use crate::fleet::{LoraSlots, PodLoad, PodRow, PodView, Snapshot};

use super::SchedulerConfig;

/// How cheaply a pod can serve a given adapter, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraTier {
    /// The adapter is in the pod's running batch.
    Active,
    /// kvroute sent the adapter here recently enough that it likely still holds a slot.
    Warm,
    /// The pod has a free adapter slot.
    FreeSlot,
    /// The pod reports no LoRA state (fresh pod or LoRA metrics missing).
    Unknown,
    /// No running adapter holds every slot, but idle adapters kvroute sent lately likely
    /// do (vLLM keeps them loaded and reports only running and waiting ones): loading
    /// this one evicts one of them, which its next request then loads again.
    EvictIdle,
    /// Requests for the adapter already wait on the pod.
    Waiting,
    /// Every slot holds another adapter.
    MustEvict,
}

impl LoraTier {
    /// Every tier, best first.
    pub const ALL: [LoraTier; 7] = [
        LoraTier::Active,
        LoraTier::Warm,
        LoraTier::FreeSlot,
        LoraTier::Unknown,
        LoraTier::EvictIdle,
        LoraTier::Waiting,
        LoraTier::MustEvict,
    ];

    /// `key` is [`crate::fleet::adapter_key`] of `adapter`; `load` holds the adapters
    /// kvroute sent to `pod` lately. Reads the pod's own lists: a pick reads the
    /// snapshot's [`crate::fleet::AdapterIndex`] instead, through [`LoraTier::decide`].
    pub fn of(pod: &PodView, load: &PodLoad, adapter: &str, key: u64) -> LoraTier {
        let lora = pod.metrics().and_then(|m| m.lora.as_ref());
        LoraTier::decide(
            LoraSlots::of(lora),
            lora.is_some_and(|l| l.running.iter().any(|a| a == adapter)),
            lora.is_some_and(|l| l.waiting.iter().any(|a| a == adapter)),
            || load.adapter_standing(key),
        )
    }

    /// The tier of a pod with `slots` whose running (`running`) or waiting (`waiting`)
    /// requests include the adapter; `recency` says where the adapter stands among those
    /// kvroute sent the pod lately (0: the last one) and how many distinct adapters it
    /// sent there lately, asked only when it matters.
    #[inline]
    pub fn decide(
        slots: LoraSlots,
        running: bool,
        waiting: bool,
        recency: impl FnOnce() -> (Option<usize>, usize),
    ) -> LoraTier {
        if !slots.reported {
            return LoraTier::Unknown;
        }
        if running {
            return LoraTier::Active;
        }
        if waiting {
            return LoraTier::Waiting;
        }
        // A pod that does not say how many adapters a batch may hold tells nothing about
        // its slots (vLLM's label is absent before it reports LoRA state).
        if slots.max_lora == 0 {
            return LoraTier::Unknown;
        }
        let max = usize::from(slots.max_lora);
        // Other adapters' running requests pin their slots: when they hold every slot,
        // the adapter cannot still be loaded however recently it ran here.
        if usize::from(slots.running) >= max {
            return LoraTier::MustEvict;
        }
        // Among the last `max_lora` distinct adapters sent here: vLLM evicts idle
        // adapters least recently used first, so it is most likely still loaded.
        let (rank, remembered) = recency();
        if rank.is_some_and(|rank| rank < max) {
            return LoraTier::Warm;
        }
        if usize::from(slots.in_use) >= max {
            return LoraTier::MustEvict;
        }
        // The other adapters sent here lately, idle now, likely fill every slot.
        if remembered - usize::from(rank.is_some()) >= max {
            LoraTier::EvictIdle
        } else {
            LoraTier::FreeSlot
        }
    }

    /// The affinity score in 0..=1.
    pub fn score(self) -> f64 {
        match self {
            LoraTier::Active => 1.0,
            LoraTier::Warm => 0.9,
            LoraTier::FreeSlot => 0.6,
            LoraTier::Unknown => 0.5,
            LoraTier::EvictIdle => 0.45,
            LoraTier::Waiting => 0.4,
            LoraTier::MustEvict => 0.0,
        }
    }

    /// The tier's name, as it is serialised (`free_slot`, `must_evict`, ...).
    pub fn name(self) -> &'static str {
        match self {
            LoraTier::Active => "active",
            LoraTier::Warm => "warm",
            LoraTier::FreeSlot => "free_slot",
            LoraTier::Unknown => "unknown",
            LoraTier::EvictIdle => "evict_idle",
            LoraTier::Waiting => "waiting",
            LoraTier::MustEvict => "must_evict",
        }
    }

    /// A bounded label value.
    pub fn reason(self) -> &'static str {
        match self {
            LoraTier::Active => "lora_active",
            LoraTier::Warm => "lora_warm",
            LoraTier::FreeSlot => "lora_free_slot",
            LoraTier::Unknown => "lora_unknown",
            LoraTier::EvictIdle => "lora_evict_idle",
            LoraTier::Waiting => "lora_waiting",
            LoraTier::MustEvict => "lora_evict",
        }
    }
}

/// Whether `model` names a LoRA adapter: the configuration says so, or the snapshot's
/// model index does (see [`crate::fleet::ModelIndex::build`] for how pods that disagree
/// are settled).
pub fn is_adapter(model: &str, snapshot: &Snapshot, config: &SchedulerConfig) -> bool {
    config.adapters.contains_key(model)
        || snapshot
            .models
            .class(model)
            .is_some_and(|class| class.is_adapter())
}

/// Whether a pod serves a model, as far as kvroute can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serves {
    Yes,
    No,
    /// The pod's `/v1/models` has not answered (yet, or ever: a timeout, a 5xx, a 401
    /// behind vLLM's `--api-key`). It may serve the model, so the model is not unknown,
    /// but it is not sent requests for a model it may not have: 503, not 404.
    Unlisted,
}

/// Whether pods serve one model. Pods usually share one model list (the store interns
/// equal lists, and the snapshot numbers them), so the answer is remembered per list.
pub struct ServesModel<'a> {
    model: &'a str,
    config: &'a SchedulerConfig,
    snapshot: &'a Snapshot,
    /// The last list asked about, and its answer; none yet while the list is
    /// [`PodRow::UNLISTED`], which never reaches the comparison.
    last: (u32, bool),
}

impl<'a> ServesModel<'a> {
    pub fn new(model: &'a str, snapshot: &'a Snapshot, config: &'a SchedulerConfig) -> Self {
        ServesModel {
            model,
            config,
            snapshot,
            last: (PodRow::UNLISTED, false),
        }
    }

    /// Whether the pod at `index` in the snapshot, whose row is `row`, serves the model.
    #[inline(always)]
    pub(crate) fn check(&mut self, row: &PodRow, index: usize) -> Serves {
        if row.models == PodRow::UNLISTED {
            return Serves::Unlisted;
        }
        let listed = match self.last {
            (last, answer) if last == row.models => answer,
            _ => {
                let answer = self.snapshot.model_list(row.models).is_some_and(|models| {
                    models.serves(self.model)
                        || self
                            .config
                            .adapters
                            .get(self.model)
                            .is_some_and(|base| models.base.iter().any(|b| b == base))
                });
                self.last = (row.models, answer);
                answer
            }
        };
        if listed || self.snapshot.pods()[index].runs_adapter(self.model) {
            Serves::Yes
        } else {
            Serves::No
        }
    }
}
