//! The soak's load: open-loop Poisson arrivals at a fixed rate of short completions and chat
//! requests, half of them streamed, each sent whatever the others are doing (up to a bound
//! on requests in flight), its answer collected whole and classified as it ends.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::classify::{Answer, BodyEnd, Lost, NoHead, Outcome, PodKill, attribute, classify};
use crate::loadgen::workload::words;

/// The shape of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestKind {
    /// `/v1/completions`, `stream: true`.
    CompletionStream,
    /// `/v1/completions`, whole answer.
    Completion,
    /// `/v1/chat/completions`, `stream: true`.
    ChatStream,
    /// `/v1/chat/completions`, whole answer.
    Chat,
}

impl RequestKind {
    const ALL: [RequestKind; 4] = [
        RequestKind::CompletionStream,
        RequestKind::Completion,
        RequestKind::ChatStream,
        RequestKind::Chat,
    ];

    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            RequestKind::CompletionStream => "completion_stream",
            RequestKind::Completion => "completion",
            RequestKind::ChatStream => "chat_stream",
            RequestKind::Chat => "chat",
        }
    }

    fn streamed(self) -> bool {
        matches!(
            self,
            RequestKind::CompletionStream | RequestKind::ChatStream
        )
    }

    fn path(self) -> &'static str {
        match self {
            RequestKind::CompletionStream | RequestKind::Completion => "/v1/completions",
            RequestKind::ChatStream | RequestKind::Chat => "/v1/chat/completions",
        }
    }
}

/// System prompts shared by a part of the chat requests, as an application's would be.
const SYSTEM_PROMPTS: u64 = 8;

/// One request of the soak: its kind and JSON body. Pure and seeded.
pub fn request(rng: &mut impl Rng, model: &str) -> (RequestKind, Value) {
    let kind = RequestKind::ALL[rng.random_range(0..RequestKind::ALL.len())];
    let prompt_words = rng.random_range(16..=256);
    let prompt = words(rng, prompt_words);
    let max_tokens: u32 = rng.random_range(8..=64);
    let mut body = match kind {
        RequestKind::CompletionStream | RequestKind::Completion => {
            json!({"model": model, "prompt": prompt})
        }
        RequestKind::ChatStream | RequestKind::Chat => {
            let mut messages = Vec::with_capacity(2);
            if rng.random_bool(0.5) {
                let system = rng.random_range(0..SYSTEM_PROMPTS);
                let mut seeded = SmallRng::seed_from_u64(system);
                messages.push(json!({"role": "system", "content": words(&mut seeded, 200)}));
            }
            messages.push(json!({"role": "user", "content": prompt}));
            json!({"model": model, "messages": messages})
        }
    };
    if let Some(map) = body.as_object_mut() {
        map.insert("max_tokens".into(), json!(max_tokens));
        if kind.streamed() {
            map.insert("stream".into(), json!(true));
            map.insert("stream_options".into(), json!({"include_usage": true}));
        }
    }
    (kind, body)
}

/// What the load runs against and how.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Base URL of the gateway.
    pub base_url: String,
    /// Requests per wall-clock second.
    pub rate: f64,
    /// How long arrivals last.
    pub duration: Duration,
    /// Requests in flight at most; one arriving beyond is not sent.
    pub max_in_flight: usize,
    /// A request without a whole answer after this long is cut by the client.
    pub timeout: Duration,
    /// Generator seed.
    pub seed: u64,
    /// Model to ask for.
    pub model: String,
}

/// Largest body kept: far above any answer the soak's requests get.
const MAX_BODY: usize = 1 << 20;

/// One request's end, as the collector needs it.
struct Ended {
    kind: RequestKind,
    outcome: Outcome,
    answer: Answer,
    pod: Option<usize>,
    began_s: f64,
    ended_s: f64,
}

/// Sends one request and collects its answer until `deadline`.
async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    deadline: Instant,
) -> (Answer, Option<usize>) {
    let response = match tokio::time::timeout_at(deadline, client.post(url).json(body).send()).await
    {
        Err(_) => return (Answer::NoHead(NoHead::Timeout), None),
        Ok(Err(e)) if e.is_connect() => return (Answer::NoHead(NoHead::Connect), None),
        Ok(Err(e)) if e.is_timeout() => return (Answer::NoHead(NoHead::Timeout), None),
        Ok(Err(_)) => return (Answer::NoHead(NoHead::Reset), None),
        Ok(Ok(response)) => response,
    };
    let status = response.status().as_u16();
    let pod = response
        .headers()
        .get("x-sim-pod")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let mut response = response;
    let mut body = Vec::new();
    let end = loop {
        match tokio::time::timeout_at(deadline, response.chunk()).await {
            Err(_) => break BodyEnd::Timeout,
            Ok(Ok(None)) => break BodyEnd::Complete,
            Ok(Ok(Some(chunk))) => {
                if body.len() + chunk.len() > MAX_BODY {
                    break BodyEnd::TooLarge;
                }
                body.extend_from_slice(&chunk);
            }
            Ok(Err(e)) => break BodyEnd::Broken(format!("{e:#}")),
        }
    };
    (Answer::Response { status, body, end }, pod)
}

/// Counts of what became of the requests.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Tally {
    /// Requests sent.
    pub sent: u64,
    /// Requests not sent: `max_in_flight` were already in flight.
    pub skipped: u64,
    /// Outcomes by key (see [`Outcome::key`]).
    pub outcomes: BTreeMap<String, u64>,
    /// Outcomes by request kind, then key.
    pub by_kind: BTreeMap<String, BTreeMap<String, u64>>,
    /// Requests that did not complete, by the second (since the start) their answer ended,
    /// then key; requests not sent count as `skipped` at the second they were due.
    pub failures_per_s: BTreeMap<u64, BTreeMap<String, u64>>,
    /// Completed requests per second.
    pub completed_per_s: BTreeMap<u64, u64>,
    /// The first lost requests, described.
    pub lost_examples: Vec<String>,
}

/// Lost requests described in the report at most.
const LOST_EXAMPLES: usize = 30;

impl Tally {
    fn record(&mut self, kind: RequestKind, outcome: &Outcome, ended_s: f64, detail: String) {
        let key = outcome.key();
        let second = ended_s.max(0.0) as u64;
        if *outcome == Outcome::Completed {
            *self.completed_per_s.entry(second).or_default() += 1;
        } else {
            *self
                .failures_per_s
                .entry(second)
                .or_default()
                .entry(key.clone())
                .or_default() += 1;
        }
        if outcome.is_lost() && self.lost_examples.len() < LOST_EXAMPLES {
            self.lost_examples.push(detail);
        }
        *self
            .by_kind
            .entry(kind.name().to_string())
            .or_default()
            .entry(key.clone())
            .or_default() += 1;
        *self.outcomes.entry(key).or_default() += 1;
    }

    fn skip(&mut self, at_s: f64) {
        self.skipped += 1;
        *self
            .failures_per_s
            .entry(at_s.max(0.0) as u64)
            .or_default()
            .entry("skipped".into())
            .or_default() += 1;
    }

    /// Requests counted with `key`.
    pub fn count(&self, key: &str) -> u64 {
        self.outcomes.get(key).copied().unwrap_or(0)
    }

    /// Requests lost.
    pub fn lost(&self) -> u64 {
        self.outcomes
            .iter()
            .filter(|(k, _)| k.starts_with("lost "))
            .map(|(_, n)| n)
            .sum()
    }
}

fn describe(ended: &Ended) -> String {
    let answer = match &ended.answer {
        Answer::NoHead(why) => format!("no response head ({why:?})"),
        Answer::Response { status, body, end } => {
            let text = String::from_utf8_lossy(&body[..body.len().min(160)]);
            format!(
                "status {status}, body end {end:?}, {} bytes: {text:?}",
                body.len()
            )
        }
    };
    format!(
        "{} at {:.2}-{:.2} s, pod {:?}: {}",
        ended.kind.name(),
        ended.began_s,
        ended.ended_s,
        ended.pod,
        answer
    )
}

/// Runs the load from `epoch` for `spec.duration`, then waits for the requests in flight.
/// Streams cut by a pod kill are told apart once `kills` is known, at the end: they are kept
/// aside until then (few), everything else is counted as it ends.
pub async fn drive(
    spec: LoadSpec,
    epoch: Instant,
    kills: tokio::sync::watch::Receiver<Vec<PodKill>>,
) -> Tally {
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(spec.max_in_flight)
        .build()
        .unwrap_or_default();
    let base = spec.base_url.trim_end_matches('/').to_string();
    let limit = Arc::new(Semaphore::new(spec.max_in_flight));
    let mut rng = SmallRng::seed_from_u64(spec.seed);
    let mut tally = Tally::default();
    let mut tasks: JoinSet<Ended> = JoinSet::new();
    let mut cut: Vec<Ended> = Vec::new();
    let collect = |ended: Ended, tally: &mut Tally, cut: &mut Vec<Ended>| {
        if ended.outcome == Outcome::Lost(Lost::Truncated) {
            cut.push(ended);
        } else {
            let detail = describe(&ended);
            tally.record(ended.kind, &ended.outcome, ended.ended_s, detail);
        }
    };
    let end = epoch + spec.duration;
    let mut next = epoch;
    loop {
        let gap: f64 = -(1.0 - rng.random::<f64>()).ln() / spec.rate;
        next += Duration::from_secs_f64(gap);
        if next >= end {
            break;
        }
        // Collect what ended while waiting for the next arrival.
        loop {
            tokio::select! {
                biased;
                Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Ok(ended) = joined {
                        collect(ended, &mut tally, &mut cut);
                    }
                }
                () = tokio::time::sleep_until(next) => break,
            }
        }
        let (kind, body) = request(&mut rng, &spec.model);
        let at_s = (next - epoch).as_secs_f64();
        let Ok(permit) = Arc::clone(&limit).try_acquire_owned() else {
            tally.skip(at_s);
            continue;
        };
        tally.sent += 1;
        let url = format!("{base}{}", kind.path());
        let client = client.clone();
        let timeout = spec.timeout;
        tasks.spawn(async move {
            let began = Instant::now();
            let (answer, pod) = send(&client, &url, &body, began + timeout).await;
            drop(permit);
            let outcome = classify(&answer, kind.streamed());
            Ended {
                kind,
                outcome,
                answer,
                pod,
                began_s: (began - epoch).as_secs_f64(),
                ended_s: epoch.elapsed().as_secs_f64(),
            }
        });
    }
    while let Some(joined) = tasks.join_next().await {
        if let Ok(ended) = joined {
            collect(ended, &mut tally, &mut cut);
        }
    }
    let kills = kills.borrow().clone();
    for ended in cut {
        let outcome = attribute(
            ended.outcome.clone(),
            &ended.answer,
            ended.pod,
            ended.began_s,
            ended.ended_s,
            &kills,
        );
        let detail = describe(&ended);
        tally.record(ended.kind, &outcome, ended.ended_s, detail);
    }
    tally
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_mix_every_kind_with_short_bounded_outputs() {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut seen = BTreeMap::new();
        for _ in 0..400 {
            let (kind, body) = request(&mut rng, "m");
            *seen.entry(kind).or_insert(0) += 1;
            let max_tokens = body["max_tokens"].as_u64().expect("max_tokens");
            assert!((8..=64).contains(&max_tokens));
            assert_eq!(body["stream"] == true, kind.streamed());
            assert_eq!(body["model"], "m");
        }
        assert_eq!(seen.len(), 4);
        assert!(seen.values().all(|n| *n > 60), "{seen:?}");
    }

    #[test]
    fn tally_counts_outcomes_by_key_and_second() {
        let mut t = Tally::default();
        t.record(RequestKind::Chat, &Outcome::Completed, 1.5, String::new());
        let refused = Outcome::Refused {
            status: 503,
            code: "picker_unavailable".into(),
        };
        t.record(RequestKind::Chat, &refused, 2.2, String::new());
        t.record(
            RequestKind::Completion,
            &Outcome::Lost(Lost::Reset),
            2.9,
            "x".into(),
        );
        t.skip(3.1);
        assert_eq!(t.count("completed"), 1);
        assert_eq!(t.count("error 503 picker_unavailable"), 1);
        assert_eq!(t.lost(), 1);
        assert_eq!(t.skipped, 1);
        assert_eq!(t.failures_per_s[&2].len(), 2);
        assert_eq!(t.failures_per_s[&3]["skipped"], 1);
        assert_eq!(t.lost_examples, vec!["x"]);
    }
}
