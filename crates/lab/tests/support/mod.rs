//! What the laboratory's end-to-end tests share: where the workspace's tools are, and
//! which processes a run left behind.

use std::path::{Path, PathBuf};

/// A path relative to the workspace root.
pub fn in_workspace(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative)
}

/// The Envoy binary: `$ENVOY_BIN`, else the project's `.venv/bin/envoy`.
pub fn envoy_binary() -> PathBuf {
    std::env::var_os("ENVOY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| in_workspace(".venv/bin/envoy"))
}

/// Processes (other than ours) whose environment carries `variable=marker`: what the run
/// started, as `pid: command line`.
pub fn processes_marked(variable: &str, marker: &str) -> Vec<String> {
    let needle = format!("{variable}={marker}");
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let pid = entry.file_name().to_string_lossy().to_string();
        if !pid.chars().all(|c| c.is_ascii_digit()) || pid == std::process::id().to_string() {
            continue;
        }
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if environ
            .split(|b| *b == 0)
            .any(|var| var == needle.as_bytes())
        {
            let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            found.push(format!(
                "{pid}: {}",
                String::from_utf8_lossy(&cmd).replace('\0', " ")
            ));
        }
    }
    found
}
