//! Reading and checking a workload: why one is refused, the range and cross-field rules, and
//! the simulated fleet its `fleet` section describes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_sim::profile::Profile;
use kvroute_sim::{ConfigError, FleetConfig, PodConfig};

use super::{ClassSpec, Workload};

/// Why a workload was refused.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file does not parse.
    #[error("invalid workload {path}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_norway::Error,
    },
    /// A value is out of range or inconsistent.
    #[error("workload {name:?}: {reason}")]
    Invalid {
        /// The workload's name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The fleet section does not make a valid simulated fleet.
    #[error("workload {name:?}: fleet")]
    Fleet {
        /// The workload's name.
        name: String,
        /// The simulator's reason.
        source: ConfigError,
    },
}

impl Workload {
    /// Reads and validates a workload file.
    pub fn from_file(path: &Path) -> Result<Workload, WorkloadError> {
        let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let workload: Workload =
            serde_norway::from_str(&text).map_err(|source| WorkloadError::Parse {
                path: path.to_path_buf(),
                source,
            })?;
        workload.validate()?;
        Ok(workload)
    }

    /// Parses and validates workload YAML text.
    pub fn from_yaml(text: &str) -> Result<Workload, WorkloadError> {
        let workload: Workload =
            serde_norway::from_str(text).map_err(|source| WorkloadError::Parse {
                path: PathBuf::from("<yaml>"),
                source,
            })?;
        workload.validate()?;
        Ok(workload)
    }

    /// Checks ranges and cross-field rules (including that the fleet section is valid).
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |reason: String| WorkloadError::Invalid {
            name: self.name.clone(),
            reason,
        };
        if self.name.is_empty() {
            return Err(bad("name is empty".into()));
        }
        if self.rates.is_empty() || self.rates.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            return Err(bad(format!(
                "rates must be a non-empty list of numbers > 0, got {:?}",
                self.rates
            )));
        }
        if self.step_duration.is_zero() {
            return Err(bad("step_duration must be > 0".into()));
        }
        if self.classes.is_empty() {
            return Err(bad("at least one class is needed".into()));
        }
        let adapters = self.fleet.adapters.names();
        if let Some(c) = self.capacity
            && !(c.is_finite() && c > 0.0)
        {
            return Err(bad(format!("capacity must be > 0, got {c}")));
        }
        if let Some(objectives) = &self.objectives {
            if objectives.is_empty() {
                return Err(bad("objectives is empty; leave it out".into()));
            }
            for name in objectives.keys() {
                objective_name(name).map_err(|e| bad(format!("objectives: {e}")))?;
            }
        }
        for c in &self.classes {
            let name = &c.name;
            self.check_weights(c)
                .map_err(|e| bad(format!("class {name}: {e}")))?;
            if let Some(o) = &c.objective {
                objective_name(o).map_err(|e| bad(format!("class {name}: {e}")))?;
                if let Some(map) = &self.objectives
                    && !map.contains_key(o)
                {
                    return Err(bad(format!(
                        "class {name}: objective {o:?} is not in objectives ({})",
                        map.keys().cloned().collect::<Vec<_>>().join(", ")
                    )));
                }
            }
            if let Some(t) = &c.tenant {
                tenant_id(t).map_err(|e| bad(format!("class {name}: {e}")))?;
            }
            match (&c.prompt_tokens, &c.shared_prefix) {
                (Some(d), None) => d.check().map_err(|e| bad(format!("class {name}: {e}")))?,
                (None, Some(p)) => {
                    if p.num_groups == 0
                        || p.num_prompts_per_group == 0
                        || p.system_prompt_len == 0
                        || p.question_len == 0
                    {
                        return Err(bad(format!(
                            "class {name}: shared_prefix values must be > 0"
                        )));
                    }
                }
                _ => {
                    return Err(bad(format!(
                        "class {name}: give either prompt_tokens or shared_prefix"
                    )));
                }
            }
            c.output_tokens
                .check()
                .map_err(|e| bad(format!("class {name}: {e}")))?;
            if let Some(l) = &c.lora {
                let valid =
                    (0.0..=1.0).contains(&l.base_share) && l.zipf_s.is_finite() && l.zipf_s >= 0.0;
                if !valid {
                    return Err(bad(format!(
                        "class {name}: lora.base_share must be in [0, 1] and zipf_s >= 0"
                    )));
                }
                if adapters.is_empty() && l.base_share < 1.0 {
                    return Err(bad(format!(
                        "class {name}: lora traffic but fleet.adapters is empty"
                    )));
                }
            }
        }
        if let Some(step) =
            (0..self.rates.len()).find(|&i| self.class_weights(i).iter().sum::<f64>() <= 0.0)
        {
            return Err(bad(format!(
                "ladder step {step} ({} req/s) has no class with a weight above 0",
                self.rates[step]
            )));
        }
        let fleet = self.fleet_config().map_err(|source| WorkloadError::Fleet {
            name: self.name.clone(),
            source,
        })?;
        let max_len = fleet
            .pods
            .iter()
            .map(|p| {
                let capacity = p.engine.num_gpu_blocks.saturating_mul(p.engine.block_size);
                p.profile.max_model_len.min(capacity)
            })
            .min()
            .unwrap_or(0);
        for c in &self.classes {
            let longest = c.max_prompt_tokens() + c.output_tokens.max();
            // Chat templates add a few tokens; leave room for them.
            if u64::from(longest) + 64 > u64::from(max_len) {
                return Err(bad(format!(
                    "class {}: prompt + output can reach {longest} tokens, over the fleet's model length {max_len}",
                    c.name
                )));
            }
        }
        Ok(())
    }

    /// The simulated fleet this workload is meant for, on ephemeral ports of 127.0.0.1.
    pub fn fleet_config(&self) -> Result<FleetConfig, ConfigError> {
        let f = &self.fleet;
        let profile = Profile::by_name(&f.profile)
            .ok_or_else(|| ConfigError::UnknownProfile(f.profile.clone()))?;
        let mut pod = PodConfig::default();
        pod.engine.num_gpu_blocks = f
            .num_gpu_blocks
            .unwrap_or_else(|| profile.default_num_gpu_blocks(pod.engine.block_size));
        pod.profile = profile;
        if let Some(v) = f.max_loras {
            pod.engine.max_loras = v;
        }
        pod.engine.max_cpu_loras = f.max_cpu_loras.unwrap_or(pod.engine.max_loras);
        if let Some(ms) = f.lora_load_ms {
            pod.engine.lora_load = Duration::from_millis(ms);
        }
        pod.lora_adapters = f.adapters.names();
        let config = FleetConfig {
            model: self.model.clone(),
            speedup: f.speedup,
            seed: self.seed,
            ..FleetConfig::uniform(f.pods, pod)
        };
        config.validate()?;
        if config
            .pods
            .iter()
            .any(|p| p.engine.max_cpu_loras < p.engine.max_loras)
        {
            return Err(ConfigError::Invalid(
                "max_cpu_loras must be >= max_loras".into(),
            ));
        }
        Ok(config)
    }

    /// `weight` or `step_weights` (one per ladder step), each finite and not negative;
    /// `weight` above 0.
    fn check_weights(&self, c: &ClassSpec) -> Result<(), String> {
        match (c.weight, &c.step_weights) {
            (Some(_), Some(_)) => Err("give weight or step_weights, not both".into()),
            (Some(w), None) if !(w.is_finite() && w > 0.0) => {
                Err(format!("weight must be > 0, got {w}"))
            }
            (_, Some(v)) if v.len() != self.rates.len() => Err(format!(
                "step_weights has {} entries for a ladder of {} rates",
                v.len(),
                self.rates.len()
            )),
            (_, Some(v)) if v.iter().any(|w| !(w.is_finite() && *w >= 0.0)) => {
                Err(format!("step_weights must be numbers >= 0, got {v:?}"))
            }
            _ => Ok(()),
        }
    }
}

/// Longest tenant id (the fairness header's value), bytes.
pub const MAX_TENANT_BYTES: usize = 128;

/// Longest objective name, bytes.
pub const MAX_OBJECTIVE_BYTES: usize = 128;

/// Visible ASCII (0x21-0x7e): a header value as it is sent, with nothing to trim or escape.
fn visible_ascii(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_graphic())
}

/// An objective name: sent as a header value and passed to kvroute as `NAME=INT,...`.
fn objective_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_OBJECTIVE_BYTES {
        return Err(format!(
            "objective names must have 1 to {MAX_OBJECTIVE_BYTES} bytes, got {}",
            name.len()
        ));
    }
    if !visible_ascii(name) || name.contains([',', '=']) {
        return Err(format!(
            "objective {name:?}: only visible ASCII without ',' and '=' (a header value and a NAME=INT flag)"
        ));
    }
    Ok(())
}

/// A tenant id: sent as a header value.
fn tenant_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_TENANT_BYTES {
        return Err(format!(
            "tenant ids must have 1 to {MAX_TENANT_BYTES} bytes, got {}",
            id.len()
        ));
    }
    if !visible_ascii(id) {
        return Err(format!(
            "tenant {id:?}: only visible ASCII (it is sent as a header value)"
        ));
    }
    Ok(())
}

impl ClassSpec {
    fn max_prompt_tokens(&self) -> u32 {
        match (&self.prompt_tokens, &self.shared_prefix) {
            (Some(d), _) => d.max(),
            (None, Some(p)) => p.system_prompt_len + p.question_len,
            (None, None) => 0,
        }
    }
}
