//! Workload files (`crates/lab/workloads/*.yaml`) and the pure, seeded request generator.
//!
//! A workload says what traffic to send (a weighted mix of request classes), at which rates by
//! default, and which simulated fleet it is meant for, so that a comparison can start identical
//! fleets from it ([`Workload::fleet_config`]). Every length is in tokens of the simulator's
//! tokenizer (about 4 characters of English each; see docs/simulator.md).
//!
//! ```yaml
//! name: multi-lora                 # required
//! description: free text
//! seed: 1                          # workload seed (--seed overrides); default 0
//! model: meta-llama/Llama-3.1-8B-Instruct   # base model (default: the simulator's)
//! api: completions                 # completions (default) | chat
//! ignore_eos: true                 # send vLLM's ignore_eos so outputs run to max_tokens (default true)
//! rates: [2, 4, 8]                 # default ladder, requests per simulated second (required)
//! step_duration: 60s               # default length of one ladder step, simulated time (default 60s)
//! fleet:                           # the simulated fleet this workload is meant for
//!   pods: 8                        # required
//!   profile: h100-llama3-8b        # default h100-llama3-8b
//!   num_gpu_blocks: 1926           # default: what the profile's GPU leaves for KV
//!   max_loras: 2                   # default 4 (the simulator's); 0 disables LoRA
//!   max_cpu_loras: 2               # default: max_loras (vLLM's default)
//!   lora_load_ms: 150              # default 150
//!   adapters: 16                   # a count (named lora-0, lora-1, ...) or a list of names
//!   speedup: 10                    # simulated seconds per wall second (default 1)
//! objectives: {critical: 100, sheddable: -10}   # optional: objective → priority
//! capacity: 18                     # optional: req/s the fleet completes at most (target checks)
//! classes:                         # at least one; a request picks a class by weight
//!   - name: chat                   # required
//!     weight: 1                    # default 1
//!     objective: critical          # optional: x-gateway-inference-objective header
//!     tenant: team-a               # optional: x-gateway-inference-fairness-id header
//!     lora: {base_share: 0.1, zipf_s: 1.0}   # optional: adapter traffic over fleet.adapters
//!     prompt_tokens: {dist: lognormal, median: 300, sigma: 1.0, min: 16, max: 4000}
//!     output_tokens: {dist: uniform, min: 16, max: 256}
//!   - name: rag
//!     step_weights: [0, 1, 1]      # instead of weight: one per rate of the ladder
//!     shared_prefix: {num_groups: 16, num_prompts_per_group: 8,
//!                     system_prompt_len: 1500, question_len: 200}
//!     output_tokens: {dist: fixed, value: 200}
//! ```
//!
//! Flow control: every request of a class with `objective` carries
//! `x-gateway-inference-objective: <objective>`, of a class with `tenant`
//! `x-gateway-inference-fairness-id: <tenant>` (the Gateway API Inference Extension's
//! headers; a gateway with flow control maps the objective to a priority and takes turns
//! between tenants). `objectives` maps each objective name to its priority (higher is served
//! first, negative is sheddable); `compare` passes it to kvroute as
//! `--objective-priority NAME=INT,...`. When `objectives` is given it must not be empty and
//! every class's objective must be in it. Objective names: 1 to 128 bytes of visible ASCII
//! without `,` or `=`; tenant ids: 1 to 128 bytes of visible ASCII. `capacity` (> 0) is an
//! estimate of the requests per simulated second the fleet completes at most; the
//! comparison's target checks take their half-load and 2× steps from it.
//!
//! `step_weights` (exclusive with `weight`): the class's weight at each step of the ladder,
//! one entry per rate, each ≥ 0 (0: the class sends nothing in that step); every step needs
//! some class with a weight above 0. A ladder override must then have as many rates as
//! `rates`; a shortened ladder keeps each step's weights ([`Workload::select_steps`]).
//!
//! Distributions (`dist`): `fixed {value}`, `uniform {min, max}` (integers, both included),
//! `lognormal {median, sigma, min, max}` (`median · e^(sigma·N(0,1))`, rounded and clamped; its
//! mean before clamping is `median · e^(sigma²/2)`), `exponential {mean, min, max}`.
//!
//! `lora`: with probability `base_share` a request goes to the base model, otherwise to an
//! adapter of `fleet.adapters` drawn with Zipf popularity (the adapter of rank `k`, counting from
//! 1 in list order, has weight `1 / k^zipf_s`; `zipf_s: 0` is uniform). Without `lora` the class
//! uses the base model.
//!
//! `shared_prefix` (inference-perf's `shared_prefix` data shape): `num_groups` system prompts of
//! `system_prompt_len` tokens, each with `num_prompts_per_group` questions of `question_len`
//! tokens; every request draws one of these `num_groups × num_prompts_per_group` prompts
//! uniformly. A class has either `prompt_tokens` or `shared_prefix`, not both.
//!
//! Generation is pure: the same workload, seed, step, rate and limits give the same requests.
//!
//! Layout: `format` holds the file's serde types, `dist` the token-count distributions, `load`
//! reading and validating a file (and the fleet it describes), `generator` the seeded planner
//! of a ladder step's requests.

mod dist;
mod format;
mod generator;
mod load;

pub use dist::Dist;
pub use format::{Adapters, Api, ClassSpec, FleetSpec, LoraTraffic, SharedPrefix, Workload};
pub use generator::Request;
pub(crate) use generator::{WORDS, cdf, draw, words};
pub use load::{MAX_OBJECTIVE_BYTES, MAX_TENANT_BYTES, WorkloadError};

#[cfg(test)]
mod tests;
