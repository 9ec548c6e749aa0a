//! What each model name means to the fleet, decided once per snapshot.
//!
//! A request names a base model or a LoRA adapter, and the answer decides its telemetry
//! labels and whether adapter affinity applies. Walking every pod's `/v1/models` for each
//! request would cost O(pods) before the pick even starts; the index answers in one
//! lookup and is rebuilt only when a snapshot is published (pingora rebuilds its selector
//! on discovery updates for the same reason).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Arc;

use super::prefix::IdentityHasher;
use super::{PodView, adapter_key};

/// How the fleet knows a model name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelClass {
    /// A base model listed in some pod's `/v1/models`.
    Base,
    /// A LoRA adapter listed in some pod's `/v1/models`, with its base model.
    Adapter { base: String },
    /// Listed nowhere, but some pod runs or queues it as an adapter (vLLM's LoRA
    /// metrics): an adapter loaded at runtime before `/v1/models` was polled again.
    UnlistedAdapter,
}

impl ModelClass {
    pub fn is_adapter(&self) -> bool {
        !matches!(self, ModelClass::Base)
    }
}

/// Every model name the fleet lists or runs, with its class.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelIndex {
    classes: HashMap<String, ModelClass>,
}

impl ModelIndex {
    /// Classifies every name in `pods` (in snapshot order). Where pods disagree, the first
    /// pod that lists a name decides, and within one pod an adapter entry wins over a base
    /// entry of the same name. Names no pod lists but some pod runs as an adapter come last.
    pub fn build(pods: &[PodView]) -> Self {
        let mut classes = HashMap::new();
        // Pods usually share one interned model list: read each distinct list once.
        let mut previous: Option<&Arc<_>> = None;
        for models in pods.iter().filter_map(|pod| pod.models.as_ref()) {
            if previous.is_some_and(|p| Arc::ptr_eq(p, models)) {
                continue;
            }
            previous = Some(models);
            for (adapter, base) in &models.adapters {
                classes
                    .entry(adapter.clone())
                    .or_insert_with(|| ModelClass::Adapter { base: base.clone() });
            }
            for base in &models.base {
                classes.entry(base.clone()).or_insert(ModelClass::Base);
            }
        }
        // Every pod reports a few of the same adapters: each name is looked up once, found
        // again by its cheap FNV key (and compared, so that two names sharing a key are
        // both looked up).
        let mut seen: HashMap<u64, &str, BuildHasherDefault<IdentityHasher>> = HashMap::default();
        for lora in pods
            .iter()
            .filter_map(|pod| pod.metrics().and_then(|m| m.lora.as_ref()))
        {
            for adapter in lora.running.iter().chain(lora.waiting.iter()) {
                let key = adapter_key(adapter);
                if seen.get(&key) == Some(&adapter.as_str()) {
                    continue;
                }
                seen.insert(key, adapter);
                // Looked up before inserting: most running adapters are listed ones, and
                // the entry API would copy the name for every lookup.
                if !classes.contains_key(adapter.as_str()) {
                    classes.insert(adapter.clone(), ModelClass::UnlistedAdapter);
                }
            }
        }
        ModelIndex { classes }
    }

    /// The class of `model`, if some pod lists or runs it.
    pub fn class(&self, model: &str) -> Option<&ModelClass> {
        self.classes.get(model)
    }

    /// How many names the index holds.
    pub fn len(&self) -> usize {
        self.classes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.classes.is_empty()
    }
}

#[cfg(test)]
mod tests;
