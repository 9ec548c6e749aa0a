//! What the harness-less benchmarks share: their command-line arguments and the kvroute
//! child process they measure.

// Each benchmark compiles this module on its own and uses part of it.
#![allow(dead_code)]

use std::process::Child;

/// The value after `--name` on the command line, parsed; `None` when absent.
///
/// # Panics
/// When the value does not parse: a benchmark run with a typo should stop, not measure
/// something else.
pub fn arg<T: std::str::FromStr>(name: &str) -> Option<T> {
    let args: Vec<String> = std::env::args().collect();
    let value = args
        .iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))?;
    match value.parse() {
        Ok(parsed) => Some(parsed),
        Err(_) => panic!("{name} {value}: not a valid value"),
    }
}

/// Whether `--flag` is on the command line.
pub fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

/// The arguments after `--kvroute-args`, passed on to `kvroute serve`.
pub fn extra_kvroute_args() -> Vec<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--kvroute-args")
        .map_or_else(Vec::new, |i| args[i + 1..].to_vec())
        .into_iter()
        // `cargo bench` appends its own `--bench` to the benchmark's arguments.
        .filter(|a| a != "--bench")
        .collect()
}

/// A child process killed (and reaped) when dropped.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
