//! The README's quick start, run as a new user would: `kvroute-lab up`, every command it
//! prints, `kvroute tap` in another terminal, then Ctrl-C. The README's transcript is this
//! run's output (on the documented ports): the test fails when the two differ beyond what
//! changes from run to run (ids, clocks, generated words, timings, which of two equal pods
//! served), and `KVROUTE_UPDATE_README=1` rewrites the transcript from this run.

// Test helpers: a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use clap::Parser;
use rustix::process::{Pid, Signal, kill_process};

use kvroute_lab::envoy::free_port;
use kvroute_lab::up::{PORT_FLAGS, READY_LINE, Try, UpArgs, instructions, tries};
use support::{envoy_binary, processes_marked};

const README: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
const BEGIN: &str = "<!-- BEGIN quickstart transcript: crates/lab/tests/quickstart.rs checks it; KVROUTE_UPDATE_README=1 rewrites it -->";
const END: &str = "<!-- END quickstart transcript -->";
/// Longest wait for anything the run prints.
const PATIENCE: Duration = Duration::from_secs(90);

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    up: UpArgs,
}

fn up_args(args: &[String]) -> UpArgs {
    Cli::parse_from(std::iter::once("up".to_string()).chain(args.iter().cloned())).up
}

/// A child whose lines arrive on channels, killed when dropped.
struct Lines {
    child: Child,
    stdout: mpsc::Receiver<String>,
    stderr: mpsc::Receiver<String>,
}

fn forward(from: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (send, receive) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            if send.send(line).is_err() {
                break;
            }
        }
    });
    receive
}

impl Lines {
    fn spawn(command: &mut Command) -> Lines {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let stdout = forward(child.stdout.take().expect("stdout"));
        let stderr = forward(child.stderr.take().expect("stderr"));
        Lines {
            child,
            stdout,
            stderr,
        }
    }

    /// Lines from `from` up to and including the first one `until` accepts.
    fn until(
        from: &mpsc::Receiver<String>,
        what: &str,
        until: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let mut lines = Vec::new();
        loop {
            match from.recv_timeout(PATIENCE) {
                Ok(line) => {
                    let done = until(&line);
                    lines.push(line);
                    if done {
                        return lines;
                    }
                }
                Err(e) => panic!("waiting for {what}: {e}; so far:\n{}", lines.join("\n")),
            }
        }
    }

    /// Every line left, once the process has closed its output.
    fn rest(from: &mpsc::Receiver<String>) -> Vec<String> {
        let mut lines = Vec::new();
        while let Ok(line) = from.recv_timeout(PATIENCE) {
            lines.push(line);
        }
        lines
    }

    fn interrupt(&self) {
        kill_process(Pid::from_child(&self.child), Signal::INT).expect("SIGINT");
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port p with p+1 free too, for two pods.
fn two_free_ports() -> u16 {
    loop {
        let port = free_port().expect("port");
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
}

/// What a command printed, as the transcript shows it.
struct Ran {
    command: String,
    output: String,
}

#[test]
fn the_readme_quick_start_runs_as_written() {
    let logs = tempfile::tempdir().expect("tempdir");
    let mut flags: Vec<String> = Vec::new();
    for flag in PORT_FLAGS {
        flags.extend([flag.to_string(), free_port().expect("port").to_string()]);
    }
    flags.extend(["--pods-port".into(), two_free_ports().to_string()]);
    flags.extend(["--log-dir".into(), logs.path().display().to_string()]);
    let here = up_args(&flags);
    let documented = up_args(&[]);
    // The ports of this run, and the documented ones they stand for in the transcript.
    let ports: Vec<(u16, u16)> = here
        .ports()
        .into_iter()
        .zip(documented.ports())
        .chain([
            (here.pods_port, documented.pods_port),
            (here.pods_port + 1, documented.pods_port + 1),
        ])
        .collect();
    let log_dir = logs.path().display().to_string();
    let as_documented = |text: &str| {
        ports.iter().fold(
            text.replace(&log_dir, "kvroute-up"),
            |text, (here, documented)| replace_port(&text, *here, *documented),
        )
    };

    let kvroute = kvroute_lab::gateway_binary().expect("the kvroute binary is built");
    // Every process `up` starts inherits this: none may be left after Ctrl-C.
    let marker = format!("{}-{}", std::process::id(), here.port);
    let up = Lines::spawn(
        Command::new(env!("CARGO_BIN_EXE_kvroute-lab"))
            .arg("up")
            .args(&flags)
            .env("ENVOY_BIN", envoy_binary())
            .env("KVROUTE_BIN", &kvroute)
            .env("KVROUTE_QUICKSTART_TEST_MARK", &marker)
            // The documented run has `kvroute` off PATH (the note that says how to install it).
            .env("PATH", "/usr/bin:/bin"),
    );
    let printed = Lines::until(&up.stdout, "the instructions", |l| l == READY_LINE);
    assert_eq!(
        format!("{}\n", printed.join("\n")),
        instructions(&here, false),
        "`up` prints its instructions for the ports it was given"
    );

    let tap = Lines::spawn(
        Command::new(&kvroute)
            .arg("tap")
            .args(["--admin-addr", &format!("127.0.0.1:{}", here.admin_port)]),
    );
    Lines::until(&tap.stderr, "the tap to subscribe", |l| {
        l.starts_with("watching kvroute's decisions")
    });

    let mut ran = Vec::new();
    for (Try { command, .. }, shown) in tries(&here).into_iter().zip(tries(&documented)) {
        if command.starts_with("kvroute tap") {
            continue;
        }
        let shell = match command.strip_prefix("kvroute ") {
            Some(rest) => format!("{} {rest}", kvroute.display()),
            None => command.clone(),
        };
        let output = Command::new("sh")
            .args(["-c", &shell])
            .output()
            .expect("sh runs");
        assert!(
            output.status.success(),
            "`{command}` failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        ran.push(Ran {
            command: shown.command,
            output: as_documented(&String::from_utf8_lossy(&output.stdout)),
        });
    }
    // The last request sent is the unknown model; its refusal is the tap's last line.
    let tapped = Lines::until(&tap.stdout, "the tap to show the refusal", |l| {
        l.contains("no-such-model") && l.contains("not routed")
    });
    tap.interrupt();

    up.interrupt();
    let stopped = Lines::rest(&up.stdout);
    let stderr = Lines::rest(&up.stderr);
    let mut up = up;
    let status = up.child.wait().expect("wait");
    assert!(status.success(), "up exited with {status}: {stderr:?}");
    assert_eq!(stopped, ["stopped."], "stderr: {stderr:?}");
    let shutdown: Vec<&String> = stderr
        .iter()
        .skip_while(|l| !l.starts_with("stopping"))
        .collect();
    assert!(
        shutdown.iter().any(|l| l.contains("kvroute::app: stopped")),
        "kvroute logs its shutdown: {stderr:?}"
    );
    let leftover = processes_marked("KVROUTE_QUICKSTART_TEST_MARK", &marker);
    assert!(
        leftover.is_empty(),
        "left running after Ctrl-C: {leftover:?}"
    );
    for &(port, _) in &ports {
        std::net::TcpListener::bind(("127.0.0.1", port))
            .unwrap_or_else(|e| panic!("port {port} still held after Ctrl-C: {e}"));
    }

    let fresh = transcript(&documented, &ran, &tapped, &shutdown, &as_documented);
    let readme = std::fs::read_to_string(README).expect("README");
    let (Some(begin), Some(end)) = (readme.find(BEGIN), readme.find(END)) else {
        panic!("the README lacks the quick start's markers {BEGIN} … {END}");
    };
    let written = &readme[begin + BEGIN.len()..end];
    if std::env::var_os("KVROUTE_UPDATE_README").is_some() {
        let updated = format!("{}{BEGIN}{fresh}{}", &readme[..begin], &readme[end..]);
        std::fs::write(README, updated).expect("write README");
        return;
    }
    let (fresh_shape, written_shape) = (shape(&fresh), shape(written));
    if fresh_shape != written_shape {
        let first = fresh_shape
            .lines()
            .zip(written_shape.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(
                fresh_shape
                    .lines()
                    .count()
                    .min(written_shape.lines().count()),
            );
        panic!(
            "the README's quick start transcript is stale (first difference at line {}: now {:?}, README {:?}); \
             run `KVROUTE_UPDATE_README=1 cargo nextest run -p kvroute-lab --test quickstart` and review the diff",
            first + 1,
            fresh_shape.lines().nth(first),
            written_shape.lines().nth(first),
        );
    }
}

/// `127.0.0.1:here` as `127.0.0.1:documented`; where a column's padding follows (two
/// spaces), the padding grows by what the port shrank, so that tables stay aligned.
fn replace_port(text: &str, here: u16, documented: u16) -> String {
    let (from, to) = (
        format!("127.0.0.1:{here}"),
        format!("127.0.0.1:{documented}"),
    );
    let pad = " ".repeat(from.len().saturating_sub(to.len()));
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(&from) {
        out.push_str(&rest[..at]);
        out.push_str(&to);
        rest = &rest[at + from.len()..];
        if rest.starts_with("  ") {
            out.push_str(&pad);
        }
    }
    out.push_str(rest);
    out
}

/// The Markdown between the README's markers.
fn transcript(
    documented: &UpArgs,
    ran: &[Ran],
    tapped: &[String],
    shutdown: &[&String],
    as_documented: &dyn Fn(&str) -> String,
) -> String {
    let mut md = String::from("\n```console\n$ scripts/up\n");
    md.push_str(&instructions(documented, false));
    md.push_str("```\n\n");
    let whats: Vec<Try> = tries(documented);
    for (what, ran) in whats
        .iter()
        .filter(|t| !t.command.starts_with("kvroute tap"))
        .zip(ran)
    {
        md.push_str(&format!(
            "{}\n\n```console\n$ {}\n{}",
            what.what, ran.command, ran.output
        ));
        if !ran.output.ends_with('\n') {
            md.push('\n');
        }
        md.push_str("```\n\n");
    }
    md.push_str(
        "Meanwhile `kvroute tap`, in a third terminal, printed each decision with its candidates' score terms:\n\n```console\n$ kvroute tap\nwatching kvroute's decisions at 127.0.0.1:9004 (Ctrl-C stops)\n",
    );
    for line in tapped {
        md.push_str(&as_documented(line));
        md.push('\n');
    }
    md.push_str("```\n\nCtrl-C in the first terminal stops everything:\n\n```console\n^C\n");
    for line in shutdown {
        md.push_str(&as_documented(line));
        md.push('\n');
    }
    md.push_str("stopped.\n```\n");
    md
}

/// What must stay the same between two runs: every line, with what varies masked.
/// JSON (a body, an SSE event) keeps its keys and fixed values; ids, clocks, generated
/// text and timing headers are masked; lines of `kvroute` output, metrics and logs keep
/// their words with digits masked and spacing folded; metric lines are sorted (the
/// exporter's order is not fixed).
fn shape(markdown: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut block: Vec<String> = Vec::new();
    let mut masked_digits = false;
    let mut sort_block = false;
    let flush = |block: &mut Vec<String>, out: &mut Vec<String>, sort: bool| {
        if sort {
            block.sort();
        }
        out.append(block);
    };
    for line in markdown.lines() {
        if let Some(command) = line.strip_prefix("$ ") {
            flush(&mut block, &mut out, sort_block);
            masked_digits = command.starts_with("kvroute ") || command.contains("/metrics");
            sort_block = command.contains("/metrics");
            out.push(line.to_string());
            continue;
        }
        if line.starts_with("```") || line.starts_with("^C") {
            flush(&mut block, &mut out, sort_block);
            masked_digits = line.starts_with("^C");
            sort_block = false;
            out.push(line.to_string());
            continue;
        }
        let shaped = if let Some(json) = line.strip_prefix("data: ").filter(|j| j.starts_with('{'))
        {
            format!("data: {}", mask_json(json))
        } else if line.starts_with('{') {
            mask_json(line)
        } else if let Some((name, _)) = line.split_once(": ").filter(|(name, _)| {
            ["date", "content-length", "x-envoy-upstream-service-time"].contains(name)
                || name.starts_with("x-sim-")
        }) {
            format!("{name}: #")
        } else if masked_digits {
            mask_tiers(&mask_digits(line))
        } else {
            line.to_string()
        };
        block.push(shaped);
    }
    flush(&mut block, &mut out, sort_block);
    out.join("\n")
}

/// A decision's reason and each candidate's adapter tier: which pod an adapter request
/// finds free depends on whether the last scrape still showed the previous adapter running.
fn mask_tiers(line: &str) -> String {
    let words: Vec<&str> = line.split(' ').collect();
    let mut out: Vec<&str> = Vec::with_capacity(words.len());
    for (i, word) in words.iter().enumerate() {
        let reason = i >= 2 && words[i - 2] == "->" && *word != "not";
        out.push(if word.starts_with("tier=") {
            "tier=#"
        } else if reason {
            "#"
        } else {
            word
        });
    }
    out.join(" ")
}

fn mask_digits(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut last = ' ';
    for c in line.chars() {
        let c = if c.is_ascii_digit() { '#' } else { c };
        // Runs of digits and of spaces fold to one: column widths follow the numbers.
        if (c == '#' || c == ' ') && c == last {
            continue;
        }
        out.push(c);
        last = c;
    }
    out
}

fn mask_json(text: &str) -> String {
    fn mask(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, value) in map.iter_mut() {
                    match key.as_str() {
                        "id" | "created" | "text" | "content" => {
                            *value = serde_json::Value::String("#".into());
                        }
                        _ => mask(value),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(mask),
            _ => {}
        }
    }
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(mut value) => {
            mask(&mut value);
            value.to_string()
        }
        Err(_) => text.to_string(),
    }
}

#[test]
fn a_port_is_replaced_keeping_columns_aligned() {
    assert_eq!(
        replace_port(
            "127.0.0.1:43210  yes, -> 127.0.0.1:43210 least",
            43210,
            8000
        ),
        "127.0.0.1:8000   yes, -> 127.0.0.1:8000 least"
    );
    assert_eq!(
        replace_port("127.0.0.1:432101", 43210, 8000),
        "127.0.0.1:80001"
    );
}

#[test]
fn the_shape_masks_what_varies_and_keeps_what_does_not() {
    let a = "$ curl x\n{\"id\":\"cmpl-1\",\"created\":5,\"choices\":[{\"text\":\" a b\",\"finish_reason\":\"length\"}]}\ndate: Fri\nx-sim-pod: 0\n```\n$ kvroute endpoints\n127.0.0.1:8000   yes   6ms\n```";
    let b = "$ curl x\n{\"id\":\"cmpl-2\",\"created\":7,\"choices\":[{\"text\":\" c\",\"finish_reason\":\"length\"}]}\ndate: Sat\nx-sim-pod: 1\n```\n$ kvroute endpoints\n127.0.0.1:8001 yes 12ms\n```";
    assert_eq!(shape(a), shape(b));
    let other_finish = a.replace("\"length\"", "\"stop\"");
    assert_ne!(shape(a), shape(&other_finish));
    let other_status = format!("{a}\nHTTP/1.1 200 OK");
    assert_ne!(
        shape(&other_status),
        shape(&format!("{a}\nHTTP/1.1 404 Not Found"))
    );
    let tap = |line: &str| shape(&format!("$ kvroute tap\n{line}\n```"));
    assert_eq!(
        tap(
            "12:00:01 legal -> 127.0.0.1:8000 lora_free_slot n=2\n  127.0.0.1:8001 tier=must_evict"
        ),
        tap("12:00:02 legal -> 127.0.0.1:8001 lora_warm n=2\n  127.0.0.1:8000 tier=free_slot")
    );
    assert_ne!(
        tap("12:00:01 legal -> 127.0.0.1:8000 lora_free_slot"),
        tap("12:00:01 legal -> not routed: no pod")
    );
    let metrics = |lines: &str| {
        shape(&format!(
            "$ curl -sS http://x/metrics | grep y\n{lines}\n```"
        ))
    };
    assert_eq!(metrics("a 1\nb 2"), metrics("b 3\na 4"));
    assert_ne!(metrics("a 1\nb 2"), metrics("a 1\nc 2"));
}
