//! kvroute's laboratory: everything that proves the gateway, none of what ships.
//!
//! - [`loadgen`]: workload files and `bench`, a load generator for any OpenAI-compatible
//!   endpoint, reporting latencies as JSON;
//! - [`compare`]: the fleet comparison, kvroute against Envoy round robin / least request,
//!   sglang-router and vllm-router on identical simulated fleets (`kvroute-sim`);
//! - [`demo`]: the quick comparison the README's first command runs;
//! - [`envoy`]: runs Envoy locally with the shipped gateway configs;
//! - [`soak`]: a long run through Envoy and kvroute under faults (killed pods, broken
//!   `/metrics`, kvroute restarts), counting every request that is not answered;
//! - [`up`]: a small simulated fleet, kvroute and the shipped Envoy gateway on fixed ports,
//!   for trying kvroute by hand with `curl`;
//! - [`simulate`]: the whole fleet offline in virtual time: kvroute's core and the baseline
//!   policies against the simulator's engine for every pod, no sockets, no waits.
//!
//! The gateway is measured as a separate process, `kvroute serve`, found beside this
//! program or named with `--kvroute` ([`gateway_binary`]); the lab never links it.

pub mod compare;
pub mod demo;
pub mod envoy;
pub mod loadgen;
mod process;
pub mod simulate;
pub mod soak;
pub mod up;

use std::path::PathBuf;

use anyhow::Context;

/// The workload files `compare` runs when given none.
pub const WORKLOADS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/workloads");

/// `given` (a command's `--kvroute`), else [`gateway_binary`].
pub fn gateway_binary_or(given: Option<&std::path::Path>) -> anyhow::Result<PathBuf> {
    given.map_or_else(gateway_binary, |path| Ok(path.to_path_buf()))
}

/// `given` (a command's `--sim`), else [`sim_binary`].
pub fn sim_binary_or(given: Option<&std::path::Path>) -> anyhow::Result<PathBuf> {
    given.map_or_else(sim_binary, |path| Ok(path.to_path_buf()))
}

/// The gateway binary: `kvroute` beside this program (cargo builds every binary of the
/// workspace into one directory; tests and benchmarks run from its `deps/`).
pub fn gateway_binary() -> anyhow::Result<PathBuf> {
    binary_beside("kvroute", "--kvroute")
}

/// The simulator binary, `kvroute-sim`, beside this program.
pub fn sim_binary() -> anyhow::Result<PathBuf> {
    binary_beside("kvroute-sim", "--sim")
}

fn binary_beside(name: &str, flag: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot locate this program")?;
    let dir = exe
        .parent()
        .context("this program's path has no directory")?;
    let candidates = [Some(dir), dir.parent()];
    candidates
        .into_iter()
        .flatten()
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .with_context(|| {
            format!(
                "no `{name}` binary beside {}: build it with `cargo build --release -p {name}`, \
                 or pass {flag} PATH",
                exe.display()
            )
        })
}
