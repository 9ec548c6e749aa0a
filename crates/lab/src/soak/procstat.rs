//! A process's resident memory and CPU time from `/proc` (Linux), and a sampler that
//! follows kvroute across its restarts once a second.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

/// `VmRSS` of `/proc/<pid>/status`, in bytes.
pub fn rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut fields = line["VmRSS:".len()..].split_whitespace();
    let value: u64 = fields.next()?.parse().ok()?;
    match fields.next() {
        Some("kB") => value.checked_mul(1024),
        _ => None,
    }
}

/// User plus system CPU time of `/proc/<pid>/stat`, in clock ticks (fields 14 and 15; the
/// command name in parentheses may itself hold spaces and parentheses, so fields are counted
/// from the last `)`).
pub fn cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // After the name: state (field 3), ..., utime (14), stime (15).
    let mut fields = after_name.split_whitespace().skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    user.checked_add(system)
}

/// One reading of the process.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the run started.
    pub t_s: f64,
    /// The process read.
    pub pid: u32,
    /// Resident set, MiB.
    pub rss_mib: f64,
    /// CPU over the last period, percent of one core; None on the first reading of a process.
    pub cpu_percent: Option<f64>,
}

fn read(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some((rss_bytes(&status)?, cpu_ticks(&stat)?))
}

/// A process's resident memory (bytes) and the CPU time it has used so far (seconds);
/// None when it cannot be read (gone, or not Linux).
pub fn usage(pid: u32) -> Option<(u64, f64)> {
    let (rss, ticks) = read(pid)?;
    Some((
        rss,
        ticks as f64 / rustix::param::clock_ticks_per_second() as f64,
    ))
}

/// Samples the process whose pid `pid` holds (None: none running) every `period` until
/// `stop` turns true; returns the samples.
pub async fn sample(
    pid: watch::Receiver<Option<u32>>,
    period: Duration,
    epoch: Instant,
    mut stop: watch::Receiver<bool>,
) -> Vec<Sample> {
    let ticks_per_s = rustix::param::clock_ticks_per_second() as f64;
    let mut samples = Vec::new();
    let mut last: Option<(u32, u64, Instant)> = None;
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        let Some(current) = *pid.borrow() else {
            last = None;
            continue;
        };
        let now = Instant::now();
        let Some((rss, ticks)) = read(current) else {
            last = None;
            continue;
        };
        let cpu_percent = match last {
            Some((p, before, at)) if p == current && now > at => {
                let busy = ticks.saturating_sub(before) as f64 / ticks_per_s;
                Some(100.0 * busy / (now - at).as_secs_f64())
            }
            _ => None,
        };
        last = Some((current, ticks, now));
        samples.push(Sample {
            t_s: (now - epoch).as_secs_f64(),
            pid: current,
            rss_mib: rss as f64 / (1024.0 * 1024.0),
            cpu_percent,
        });
    }
    samples
}

/// Shared handle on the pid being sampled.
pub type PidCell = Arc<watch::Sender<Option<u32>>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_is_read_from_the_status_file_in_bytes() {
        let status = "Name:\tkvroute\nVmPeak:\t  900 kB\nVmRSS:\t   23456 kB\nThreads:\t3\n";
        assert_eq!(rss_bytes(status), Some(23456 * 1024));
        assert_eq!(
            rss_bytes("Name:\tkthreadd\n"),
            None,
            "kernel threads have none"
        );
        assert_eq!(
            rss_bytes("VmRSS:\t12 MB\n"),
            None,
            "an unknown unit is not guessed"
        );
    }

    #[test]
    fn cpu_ticks_are_counted_after_a_name_with_spaces_and_parentheses() {
        let stat = "4242 (kv route) (x)) S 1 4242 4242 0 -1 4194560 1234 0 0 0 250 37 0 0 20 0 9 0 100 1000000 5000";
        assert_eq!(cpu_ticks(stat), Some(287));
        assert_eq!(cpu_ticks("4242 (cut"), None);
        assert_eq!(cpu_ticks("4242 (x) S 1 2"), None);
    }

    #[test]
    fn this_process_can_be_read() {
        let (rss, _) = read(std::process::id()).expect("our own /proc entry");
        assert!(rss > 0);
    }
}
