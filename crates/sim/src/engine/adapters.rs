//! LoRA adapter bookkeeping of the engine: interned adapter names, per-adapter running and
//! waiting counts, the `vllm:lora_requests_info` history, and the adapter-facing methods.

use crate::lora::{AdapterId, LoraLoads};

use super::{Engine, LoraInfo, Place};

/// LoRA info entries kept (vLLM keeps every label set it ever exported).
const LORA_HISTORY: usize = 8;

impl Engine {
    /// Puts an adapter in a GPU slot at once (startup).
    pub fn preload_adapter(&mut self, name: &str) -> bool {
        let id = self.intern(name);
        self.lora.preload(id)
    }

    /// Drops an adapter from the slots and host cache (after `/v1/unload_lora_adapter`).
    pub fn unload_adapter(&mut self, name: &str) {
        if let Some(id) = self.adapters.iter().position(|a| a == name) {
            let id = id as AdapterId;
            let in_use = self.running_per_adapter[id as usize] > 0;
            self.lora.remove(id, in_use);
        }
    }

    /// Recent LoRA info label sets, oldest first; the last one is current.
    pub fn lora_history(&self) -> &[LoraInfo] {
        &self.lora_history
    }

    /// Adapter loads into GPU slots completed so far (from disk, from the host cache).
    pub fn lora_loads(&self) -> LoraLoads {
        self.lora.loads()
    }

    /// Adapters currently in GPU slots (loaded or loading).
    pub fn resident_adapters(&self) -> Vec<String> {
        self.lora
            .resident()
            .map(|a| self.adapters[a as usize].clone())
            .collect()
    }

    pub(super) fn intern(&mut self, name: &str) -> AdapterId {
        if let Some(i) = self.adapters.iter().position(|a| a == name) {
            return i as AdapterId;
        }
        self.adapters.push(name.to_string());
        self.running_per_adapter.push(0);
        self.waiting_per_adapter.push(0);
        (self.adapters.len() - 1) as AdapterId
    }

    pub(super) fn count_adapter(&mut self, adapter: Option<AdapterId>, place: Place, add: bool) {
        let Some(a) = adapter else { return };
        let counts = match place {
            Place::Waiting => &mut self.waiting_per_adapter,
            Place::Running => &mut self.running_per_adapter,
        };
        let c = &mut counts[a as usize];
        let before = *c;
        if add {
            *c += 1;
        } else {
            *c = c.saturating_sub(1);
        }
        if (before == 0) != (*c == 0) {
            self.lora_dirty = true;
        }
    }

    pub(super) fn refresh_lora_info(&mut self) {
        if !self.lora_dirty || !self.lora_enabled() {
            return;
        }
        self.lora_dirty = false;
        let names = |counts: &[u32]| {
            let mut v: Vec<&str> = counts
                .iter()
                .enumerate()
                .filter(|(_, c)| **c > 0)
                .map(|(i, _)| self.adapters[i].as_str())
                .collect();
            v.sort_unstable();
            v.join(",")
        };
        let running = names(&self.running_per_adapter);
        let waiting = names(&self.waiting_per_adapter);
        if let Some(last) = self.lora_history.last()
            && last.running == running
            && last.waiting == waiting
        {
            return;
        }
        self.lora_history
            .retain(|e| !(e.running == running && e.waiting == waiting));
        self.lora_history.push(LoraInfo {
            running,
            waiting,
            since: self.clock,
        });
        if self.lora_history.len() > LORA_HISTORY {
            self.lora_history.remove(0);
        }
    }
}
