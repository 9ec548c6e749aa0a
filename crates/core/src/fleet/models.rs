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
use super::{PodView, ServedModels, adapter_key};

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
    /// The names the pods' model lists hold: shared with the index before when the pods
    /// list the same lists (their `/v1/models` is polled far less often than the fleet
    /// is published, and a fleet of many adapters lists thousands of names).
    listed: Arc<Listed>,
    /// Names no pod lists but some pod runs or queues as an adapter.
    unlisted: HashMap<String, ModelClass>,
}

/// The classes of the listed names, and the lists they were read from.
#[derive(Debug, Default, PartialEq)]
struct Listed {
    /// The distinct lists, in snapshot order (a list repeated by the next pod read once),
    /// held so that a later build can tell the same lists by address.
    lists: Vec<Arc<ServedModels>>,
    classes: HashMap<String, ModelClass>,
}

/// The pods' model lists in snapshot order, each run of pods sharing one list read once.
fn distinct_lists(pods: &[PodView]) -> impl Iterator<Item = &Arc<ServedModels>> {
    let mut previous: Option<&Arc<ServedModels>> = None;
    pods.iter()
        .filter_map(|pod| pod.models.as_ref())
        .filter(move |models| {
            let repeat = previous.is_some_and(|p| Arc::ptr_eq(p, models));
            previous = Some(models);
            !repeat
        })
}

impl Listed {
    /// Classifies the names of `pods`' lists; where pods disagree, the first list naming
    /// a name decides, and within one list an adapter entry wins over a base entry.
    fn build(pods: &[PodView]) -> Listed {
        let mut classes = HashMap::new();
        let mut lists = Vec::new();
        for models in distinct_lists(pods) {
            lists.push(Arc::clone(models));
            for (adapter, base) in &models.adapters {
                classes
                    .entry(adapter.clone())
                    .or_insert_with(|| ModelClass::Adapter { base: base.clone() });
            }
            for base in &models.base {
                classes.entry(base.clone()).or_insert(ModelClass::Base);
            }
        }
        Listed { lists, classes }
    }

    /// Whether `pods` list exactly the lists this was built from, in the same order.
    fn same_lists(&self, pods: &[PodView]) -> bool {
        let mut read = 0;
        for models in distinct_lists(pods) {
            match self.lists.get(read) {
                Some(list) if Arc::ptr_eq(list, models) => read += 1,
                _ => return false,
            }
        }
        read == self.lists.len()
    }
}

impl ModelIndex {
    /// Classifies every name in `pods` (in snapshot order). Where pods disagree, the first
    /// pod that lists a name decides, and within one pod an adapter entry wins over a base
    /// entry of the same name. Names no pod lists but some pod runs as an adapter come last.
    pub fn build(pods: &[PodView]) -> Self {
        ModelIndex::build_after(pods, None)
    }

    /// [`ModelIndex::build`], reusing what `previous` read of the model lists when the
    /// pods list the same ones (the same `Arc`s, in the same order); the same index.
    pub fn build_after(pods: &[PodView], previous: Option<&ModelIndex>) -> Self {
        let listed = match previous {
            Some(previous) if previous.listed.same_lists(pods) => Arc::clone(&previous.listed),
            _ => Arc::new(Listed::build(pods)),
        };
        let mut unlisted = HashMap::new();
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
                if !listed.classes.contains_key(adapter.as_str())
                    && !unlisted.contains_key(adapter.as_str())
                {
                    unlisted.insert(adapter.clone(), ModelClass::UnlistedAdapter);
                }
            }
        }
        ModelIndex { listed, unlisted }
    }

    /// The class of `model`, if some pod lists or runs it.
    pub fn class(&self, model: &str) -> Option<&ModelClass> {
        self.listed
            .classes
            .get(model)
            .or_else(|| self.unlisted.get(model))
    }

    /// How many names the index holds.
    pub fn len(&self) -> usize {
        self.listed.classes.len() + self.unlisted.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests;
