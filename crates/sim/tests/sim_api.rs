//! The HTTP API of a simulated pod: OpenAI shapes, vLLM errors and metrics, the endpoints the
//! peer routers call, fleet ports, and seeded determinism.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_core::vllm::parse_vllm_metrics;
use kvroute_sim::engine::{Engine, EngineConfig, Event, FinishReason, RequestSpec};
use kvroute_sim::profile::Profile;
use kvroute_sim::{FleetConfig, PodConfig, SimFleet};
use serde_json::{Value, json};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

async fn start(n: usize, speedup: f64, seed: u64) -> SimFleet {
    let pod = PodConfig {
        lora_adapters: vec!["sql-lora".into(), "chat-lora".into()],
        preload_loras: vec!["sql-lora".into()],
        ..PodConfig::default()
    };
    let config = FleetConfig {
        speedup,
        seed,
        ..FleetConfig::uniform(n, pod)
    };
    SimFleet::start(config).await.expect("fleet starts")
}

fn url(addr: SocketAddr, path: &str) -> String {
    format!("http://{addr}{path}")
}

async fn post(c: &reqwest::Client, addr: SocketAddr, path: &str, body: Value) -> reqwest::Response {
    c.post(url(addr, path))
        .json(&body)
        .send()
        .await
        .expect("request")
}

fn pod_header(res: &reqwest::Response) -> String {
    res.headers()
        .get("x-sim-pod")
        .and_then(|v| v.to_str().ok())
        .expect("x-sim-pod header")
        .to_string()
}

/// The `data:` payloads of an SSE body.
fn sse_events(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("every event is a data line")
        })
        .collect()
}

#[tokio::test]
async fn a_completion_answers_in_openai_shape_with_usage_and_the_pod_header() {
    let fleet = start(2, 50.0, 1).await;
    let c = reqwest::Client::new();
    for (i, addr) in fleet.endpoints().into_iter().enumerate() {
        let res = post(
            &c,
            addr,
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Hello there, how are you?", "max_tokens": 7,
                   "temperature": 0.7, "echo": false, "no_stop_trim": true, "ignore_eos": true,
                   "some_future_field": {"x": 1}}),
        )
        .await;
        assert_eq!(res.status(), 200);
        assert_eq!(pod_header(&res), i.to_string());
        let v: Value = res.json().await.expect("json");
        assert_eq!(v["object"], "text_completion");
        assert!(v["id"].as_str().expect("id").starts_with("cmpl-"));
        assert_eq!(v["model"], MODEL);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert!(!v["choices"][0]["text"].as_str().expect("text").is_empty());
        let u = &v["usage"];
        assert_eq!(u["completion_tokens"], 7);
        assert!(u["prompt_tokens"].as_u64().expect("prompt_tokens") > 3);
        assert_eq!(
            u["total_tokens"].as_u64(),
            Some(u["prompt_tokens"].as_u64().unwrap_or(0) + 7)
        );
        // Nothing cached: vLLM leaves the details out rather than writing 0.
        assert!(u.get("prompt_tokens_details").is_none(), "{u}");
    }
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_chat_stream_sends_role_content_usage_then_done() {
    let fleet = start(1, 50.0, 1).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let res = post(
        &c,
        addr,
        "/v1/chat/completions",
        json!({"model": "sql-lora", "messages": [
                  {"role": "system", "content": "You write SQL."},
                  {"role": "user", "content": [{"type": "text", "text": "Count the rows."}]}],
               "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(res.status(), 200);
    assert!(
        res.headers()[reqwest::header::CONTENT_TYPE]
            .to_str()
            .unwrap_or("")
            .starts_with("text/event-stream")
    );
    let text = res.text().await.expect("body");
    let events = sse_events(&text);
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let contents: Vec<&Value> = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        })
        .collect();
    assert_eq!(contents.len(), 5);
    assert_eq!(contents[4]["choices"][0]["finish_reason"], "length");
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["model"], "sql-lora");
    }
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(chunks.last().expect("usage chunk")["choices"], json!([]));
    assert_eq!(usage["completion_tokens"], 5);
    // A first, uncached prompt: vLLM writes no details when nothing came from the cache.
    assert!(usage.get("prompt_tokens_details").is_none(), "{usage}");
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_completion_stream_has_one_chunk_per_token_and_no_usage_unless_asked() {
    let fleet = start(1, 50.0, 1).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let res = post(
        &c,
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "stream": true}),
    )
    .await;
    let text = res.text().await.expect("body");
    let events = sse_events(&text);
    assert_eq!(events.len(), 13);
    assert_eq!(events[12], "[DONE]");
    for e in &events[..12] {
        let v: Value = serde_json::from_str(e).expect("chunk json");
        assert_eq!(v["object"], "text_completion");
        assert!(v.get("usage").is_none());
    }
    fleet.shutdown().await;
}

#[tokio::test]
async fn an_unknown_model_is_a_404_in_vllm_error_shape() {
    let fleet = start(1, 50.0, 1).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let res = post(
        &c,
        addr,
        "/v1/completions",
        json!({"model": "gpt-9", "prompt": "hi", "max_tokens": 1}),
    )
    .await;
    assert_eq!(res.status(), 404);
    assert_eq!(pod_header(&res), "0");
    let v: Value = res.json().await.expect("json");
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(v["error"]["code"], 404);
    assert_eq!(v["error"]["message"], "The model `gpt-9` does not exist.");
    let res = post(
        &c,
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "hi", "max_tokens": 200000}),
    )
    .await;
    assert_eq!(res.status(), 400, "longer than the model");
    let res = c
        .post(url(addr, "/v1/chat/completions"))
        .body("{not json")
        .send()
        .await
        .expect("request");
    assert_eq!(res.status(), 400);
    fleet.shutdown().await;
}

#[tokio::test]
async fn models_list_the_base_and_adapters_and_follow_load_and_unload() {
    let fleet = start(1, 50.0, 1).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let ids = |v: &Value| -> Vec<(String, Value)> {
        v["data"]
            .as_array()
            .expect("data")
            .iter()
            .map(|m| {
                (
                    m["id"].as_str().unwrap_or("").to_string(),
                    m["parent"].clone(),
                )
            })
            .collect()
    };
    let get_models = || async {
        c.get(url(addr, "/v1/models"))
            .send()
            .await
            .expect("models")
            .json::<Value>()
            .await
            .expect("json")
    };
    let v = get_models().await;
    assert_eq!(v["object"], "list");
    assert_eq!(
        ids(&v),
        vec![
            (MODEL.to_string(), Value::Null),
            ("sql-lora".to_string(), json!(MODEL)),
            ("chat-lora".to_string(), json!(MODEL)),
        ]
    );
    let res = post(
        &c,
        addr,
        "/v1/load_lora_adapter",
        json!({"lora_name": "new", "lora_path": "/x"}),
    )
    .await;
    assert_eq!(res.status(), 200);
    let res = post(
        &c,
        addr,
        "/v1/load_lora_adapter",
        json!({"lora_name": "new", "lora_path": "/x"}),
    )
    .await;
    assert_eq!(res.status(), 400);
    assert!(ids(&get_models().await).contains(&("new".to_string(), json!(MODEL))));
    let res = post(
        &c,
        addr,
        "/v1/completions",
        json!({"model": "new", "prompt": "q", "max_tokens": 2}),
    )
    .await;
    assert_eq!(res.status(), 200);
    let res = post(
        &c,
        addr,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "new"}),
    )
    .await;
    assert_eq!(res.status(), 200);
    let res = post(
        &c,
        addr,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "new"}),
    )
    .await;
    assert_eq!(res.status(), 404);
    let res = post(
        &c,
        addr,
        "/v1/completions",
        json!({"model": "new", "prompt": "q", "max_tokens": 2}),
    )
    .await;
    assert_eq!(res.status(), 404);
    fleet.shutdown().await;
}

#[tokio::test]
async fn the_peer_routers_endpoints_answer_in_their_documented_shapes() {
    let fleet = start(1, 50.0, 1).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();

    let res = c.get(url(addr, "/health")).send().await.expect("health");
    assert_eq!(res.status(), 200);

    let load: Value = c
        .get(url(addr, "/get_load"))
        .send()
        .await
        .expect("load")
        .json()
        .await
        .expect("json");
    let l = &load[0];
    assert_eq!(l["dp_rank"], 0);
    for k in ["num_reqs", "num_waiting_reqs", "num_tokens"] {
        assert!(l[k].is_u64(), "{k} in {load}");
    }

    let tok: Value = post(
        &c,
        addr,
        "/tokenize",
        json!({"model": MODEL, "prompt": "Hello world, again"}),
    )
    .await
    .json()
    .await
    .expect("json");
    let tokens = tok["tokens"].as_array().expect("tokens").clone();
    assert_eq!(tok["count"].as_u64(), Some(tokens.len() as u64));
    assert!(tok["max_model_len"].is_u64());

    let rendered: Value = post(
        &c,
        addr,
        "/v1/completions/render",
        json!({"model": MODEL, "prompt": "Hello world, again", "max_tokens": 3}),
    )
    .await
    .json()
    .await
    .expect("json");
    assert_eq!(
        rendered[0]["token_ids"],
        Value::Array(tokens.clone()),
        "render and tokenize agree"
    );
    assert!(
        rendered[0]["request_id"]
            .as_str()
            .expect("id")
            .starts_with("cmpl-")
    );

    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]});
    let rendered: Value = post(&c, addr, "/v1/chat/completions/render", chat.clone())
        .await
        .json()
        .await
        .expect("json");
    let ids = rendered["token_ids"].as_array().expect("token_ids").len();
    let tok: Value = post(&c, addr, "/tokenize", chat.clone())
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(tok["count"].as_u64(), Some(ids as u64));
    // The prompt the engine counts is the rendered one.
    let mut req = chat;
    req["max_tokens"] = json!(1);
    let v: Value = post(&c, addr, "/v1/chat/completions", req)
        .await
        .json()
        .await
        .expect("json");
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(ids as u64));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");

    for path in [
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
    ] {
        let res = c.get(url(addr, path)).send().await.expect("info");
        assert_eq!(res.status(), 200, "{path}");
        let _: Value = res.json().await.expect("json");
    }
    let res = c.get(url(addr, "/no/such/path")).send().await.expect("404");
    assert_eq!(res.status(), 404);
    fleet.shutdown().await;
}

#[tokio::test]
async fn metrics_look_like_vllm_and_parse_with_kvroutes_parser() {
    let fleet = start(1, 50.0, 1).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    for i in 0..3 {
        let res = post(&c, addr, "/v1/completions", json!({"model": "chat-lora", "prompt": format!("prompt {i} and some text"), "max_tokens": 4})).await;
        assert_eq!(res.status(), 200);
    }
    let text = c
        .get(url(addr, "/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    for needle in [
        "# TYPE vllm:num_requests_running gauge",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.04\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"}",
        "vllm:inter_token_latency_seconds_count{engine=\"0\",model_name=",
        "vllm:e2e_request_latency_seconds_sum{",
        "vllm:request_queue_time_seconds_bucket{",
        "vllm:prompt_tokens_total{",
        "vllm:generation_tokens_total{engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 12.0",
        "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",",
        "vllm:cache_config_info{block_size=\"16\",",
        "vllm:lora_requests_info{max_lora=\"4\",",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    let m = parse_vllm_metrics(&text).expect("kvroute parses it");
    assert_eq!((m.waiting, m.running), (0, 0));
    assert_eq!(m.block_size, Some(16));
    assert_eq!(
        m.num_gpu_blocks,
        Some(u64::from(PodConfig::default().engine.num_gpu_blocks))
    );
    assert_eq!(m.kv_capacity_tokens, m.num_gpu_blocks.map(|b| b * 16));
    assert_eq!(m.preemptions_total, Some(0.0));
    assert!(m.prefix_cache_queries_total.unwrap_or(0.0) > 0.0);
    let lora = m.lora.expect("lora info");
    assert_eq!(lora.max_lora, 4);
    assert!(lora.running.is_empty() && lora.waiting.is_empty());
    // The lora info value is a unix timestamp (of the simulated clock).
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let newest = text
        .lines()
        .filter(|l| l.starts_with("vllm:lora_requests_info{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, f64::max);
    assert!(
        (now - 5.0..now + 3600.0).contains(&newest),
        "{newest} vs {now}"
    );
    fleet.shutdown().await;
}

#[tokio::test]
async fn pods_listen_on_consecutive_ports_from_a_given_port() {
    let mut tries = 0;
    loop {
        tries += 1;
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("probe");
        let port = probe.local_addr().expect("addr").port();
        drop(probe);
        if port > 65000 {
            continue;
        }
        let config = FleetConfig {
            port,
            ..FleetConfig::uniform(3, PodConfig::default())
        };
        match SimFleet::start(config).await {
            Ok(fleet) => {
                let ports: Vec<u16> = fleet.endpoints().iter().map(|a| a.port()).collect();
                assert_eq!(ports, vec![port, port + 1, port + 2]);
                let c = reqwest::Client::new();
                for (i, addr) in fleet.endpoints().into_iter().enumerate() {
                    let res = c.get(url(addr, "/health")).send().await.expect("health");
                    assert_eq!(pod_header(&res), i.to_string());
                }
                fleet.shutdown().await;
                return;
            }
            Err(e) if tries < 5 => eprintln!("retrying: {e}"),
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test]
async fn a_client_that_goes_away_frees_its_request() {
    let mut pod = PodConfig::default();
    pod.engine.num_gpu_blocks = 1000;
    let fleet = SimFleet::start(FleetConfig {
        speedup: 5.0,
        ..FleetConfig::uniform(1, pod)
    })
    .await
    .expect("fleet");
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let mut res = post(
        &c,
        addr,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "x ".repeat(500), "max_tokens": 5000, "stream": true}),
    )
    .await;
    res.chunk().await.expect("bytes").expect("first chunk");
    drop(res);
    let mut freed = false;
    for _ in 0..500 {
        let text = c
            .get(url(addr, "/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text");
        let m = parse_vllm_metrics(&text).expect("parse");
        if m.running == 0 && m.kv_usage == 0.0 {
            freed = true;
            assert!(text.contains("finished_reason=\"abort\"") && !text.contains("finished_reason=\"abort\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.0"));
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(freed, "the aborted request still holds KV");
    fleet.shutdown().await;
}

#[tokio::test]
async fn the_same_seed_gives_the_same_token_counts_and_text() {
    let outputs = |seed: u64| async move {
        let fleet = start(1, 50.0, seed).await;
        let addr = fleet.endpoints()[0];
        let c = reqwest::Client::new();
        let mut out = Vec::new();
        for i in 0..6 {
            // No max_tokens: the output length is drawn from the seed.
            let v: Value = post(
                &c,
                addr,
                "/v1/completions",
                json!({"model": MODEL, "prompt": format!("question number {i}?")}),
            )
            .await
            .json()
            .await
            .expect("json");
            out.push((
                v["usage"]["completion_tokens"].as_u64().expect("count"),
                v["choices"][0]["text"].as_str().expect("text").to_string(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .expect("reason")
                    .to_string(),
            ));
        }
        fleet.shutdown().await;
        out
    };
    let a = outputs(11).await;
    let b = outputs(11).await;
    let other = outputs(12).await;
    assert_eq!(a, b);
    assert_ne!(a, other);
    assert!(a.iter().all(|(n, _, reason)| *n >= 1 && reason == "stop"));
    assert!(
        a.iter()
            .map(|(n, _, _)| n)
            .collect::<std::collections::BTreeSet<_>>()
            .len()
            > 1
    );
}

#[test]
fn the_same_seed_and_arrivals_give_the_same_completion_order_and_times() {
    let run = |seed: u64| {
        let profile = Profile::by_name("h100-llama3-8b").expect("profile");
        let cfg = EngineConfig {
            seed,
            num_gpu_blocks: 200,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg, profile);
        for i in 0..20u32 {
            let spec = RequestSpec {
                prompt: (0..(100 + 37 * i)).map(|t| t + 1000 * (i % 4)).collect(),
                adapter: None,
                max_output: 10 + (i * 7) % 50,
                finish_reason: FinishReason::Length,
                output_seed: u64::from(i),
            };
            e.add_request(Duration::from_millis(u64::from(i) * 3), spec);
        }
        while let Some(t) = e.next_event_time() {
            e.advance(t);
        }
        let mut events: Vec<Event> = Vec::new();
        e.take_events(&mut events);
        events
    };
    let a = run(3);
    assert_eq!(a, run(3));
    assert_ne!(a, run(4));
}

#[tokio::test]
async fn the_fault_switch_makes_metrics_hang_or_garbage_and_back() {
    let fleet = SimFleet::start(FleetConfig {
        fault_switch: true,
        first_pod_index: 3,
        ..FleetConfig::uniform(1, PodConfig::default())
    })
    .await
    .expect("fleet");
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let switch = |mode: &'static str| {
        let c = c.clone();
        async move {
            let res = post(&c, addr, "/kvroute-sim/faults", json!({"metrics": mode})).await;
            assert_eq!(res.status(), 200, "switch to {mode}");
        }
    };

    switch("garbage").await;
    let res = c.get(url(addr, "/metrics")).send().await.expect("metrics");
    assert_eq!(res.status(), 200);
    assert_eq!(pod_header(&res), "3", "pods count from --first-pod-index");
    let text = res.text().await.expect("body");
    assert_eq!(text, kvroute_sim::fault::GARBAGE);
    assert!(parse_vllm_metrics(&text).is_err());

    switch("hang").await;
    let hanging = tokio::spawn({
        let c = c.clone();
        async move { c.get(url(addr, "/metrics")).send().await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!hanging.is_finished(), "a hanging /metrics answers nothing");
    let res = c.get(url(addr, "/v1/models")).send().await.expect("models");
    assert_eq!(res.status(), 200, "the pod still serves the API");
    switch("none").await;
    let res = hanging.await.expect("task").expect("answered once cleared");
    assert_eq!(res.status(), 200);
    let text = res.text().await.expect("body");
    assert!(parse_vllm_metrics(&text).is_ok());

    let res = post(&c, addr, "/kvroute-sim/faults", json!({"metrics": "slow"})).await;
    assert_eq!(res.status(), 400, "an unknown mode is refused");
    fleet.shutdown().await;
}

#[tokio::test]
async fn without_the_flag_there_is_no_fault_switch() {
    let fleet = start(1, 1.0, 0).await;
    let c = reqwest::Client::new();
    let res = post(
        &c,
        fleet.endpoints()[0],
        "/kvroute-sim/faults",
        json!({"metrics": "hang"}),
    )
    .await;
    assert_eq!(res.status(), 404);
    fleet.shutdown().await;
}

/// `?name[]=` renders only the samples named, as vLLM's `/metrics` (prometheus_client's
/// ASGI app) does: kvroute's scrape query gets the same readings from a fraction of the
/// page.
#[tokio::test]
async fn metrics_named_in_the_query_are_the_only_ones_rendered() {
    let fleet = start(1, 50.0, 1).await;
    let addr = fleet.endpoints()[0];
    let c = reqwest::Client::new();
    let res = post(
        &c,
        addr,
        "/v1/completions",
        json!({"model": "chat-lora", "prompt": "hello there", "max_tokens": 4}),
    )
    .await;
    assert_eq!(res.status(), 200);
    let get = |path: String| {
        let c = c.clone();
        async move {
            c.get(url(addr, &path))
                .send()
                .await
                .expect("metrics")
                .text()
                .await
                .expect("text")
        }
    };
    let full = get("/metrics".into()).await;
    let filtered = get(format!("/metrics?{}", kvroute_core::vllm::metrics_query())).await;
    assert_eq!(
        parse_vllm_metrics(&filtered).expect("parse filtered"),
        parse_vllm_metrics(&full).expect("parse full"),
        "the same readings"
    );
    assert!(
        filtered.len() * 4 < full.len(),
        "{} bytes of {}",
        filtered.len(),
        full.len()
    );
    assert!(!filtered.contains("_bucket"), "no histogram: {filtered}");
    assert!(
        filtered.contains("# TYPE vllm:num_requests_waiting gauge"),
        "{filtered}"
    );

    // One counter, asked for by its sample name: its family's header and sample only.
    let one = get("/metrics?name%5B%5D=vllm%3Aprefix_cache_queries_total".into()).await;
    let lines: Vec<&str> = one.lines().collect();
    assert_eq!(lines.len(), 3, "{one}");
    assert!(
        lines[0].starts_with("# HELP vllm:prefix_cache_queries"),
        "{one}"
    );
    assert!(
        lines[1].starts_with("# TYPE vllm:prefix_cache_queries"),
        "{one}"
    );
    assert!(
        lines[2].starts_with("vllm:prefix_cache_queries_total{"),
        "{one}"
    );
    fleet.shutdown().await;
}
