//! The Gateway API Inference Extension's `InferencePool`
//! (`inference.networking.k8s.io/v1`), as far as kvroute reads it: which pods
//! (`spec.selector.matchLabels`), which of their ports (`spec.targetPorts`), and which
//! picker serves it (`spec.endpointPickerRef`, informational).
//!
//! A typed custom resource (kube's `CustomResource` derive), so the pool goes through
//! the same `Api` / watcher / reflector code as pods, and a field renamed upstream
//! fails to compile here rather than reading as empty at run time. Unknown fields are
//! ignored, so a newer pool (status, extra selector forms) still parses.

use std::collections::BTreeMap;

use kube::CustomResource;
use serde::{Deserialize, Serialize};

use super::kubernetes::{LabelSelector, PodTarget};

/// At most this many target ports per pool (the CRD's own limit).
pub const MAX_TARGET_PORTS: usize = 8;

/// `spec` of an InferencePool.
#[derive(CustomResource, Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    namespaced,
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The pods of the pool.
    #[serde(default)]
    pub selector: PoolSelector,
    /// Each port of each selected pod is one endpoint.
    #[serde(default)]
    pub target_ports: Vec<TargetPort>,
    /// The endpoint picker that serves the pool (kvroute itself, when deployed so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// `spec.selector`: v1 selects by labels only.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// One entry of `spec.targetPorts`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
pub struct TargetPort {
    pub number: i32,
}

/// `spec.endpointPickerRef`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PickerPort>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

/// `spec.endpointPickerRef.port`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
pub struct PickerPort {
    pub number: i32,
}

/// Why a pool's spec cannot be followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("spec.selector.matchLabels is empty (it would select every pod)")]
    EmptySelector,
    #[error("spec.selector.matchLabels: {0}")]
    BadSelector(String),
    #[error("spec.targetPorts is empty")]
    NoTargetPorts,
    #[error("spec.targetPorts lists {0} ports (at most {MAX_TARGET_PORTS})")]
    TooManyTargetPorts(usize),
    #[error("spec.targetPorts: {0} is not a port number")]
    BadPort(i32),
}

impl InferencePoolSpec {
    /// The pods and ports this pool routes to.
    pub fn pod_target(&self) -> Result<PodTarget, PoolError> {
        let selector = LabelSelector::new(self.selector.match_labels.clone())
            .map_err(|e| PoolError::BadSelector(e.to_string()))?;
        if selector.is_empty() {
            return Err(PoolError::EmptySelector);
        }
        if self.target_ports.is_empty() {
            return Err(PoolError::NoTargetPorts);
        }
        if self.target_ports.len() > MAX_TARGET_PORTS {
            return Err(PoolError::TooManyTargetPorts(self.target_ports.len()));
        }
        let ports = self
            .target_ports
            .iter()
            .map(|port| {
                u16::try_from(port.number)
                    .ok()
                    .filter(|n| *n != 0)
                    .ok_or(PoolError::BadPort(port.number))
            })
            .collect::<Result<Vec<u16>, _>>()?;
        Ok(PodTarget::new(selector, ports))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> InferencePoolSpec {
        serde_json::from_value(json).expect("spec parses")
    }

    #[test]
    fn a_published_v1_pool_parses_and_names_its_pods_and_ports() {
        let pool: InferencePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "vllm-llama3", "namespace": "llm", "resourceVersion": "7"},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm-llama3"}},
                "targetPorts": [{"number": 8000}, {"number": 8001}],
                "endpointPickerRef": {"name": "kvroute", "port": {"number": 9002},
                                      "failureMode": "FailClose", "kind": "Service"}
            },
            "status": {"parents": []}
        }))
        .expect("pool parses");
        let target = pool.spec.pod_target().expect("valid");
        assert_eq!(target.selector().to_string(), "app=vllm-llama3");
        assert_eq!(target.ports(), &[8000, 8001]);
        let picker = pool.spec.endpoint_picker_ref.expect("picker ref");
        assert_eq!(picker.name, "kvroute");
        assert_eq!(picker.port, Some(PickerPort { number: 9002 }));
    }

    #[test]
    fn a_pool_without_labels_selects_nothing_rather_than_everything() {
        let pool = spec(serde_json::json!({"selector": {}, "targetPorts": [{"number": 8000}]}));
        assert_eq!(pool.pod_target(), Err(PoolError::EmptySelector));
    }

    #[test]
    fn target_ports_must_be_ports_and_at_most_eight() {
        let bad = spec(serde_json::json!({
            "selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 70000}]}));
        assert_eq!(bad.pod_target(), Err(PoolError::BadPort(70000)));
        let none = spec(serde_json::json!({"selector": {"matchLabels": {"app": "x"}}}));
        assert_eq!(none.pod_target(), Err(PoolError::NoTargetPorts));
        let ports: Vec<_> = (8000..8009)
            .map(|n| serde_json::json!({"number": n}))
            .collect();
        let many = spec(serde_json::json!({
            "selector": {"matchLabels": {"app": "x"}}, "targetPorts": ports}));
        assert_eq!(many.pod_target(), Err(PoolError::TooManyTargetPorts(9)));
    }
}
