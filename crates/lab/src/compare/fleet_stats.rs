//! What the fleet did during a run, read the way any client would: every pod's `/metrics`,
//! sampled on a wall-clock period while the load runs (`Sampler`), then cut into the ladder's
//! steps (`window`). Counters (preemptions, adapter loads, prefix-cache hits and queries) are
//! summed over the pods and read at a step's boundaries by linear interpolation between the
//! two samples around it; the KV spread is `max − min` of the pods' `kv_cache_usage_perc` in
//! one sample, averaged (and maxed) over the samples inside the step.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use kvroute_core::exposition;
use kvroute_core::vllm::parse_vllm_metrics;

/// The simulator's adapter-load counter (not a vLLM metric; docs/simulator.md).
const LORA_LOADS: &str = "kvroute_sim:lora_loads_total";

/// One pod's reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PodSample {
    /// `vllm:kv_cache_usage_perc`, 0–1.
    pub kv_usage: f64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: f64,
    /// `vllm:prefix_cache_hits_total` (tokens).
    pub prefix_hits: f64,
    /// `vllm:prefix_cache_queries_total` (tokens).
    pub prefix_queries: f64,
    /// `kvroute_sim:lora_loads_total{source="disk"}`.
    pub lora_loads_disk: f64,
    /// `kvroute_sim:lora_loads_total{source="host"}`.
    pub lora_loads_host: f64,
}

/// Reads one pod's `/metrics` text; None when it is not vLLM's exposition.
pub fn parse_pod(text: &str) -> Option<PodSample> {
    let m = parse_vllm_metrics(text).ok()?;
    let mut sample = PodSample {
        kv_usage: m.kv_usage,
        preemptions: m.preemptions_total.unwrap_or(0.0),
        prefix_hits: m.prefix_cache_hits_total.unwrap_or(0.0),
        prefix_queries: m.prefix_cache_queries_total.unwrap_or(0.0),
        ..PodSample::default()
    };
    for s in exposition::parse_where(text, |name| name == LORA_LOADS).ok()? {
        if s.name == LORA_LOADS {
            match s.label("source") {
                Some("host") => sample.lora_loads_host += s.value,
                _ => sample.lora_loads_disk += s.value,
            }
        }
    }
    Some(sample)
}

/// The whole fleet at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FleetSample {
    /// Wall seconds since the sampler's epoch.
    pub t: f64,
    /// Per pod, in fleet order; None where the scrape failed.
    pub pods: Vec<Option<PodSample>>,
}

/// Fleet-wide counter totals at one time (from samples, a pod whose scrape failed keeps
/// its last value; or read off simulated engines).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Totals {
    pub(crate) preemptions: f64,
    pub(crate) prefix_hits: f64,
    pub(crate) prefix_queries: f64,
    pub(crate) lora_loads_disk: f64,
    pub(crate) lora_loads_host: f64,
}

impl Totals {
    fn lerp(a: Totals, b: Totals, f: f64) -> Totals {
        let l = |x: f64, y: f64| x + (y - x) * f;
        Totals {
            preemptions: l(a.preemptions, b.preemptions),
            prefix_hits: l(a.prefix_hits, b.prefix_hits),
            prefix_queries: l(a.prefix_queries, b.prefix_queries),
            lora_loads_disk: l(a.lora_loads_disk, b.lora_loads_disk),
            lora_loads_host: l(a.lora_loads_host, b.lora_loads_host),
        }
    }
}

fn totals(samples: &[FleetSample]) -> Vec<(f64, Totals)> {
    let mut last: Vec<Option<PodSample>> = Vec::new();
    samples
        .iter()
        .map(|s| {
            last.resize(s.pods.len().max(last.len()), None);
            for (slot, pod) in last.iter_mut().zip(&s.pods) {
                if pod.is_some() {
                    *slot = *pod;
                }
            }
            let mut t = Totals::default();
            for p in last.iter().flatten() {
                t.preemptions += p.preemptions;
                t.prefix_hits += p.prefix_hits;
                t.prefix_queries += p.prefix_queries;
                t.lora_loads_disk += p.lora_loads_disk;
                t.lora_loads_host += p.lora_loads_host;
            }
            (s.t, t)
        })
        .collect()
}

/// Counter totals at time `t`, interpolated between the samples around it (clamped at the ends).
fn totals_at(series: &[(f64, Totals)], t: f64) -> Totals {
    let Some(first) = series.first() else {
        return Totals::default();
    };
    if t <= first.0 {
        return first.1;
    }
    for pair in series.windows(2) {
        let ((t0, a), (t1, b)) = (pair[0], pair[1]);
        if t <= t1 {
            let f = if t1 > t0 { (t - t0) / (t1 - t0) } else { 1.0 };
            return Totals::lerp(a, b, f);
        }
    }
    series.last().map_or_else(Totals::default, |l| l.1)
}

/// `max − min` of the pods' KV usage in one sample; None with fewer than one reading.
pub fn kv_spread(usages: &[f64]) -> Option<f64> {
    let max = usages.iter().copied().reduce(f64::max)?;
    let min = usages.iter().copied().reduce(f64::min)?;
    Some(max - min)
}

/// What the fleet did in a window of the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct WindowStats {
    /// Recompute preemptions, all pods.
    pub preemptions: f64,
    /// Adapter loads into a GPU slot, all pods (disk + host).
    pub lora_loads: f64,
    /// Of which cold loads from disk.
    pub lora_loads_disk: f64,
    /// Prefix-cache hits, tokens.
    pub prefix_hits: f64,
    /// Prefix-cache queries, tokens.
    pub prefix_queries: f64,
    /// hits / queries; None without queries.
    pub prefix_hit_rate: Option<f64>,
    /// Mean over the window's samples of `max − min` KV usage across pods.
    pub kv_spread_mean: Option<f64>,
    /// Largest such spread in the window.
    pub kv_spread_max: Option<f64>,
    /// Mean KV usage over pods and samples.
    pub kv_usage_mean: Option<f64>,
    /// Samples inside the window.
    pub samples: usize,
}

/// The fleet's activity between wall times `from` and `to` (seconds since the epoch).
pub fn window(samples: &[FleetSample], from: f64, to: f64) -> WindowStats {
    let series = totals(samples);
    let (a, b) = (totals_at(&series, from), totals_at(&series, to));
    let (mut spreads, mut usage, mut usage_n) = (Vec::new(), 0.0, 0usize);
    for s in samples.iter().filter(|s| s.t >= from && s.t <= to) {
        let kv: Vec<f64> = s.pods.iter().flatten().map(|p| p.kv_usage).collect();
        usage += kv.iter().sum::<f64>();
        usage_n += kv.len();
        spreads.extend(kv_spread(&kv));
    }
    window_between(a, b, &spreads, usage, usage_n)
}

/// The fleet's activity between counter totals `a` and `b`, with the KV spreads and the
/// sum and count of KV usages sampled between them.
pub(crate) fn window_between(
    a: Totals,
    b: Totals,
    spreads: &[f64],
    usage: f64,
    usage_n: usize,
) -> WindowStats {
    let d = |x: f64, y: f64| (y - x).max(0.0);
    let prefix_hits = d(a.prefix_hits, b.prefix_hits);
    let prefix_queries = d(a.prefix_queries, b.prefix_queries);
    let lora_loads_disk = d(a.lora_loads_disk, b.lora_loads_disk);
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    WindowStats {
        preemptions: d(a.preemptions, b.preemptions),
        lora_loads: lora_loads_disk + d(a.lora_loads_host, b.lora_loads_host),
        lora_loads_disk,
        prefix_hits,
        prefix_queries,
        prefix_hit_rate: (prefix_queries > 0.0).then(|| prefix_hits / prefix_queries),
        kv_spread_mean: mean(spreads),
        kv_spread_max: spreads.iter().copied().reduce(f64::max),
        kv_usage_mean: (usage_n > 0).then(|| usage / usage_n as f64),
        samples: spreads.len(),
    }
}

/// Samples every pod's `/metrics` every `period` until finished; aborted when dropped.
pub struct Sampler {
    task: Option<JoinHandle<Vec<FleetSample>>>,
    stop: Option<oneshot::Sender<()>>,
}

impl Sampler {
    /// Starts sampling `pods` now; sample times are seconds since `epoch`.
    pub fn start(pods: Vec<SocketAddr>, period: Duration, epoch: Instant) -> Sampler {
        let (stop, mut stopped) = oneshot::channel();
        let task = tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(1))
                .build()
                .unwrap_or_default();
            let urls: Vec<String> = pods.iter().map(|p| format!("http://{p}/metrics")).collect();
            let mut ticks = tokio::time::interval(period);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut samples = Vec::new();
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = ticks.tick() => {}
                }
                samples.push(sample(&client, &urls, epoch).await);
            }
            // A last reading, so the run's end lies inside the series.
            samples.push(sample(&client, &urls, epoch).await);
            samples
        });
        Sampler {
            task: Some(task),
            stop: Some(stop),
        }
    }

    /// Stops sampling and returns the samples (empty if the task failed).
    pub async fn finish(mut self) -> Vec<FleetSample> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task.await.unwrap_or_default(),
            None => Vec::new(),
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

async fn sample(client: &reqwest::Client, urls: &[String], epoch: Instant) -> FleetSample {
    let t = epoch.elapsed().as_secs_f64();
    let reads = urls.iter().map(|url| async move {
        let text = client.get(url).send().await.ok()?.text().await.ok()?;
        parse_pod(&text)
    });
    FleetSample {
        t,
        pods: futures::future::join_all(reads).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(kv: f64, preemptions: f64, hits: f64, queries: f64, loads: f64) -> Option<PodSample> {
        Some(PodSample {
            kv_usage: kv,
            preemptions,
            prefix_hits: hits,
            prefix_queries: queries,
            lora_loads_disk: loads,
            lora_loads_host: 0.0,
        })
    }

    #[test]
    fn the_kv_spread_is_the_gap_between_the_fullest_and_the_emptiest_pod() {
        assert_eq!(kv_spread(&[0.2, 0.9, 0.5]), Some(0.9 - 0.2));
        assert_eq!(kv_spread(&[0.4]), Some(0.0));
        assert_eq!(kv_spread(&[]), None);
    }

    #[test]
    fn a_window_averages_the_spread_of_its_samples_and_differences_the_counters() {
        let samples = vec![
            FleetSample {
                t: 0.0,
                pods: vec![pod(0.0, 0.0, 0.0, 0.0, 0.0), pod(0.0, 0.0, 0.0, 0.0, 0.0)],
            },
            FleetSample {
                t: 1.0,
                pods: vec![
                    pod(0.8, 2.0, 10.0, 100.0, 1.0),
                    pod(0.2, 0.0, 0.0, 0.0, 1.0),
                ],
            },
            // The second pod's scrape failed: its last reading counts.
            FleetSample {
                t: 2.0,
                pods: vec![pod(0.5, 4.0, 30.0, 200.0, 1.0), None],
            },
        ];
        let w = window(&samples, 0.5, 2.0);
        // Counters at t = 0.5 are half-way between the first two samples.
        assert!((w.preemptions - 3.0).abs() < 1e-9);
        assert!((w.prefix_hits - 25.0).abs() < 1e-9);
        assert!((w.prefix_queries - 150.0).abs() < 1e-9);
        assert!((w.prefix_hit_rate.expect("rate") - 25.0 / 150.0).abs() < 1e-9);
        assert!((w.lora_loads - 1.0).abs() < 1e-9);
        // Samples at 1.0 (spread 0.6) and 2.0 (one pod: spread 0).
        assert_eq!(w.samples, 2);
        assert!((w.kv_spread_mean.expect("spread") - 0.3).abs() < 1e-9);
        assert!((w.kv_spread_max.expect("max") - 0.6).abs() < 1e-9);
        let empty = window(&[], 0.0, 1.0);
        assert_eq!(empty.samples, 0);
        assert_eq!(empty.kv_spread_mean, None);
        assert_eq!(empty.prefix_hit_rate, None);
    }

    #[test]
    fn the_simulators_exposition_gives_every_reading() {
        let text = "\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine=\"0\",model_name=\"m\"} 3.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 40.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 10.0
# TYPE kvroute_sim:lora_loads counter
kvroute_sim:lora_loads_total{engine=\"0\",model_name=\"m\",source=\"disk\"} 2.0
kvroute_sim:lora_loads_total{engine=\"0\",model_name=\"m\",source=\"host\"} 1.0
";
        let p = parse_pod(text).expect("parses");
        assert_eq!(
            p,
            PodSample {
                kv_usage: 0.25,
                preemptions: 3.0,
                prefix_hits: 10.0,
                prefix_queries: 40.0,
                lora_loads_disk: 2.0,
                lora_loads_host: 1.0,
            }
        );
        assert_eq!(parse_pod("not metrics"), None);
    }
}
