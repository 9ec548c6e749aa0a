//! GPU + model profiles: how long one engine step takes, from a roofline.
//!
//! A step of a continuous-batching engine runs the model once over every token scheduled in it
//! (prefill chunks and one token per decoding sequence). Its time is bounded below by two roofs:
//!
//! * **compute**: `flops / (peak × MFU)`, with `flops = 2 × params × tokens` for the linear layers
//!   plus `4 × layers × hidden × Σ(new tokens × mean context)` for attention;
//! * **memory**: `(weights + KV read) / (HBM bandwidth × MBU)`: every step reads all weights once
//!   and, for attention, the KV of every token already in each scheduled sequence's context.
//!
//! `step = overhead + max(compute, memory)`, where the overhead covers the scheduler, sampling
//! and kernel launches on the host. Decode steps are memory bound (the ITL grows with the KV read,
//! i.e. with batch size × context); prefill is compute bound (TTFT grows with uncached tokens).
//!
//! Default profile `h100-llama3-8b` (see docs/simulator.md for the derivation):
//! Llama-3-8B in bf16: 8.03 B parameters, 16.06 GB of weights, 32 layers, hidden 4096, 8 KV heads
//! of 128 → `2 × 32 × 8 × 128 × 2 B = 128 KiB` of KV per token. H100 SXM 80 GB: 3.35 TB/s HBM3,
//! 989 TFLOP/s dense bf16. MFU 0.45 for prefill-heavy steps, MBU 0.80 for the memory roof,
//! 1.5 ms of host overhead per step. Batch-1 decode: `16.06 GB / 2.68 TB/s + 1.5 ms ≈ 7.5 ms`
//! per token; a 2,000-token prefill: `2 × 8.03e9 × 2000 / 445 TFLOP/s ≈ 72 ms` (+ attention).
//! KV pool: `80 GB × 0.9 − 16.06 GB − 1.5 GB (activations, CUDA graphs) ≈ 54.4 GB`, which is
//! 25,959 blocks of 16 tokens (2 MiB each).

use std::time::Duration;

use serde::Deserialize;

/// One GPU + model combination. All rates in SI units (bytes/s, FLOP/s).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Name used by `--profile` and the YAML config.
    pub name: String,
    /// Model parameters (for the `2 × params` FLOPs per token).
    pub params: f64,
    /// Bytes of weights read per step.
    pub weight_bytes: f64,
    /// KV-cache bytes per token (all layers, K and V).
    pub kv_bytes_per_token: f64,
    /// Transformer layers (attention FLOPs).
    pub layers: f64,
    /// Hidden size (attention FLOPs).
    pub hidden: f64,
    /// HBM capacity in bytes (for the default number of KV blocks).
    pub hbm_capacity_bytes: f64,
    /// HBM bandwidth in bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Dense bf16 peak in FLOP/s.
    pub peak_flops: f64,
    /// Model FLOPs utilisation reached by compute-bound (prefill) work.
    pub mfu: f64,
    /// Memory bandwidth utilisation reached by memory-bound (decode) steps.
    pub mbu: f64,
    /// Host-side time per step (scheduling, sampling, launches), seconds.
    pub step_overhead_s: f64,
    /// Host→GPU copy bandwidth (PCIe), bytes/s: moving an adapter from the CPU cache to a slot.
    pub pcie_bytes_per_s: f64,
    /// Size of one LoRA adapter in bytes (rank 16 on all linear layers).
    pub lora_bytes: f64,
    /// Longest sequence the model accepts (prompt + output), tokens.
    pub max_model_len: u32,
}

/// What one step computes, as the profile needs it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    /// Tokens computed this step (prefill chunks + one per decoding sequence).
    pub new_tokens: u64,
    /// Σ over scheduled sequences of the tokens whose KV is read (context after the step).
    pub kv_tokens_read: u64,
    /// Σ over scheduled sequences of `new tokens × mean attended context` (attention FLOPs).
    pub attention_pairs: f64,
}

impl StepShape {
    /// Counts a sequence whose KV holds `done` tokens computing `n` more this step.
    pub fn add(&mut self, done: u32, n: u32) {
        let done = u64::from(done);
        let n = u64::from(n);
        self.new_tokens += n;
        self.kv_tokens_read += done + n;
        self.attention_pairs += n as f64 * (done as f64 + (n as f64 + 1.0) / 2.0);
    }
}

/// Memory reserved for activations and CUDA graphs besides weights and KV.
const ACTIVATION_RESERVE_BYTES: f64 = 1.5e9;
/// vLLM's default `--gpu-memory-utilization`.
const GPU_MEMORY_UTILIZATION: f64 = 0.9;

impl Profile {
    /// Names of the built-in profiles.
    pub const NAMES: [&'static str; 3] = ["h100-llama3-8b", "a100-llama3-8b", "l40s-llama3-8b"];

    /// A built-in profile by name.
    pub fn by_name(name: &str) -> Option<Profile> {
        let llama3_8b = |name: &str, capacity: f64, bw: f64, flops: f64, pcie: f64| Profile {
            name: name.to_string(),
            params: 8.03e9,
            weight_bytes: 16.06e9,
            kv_bytes_per_token: 131_072.0,
            layers: 32.0,
            hidden: 4096.0,
            hbm_capacity_bytes: capacity,
            hbm_bytes_per_s: bw,
            peak_flops: flops,
            mfu: 0.45,
            mbu: 0.80,
            step_overhead_s: 0.0015,
            pcie_bytes_per_s: pcie,
            lora_bytes: 84e6,
            max_model_len: 131_072,
        };
        match name {
            "h100-llama3-8b" => Some(llama3_8b(name, 80e9, 3.35e12, 989e12, 50e9)),
            "a100-llama3-8b" => Some(llama3_8b(name, 80e9, 2.039e12, 312e12, 25e9)),
            "l40s-llama3-8b" => Some(llama3_8b(name, 48e9, 0.864e12, 362e12, 25e9)),
            _ => None,
        }
    }

    /// KV blocks left for the cache after weights and activations at 0.9 utilisation.
    pub fn default_num_gpu_blocks(&self, block_size: u32) -> u32 {
        let free = self.hbm_capacity_bytes * GPU_MEMORY_UTILIZATION
            - self.weight_bytes
            - ACTIVATION_RESERVE_BYTES;
        let block_bytes = self.kv_bytes_per_token * f64::from(block_size.max(1));
        (free / block_bytes).floor().max(1.0) as u32
    }

    /// Time of one engine step of the given shape (without jitter).
    pub fn step_time(&self, shape: &StepShape) -> Duration {
        let flops = 2.0 * self.params * shape.new_tokens as f64
            + 4.0 * self.layers * self.hidden * shape.attention_pairs;
        let compute = flops / (self.peak_flops * self.mfu);
        let bytes = self.weight_bytes + self.kv_bytes_per_token * shape.kv_tokens_read as f64;
        let memory = bytes / (self.hbm_bytes_per_s * self.mbu);
        Duration::from_secs_f64(self.step_overhead_s + compute.max(memory))
    }

    /// Time to copy one adapter from host memory into a GPU slot.
    pub fn lora_swap_in(&self) -> Duration {
        Duration::from_secs_f64(self.lora_bytes / self.pcie_bytes_per_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> Profile {
        Profile::by_name("h100-llama3-8b").expect("built-in profile")
    }

    #[test]
    fn every_named_profile_exists() {
        for name in Profile::NAMES {
            assert!(Profile::by_name(name).is_some(), "{name}");
        }
        assert!(Profile::by_name("tpu").is_none());
    }

    #[test]
    fn default_kv_pool_of_an_h100_is_about_26k_blocks() {
        let blocks = h100().default_num_gpu_blocks(16);
        assert!((25_000..27_000).contains(&blocks), "{blocks}");
    }

    #[test]
    fn batch_one_decode_is_memory_bound_near_seven_and_a_half_ms() {
        let t = h100().step_time(&StepShape {
            new_tokens: 1,
            kv_tokens_read: 500,
            attention_pairs: 500.0,
        });
        let ms = t.as_secs_f64() * 1e3;
        assert!((7.0..8.5).contains(&ms), "{ms}");
    }

    #[test]
    fn prefill_time_grows_linearly_with_tokens() {
        let p = h100();
        let prefill = |n: u64| {
            p.step_time(&StepShape {
                new_tokens: n,
                kv_tokens_read: n,
                attention_pairs: n as f64 * n as f64 / 2.0,
            })
            .as_secs_f64()
        };
        let (a, b) = (prefill(2000), prefill(4000));
        assert!(a > 0.06 && a < 0.09, "{a}");
        assert!(b > 1.9 * a && b < 2.3 * a, "{a} {b}");
    }

    #[test]
    fn decode_step_grows_with_batch_kv_read() {
        let p = h100();
        let decode = |batch: u64| {
            p.step_time(&StepShape {
                new_tokens: batch,
                kv_tokens_read: batch * 2000,
                attention_pairs: (batch * 2000) as f64,
            })
        };
        assert!(decode(64) > decode(1).mul_f64(1.5));
    }
}
