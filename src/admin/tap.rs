//! `kvroute tap` and `kvroute endpoints`: clients of the admin API that print
//! decisions live and the endpoint table, for an operator asking why traffic goes
//! where it goes.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;

use anyhow::Context;
use tonic::transport::Channel;

use super::pb::admin_client::AdminClient;
use super::pb::{self, decision_event::Outcome};

/// Flags of `kvroute tap`.
#[derive(Debug, Clone, clap::Args)]
pub struct TapArgs {
    /// Address of kvroute's admin API (its --admin-addr).
    #[arg(long, env = "KVROUTE_ADMIN_ADDR", default_value = "127.0.0.1:9004")]
    pub admin_addr: SocketAddr,
    /// Only decisions for this model or adapter.
    #[arg(long)]
    pub model: Option<String>,
    /// One JSON object per decision instead of text.
    #[arg(long)]
    pub json: bool,
    /// Candidates printed under each decision, best first.
    #[arg(long, default_value_t = 3)]
    pub top: usize,
}

/// Flags of `kvroute endpoints`.
#[derive(Debug, Clone, clap::Args)]
pub struct EndpointsArgs {
    /// Address of kvroute's admin API (its --admin-addr).
    #[arg(long, env = "KVROUTE_ADMIN_ADDR", default_value = "127.0.0.1:9004")]
    pub admin_addr: SocketAddr,
    /// The snapshot as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

async fn connect(addr: SocketAddr) -> anyhow::Result<AdminClient<Channel>> {
    AdminClient::connect(format!("http://{addr}"))
        .await
        .with_context(|| {
            format!("cannot reach kvroute's admin API at {addr} (is it serving with --admin-addr?)")
        })
}

/// Prints every decision until Ctrl-C or until kvroute ends the stream.
pub async fn tap(args: TapArgs) -> anyhow::Result<()> {
    let mut client = connect(args.admin_addr).await?;
    let request = pb::WatchDecisionsRequest {
        model: args.model.clone().unwrap_or_default(),
    };
    let mut events = client
        .watch_decisions(request)
        .await
        .context("WatchDecisions failed")?
        .into_inner();
    // kvroute subscribed before answering: every decision from here on is printed.
    eprintln!(
        "watching kvroute's decisions at {} (Ctrl-C stops)",
        args.admin_addr
    );
    let mut stdout = std::io::stdout().lock();
    // One listener for the whole run: a Ctrl-C that lands while an event is being
    // printed is kept for the next wait, where a listener made per wait would miss it
    // (and, the handler being installed, the signal would then be ignored).
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        let event = tokio::select! {
            event = events.message() => event.context("the decision stream failed")?,
            _ = &mut interrupted => return Ok(()),
        };
        let Some(event) = event else {
            eprintln!("kvroute closed the decision stream");
            return Ok(());
        };
        let text = if args.json {
            serde_json::to_string(&event)?
        } else {
            render_event(&event, args.top)
        };
        // A closed pipe (`kvroute tap | head`) ends the tap quietly.
        if writeln!(stdout, "{text}")
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return Ok(());
        }
    }
}

/// Prints the current endpoint snapshot.
pub async fn endpoints(args: EndpointsArgs) -> anyhow::Result<()> {
    let mut client = connect(args.admin_addr).await?;
    let snapshot = client
        .list_endpoints(pb::ListEndpointsRequest {})
        .await
        .context("ListEndpoints failed")?
        .into_inner();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&snapshot)?);
    } else {
        print!("{}", render_endpoints(&snapshot));
    }
    Ok(())
}

/// `HH:MM:SS.mmm` (UTC) of a Unix time in milliseconds.
fn clock(unix_ms: u64) -> String {
    let ms = unix_ms % 86_400_000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}

/// One line per decision, then its best `top` candidates indented.
pub fn render_event(event: &pb::DecisionEvent, top: usize) -> String {
    let mut out = clock(event.unix_ms);
    if let Some(Outcome::Missed(missed)) = &event.outcome {
        let _ = write!(out, " !! missed {} decisions (tap too slow)", missed.count);
        return out;
    }
    let _ = write!(
        out,
        " {} prompt={}",
        event.model.as_deref().unwrap_or("(no model)"),
        event.prompt_tokens
    );
    if let Some(max) = event.max_output_tokens {
        let _ = write!(out, " max={max}");
    }
    match &event.outcome {
        Some(Outcome::Routed(routed)) => {
            let _ = write!(
                out,
                " -> {} {} candidates={} need={}",
                routed.endpoint, routed.reason, routed.candidates, routed.tokens_needed
            );
            if !routed.fallbacks.is_empty() {
                let _ = write!(out, " fallbacks={}", routed.fallbacks.join(","));
            }
            if event.queued_ms > 0 {
                let _ = write!(out, " waited={}ms", event.queued_ms);
            }
            // Said only when the events took part: the default needs no note.
            if !routed.prefix_source.is_empty() && routed.prefix_source != "sent" {
                let _ = write!(out, " prefix_from={}", routed.prefix_source);
            }
            if let Some(relaxed) = &routed.relaxed {
                let names: Vec<&str> = [
                    (relaxed.saturation, "saturation"),
                    (relaxed.kv_headroom, "kv_headroom"),
                ]
                .into_iter()
                .filter_map(|(on, name)| on.then_some(name))
                .collect();
                if !names.is_empty() {
                    let _ = write!(out, " relaxed={}", names.join(","));
                }
            }
            for score in routed.ranked.iter().take(top) {
                // Every addend of the total (term × weight), so the line adds up.
                let w = score.weighted.unwrap_or_default();
                let _ = write!(
                    out,
                    "\n    {:<21} total={:.3} = kv {:.3} + queue {:.3} + inflight {:.3} + lora {:.3} \
                     + prefix {:.3} + prefill {:.3}",
                    score.endpoint,
                    score.total,
                    w.kv_headroom,
                    w.queue,
                    w.inflight,
                    w.lora,
                    w.prefix,
                    w.prefill_queue
                );
                if !score.lora_tier.is_empty() {
                    let _ = write!(out, " tier={}", score.lora_tier);
                }
                if score.cached_tokens > 0 {
                    let _ = write!(out, " cached={}", score.cached_tokens);
                }
                if score.held_tokens > score.cached_tokens {
                    let _ = write!(out, " held={}", score.held_tokens);
                }
                if let Some(free) = score.free_kv_tokens {
                    let _ = write!(out, " free_kv={free}");
                }
            }
        }
        Some(Outcome::Error(error)) => {
            let _ = write!(out, " -> not routed: {error}");
            if event.queued_ms > 0 {
                let _ = write!(out, " (after waiting {}ms)", event.queued_ms);
            }
        }
        Some(Outcome::Held(held)) => {
            let _ = write!(
                out,
                " -> held: no endpoint has room (priority {})",
                held.priority
            );
        }
        Some(Outcome::Missed(_)) | None => {}
    }
    out
}

/// A fixed-width table of the snapshot, one endpoint per row.
pub fn render_endpoints(snapshot: &pb::ListEndpointsResponse) -> String {
    let mut out = format!(
        "{:<21} {:<7} {:>7} {:>7} {:>7} {:>6} {:>10} {:>10} {:>8} {:>9}  MODELS\n",
        "ENDPOINT",
        "HEALTHY",
        "AGE",
        "WAITING",
        "RUNNING",
        "KV",
        "KV_TOKENS",
        "LORA r/w/m",
        "INFLIGHT",
        "UNSCRAPED"
    );
    let dash = || "-".to_owned();
    for pod in &snapshot.endpoints {
        let metrics = pod.metrics.as_ref();
        let age = pod
            .metrics_age_seconds
            .map_or_else(dash, |age| format!("{:.0}ms", age * 1000.0));
        let lora = metrics
            .and_then(|m| m.lora.as_ref())
            .map_or_else(dash, |l| {
                format!("{}/{}/{}", l.running.len(), l.waiting.len(), l.max_lora)
            });
        let mut models = pod.models.clone();
        let mut adapters: Vec<&String> = pod.adapters.keys().collect();
        adapters.sort();
        models.extend(adapters.into_iter().map(|a| format!("{a}*")));
        let _ = writeln!(
            out,
            "{:<21} {:<7} {:>7} {:>7} {:>7} {:>6} {:>10} {:>10} {:>8} {:>9}  {}",
            pod.endpoint,
            if pod.healthy { "yes" } else { "no" },
            age,
            metrics.map_or_else(dash, |m| m.waiting.to_string()),
            metrics.map_or_else(dash, |m| m.running.to_string()),
            metrics.map_or_else(dash, |m| format!("{:.0}%", m.kv_usage * 100.0)),
            metrics
                .and_then(|m| m.kv_capacity_tokens)
                .map_or_else(dash, |c| c.to_string()),
            lora,
            pod.inflight,
            pod.unscraped_tokens,
            if models.is_empty() {
                dash()
            } else {
                models.join(",")
            }
        );
    }
    if snapshot.endpoints.is_empty() {
        out.push_str("(no endpoints known)\n");
    } else {
        out.push_str("(adapters are marked *)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_shows_utc_time_of_day_with_milliseconds() {
        assert_eq!(clock(1_700_000_000_123), "22:13:20.123");
    }

    #[test]
    fn a_routed_decision_reads_as_one_line_plus_its_top_candidates() {
        let event = pb::DecisionEvent {
            unix_ms: 0,
            model: Some("llama".into()),
            prompt_tokens: 12,
            max_output_tokens: None,
            queued_ms: 0,
            outcome: Some(Outcome::Routed(pb::Routed {
                endpoint: "10.0.0.1:8000".into(),
                reason: "least_loaded".into(),
                candidates: 2,
                tokens_needed: 268,
                ranked: vec![
                    pb::CandidateScore {
                        endpoint: "10.0.0.1:8000".into(),
                        total: 2.5,
                        ..Default::default()
                    },
                    pb::CandidateScore {
                        endpoint: "10.0.0.2:8000".into(),
                        total: 1.0,
                        ..Default::default()
                    },
                ],
                ..Default::default()
            })),
        };
        let text = render_event(&event, 1);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].contains("llama prompt=12 -> 10.0.0.1:8000 least_loaded"),
            "{text}"
        );
        assert!(lines[1].contains("total=2.500"), "{text}");
    }
}
