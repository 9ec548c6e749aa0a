//! Precise prefix routing end to end: simulated vLLM pods publish their KV cache events
//! over ZeroMQ exactly as vLLM does, kvroute (`--prefix-source auto`) follows them, and a
//! request through a real Envoy goes to the pod whose cache holds its prompt's prefix,
//! even when that prefix reached the pod by another path than kvroute.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{
    Envoy, Gateway, Kvroute, decision_log, http_client, metric_value, test_config, wait_for_metric,
};

use kvroute::kvevents::{EndpointTemplate, PrefixSource};
use kvroute::tokenize::TokenizerSpec;
use kvroute_sim::{FleetConfig, PodConfig, SimFleet};

const MODEL: &str = "events-model";

/// Two pods publishing events, on consecutive ports so one template names both.
async fn fleet() -> (SimFleet, kvroute_lab::compare::KvEventTemplates) {
    fleet_tokenizing(None).await
}

/// [`fleet`], its pods tokenizing with the model directory `tokenizer` (else the
/// simulator's synthetic tokenizer).
async fn fleet_tokenizing(
    tokenizer: Option<PathBuf>,
) -> (SimFleet, kvroute_lab::compare::KvEventTemplates) {
    let config = FleetConfig {
        model: MODEL.into(),
        speedup: 20.0,
        tokenizer,
        ..FleetConfig::uniform(2, PodConfig::default())
    };
    let (config, templates) =
        kvroute_lab::compare::with_kv_events(config).expect("ports for the events");
    let fleet = SimFleet::start(config).await.expect("the fleet starts");
    (fleet, templates)
}

/// kvroute on `config` with `--prefix-source auto` following the fleet's events, once it
/// has scraped both pods and both event streams flow.
async fn following_events(
    mut config: kvroute::config::ServeConfig,
    templates: &kvroute_lab::compare::KvEventTemplates,
    pods: &[SocketAddr],
) -> Kvroute {
    config.prefix_source = PrefixSource::Auto;
    config.kv_events.endpoint = EndpointTemplate::parse(&templates.endpoint).expect("template");
    config.kv_events.replay_endpoint =
        Some(EndpointTemplate::parse(&templates.replay).expect("template"));
    let kvroute = Kvroute::start(config).await;
    kvroute
        .wait_for("both pods scraped with their models", |s| {
            pods.iter().all(|p| {
                s.pod(*p)
                    .is_some_and(|v| v.healthy && v.metrics().is_some() && v.models.is_some())
            })
        })
        .await;
    wait_for_metric(&kvroute, "kvroute_kv_event_streams", 2.0).await;
    kvroute
}

/// Waits until the counter `name` reaches `at_least`, then scrapes again: a scrape samples
/// the gauges before it reads the counters, so a gauge in the scrape that showed the
/// counter may predate what the counter counts, and one in the next scrape does not.
async fn scrape_after(kvroute: &Kvroute, name: &str, at_least: f64) -> String {
    wait_for_metric(kvroute, name, at_least).await;
    kvroute.metrics_text().await
}

/// Where each decision in kvroute's log took its prefix scores from, oldest first.
async fn prefix_sources(kvroute: &Kvroute) -> Vec<String> {
    let decisions = decision_log(kvroute.addrs.debug.expect("debug pages")).await;
    decisions
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|d| d["prefix_source"].as_str().map(str::to_owned))
        .collect()
}

/// The simulated pod that served `response`, which names itself (none when no pod did).
fn served_by(response: &reqwest::Response) -> Option<usize> {
    response
        .headers()
        .get("x-sim-pod")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
}

/// Has each prompt computed on its pod directly, not through kvroute.
async fn compute_on(client: &reqwest::Client, prompts: &[(String, SocketAddr)]) {
    for (text, pod) in prompts {
        let status = client
            .post(format!("http://{pod}/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": text, "max_tokens": 1}))
            .send()
            .await
            .expect("the pod answers")
            .status();
        assert_eq!(status, 200);
    }
}

/// A prompt of about 300 tokens no other prompt shares a block with.
fn prompt(k: usize) -> String {
    (0..300)
        .map(|i| format!(" w{k}x{i}"))
        .collect::<Vec<_>>()
        .join("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_goes_to_the_pod_whose_events_show_its_prefix_even_if_it_came_another_way() {
    let (fleet, templates) = fleet().await;
    let pods = fleet.endpoints();
    let mut config = test_config(pods.clone());
    config.debug_decisions = 16;
    let kvroute = following_events(config, &templates, &pods).await;

    // Each prompt is computed on one pod directly, not through kvroute: only that pod's
    // events can tell kvroute where it is cached.
    let client = http_client();
    let prompts: Vec<(String, SocketAddr)> = (0..6).map(|k| (prompt(k), pods[k % 2])).collect();
    compute_on(&client, &prompts).await;
    // Six prompts of at least 18 full blocks each, all announced.
    wait_for_metric(&kvroute, "kvroute_kv_event_index_entries", 6.0 * 18.0).await;

    let envoy = Envoy::start(Gateway::OriginalDst, kvroute.addrs.grpc, &pods).await;
    let url = envoy.url("/v1/completions");
    for (k, (text, warm)) in prompts.iter().enumerate() {
        let response = post(
            &client,
            &url,
            &json!({"model": MODEL, "prompt": format!("{text} and then?"), "max_tokens": 2}),
        )
        .await;
        assert_eq!(response.status(), 200, "{}", envoy.log());
        // Waiting for a pod's /tokenize is not waiting for room: no queue time reported.
        assert_eq!(response.headers().get("server-timing"), None);
        let served = served_by(&response).expect("the pod names itself");
        if pods[served] != *warm {
            let text = kvroute.metrics_text().await;
            let relevant: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("kvroute_kv_event") || l.starts_with("kvroute_tokenize"))
                .collect();
            panic!(
                "prompt {k} went to pod {served}, not to the pod caching its prefix ({warm}):\n{}",
                relevant.join("\n")
            );
        }
    }
    let text = kvroute.metrics_text().await;
    assert!(
        text.lines().any(|l| l.starts_with(
            "kvroute_tokenize_duration_seconds_count{outcome=\"ok\",tokenizer=\"pod\"} "
        )),
        "prompts were tokenized on the pods:\n{text}"
    );
    // The telemetry weighs what kvroute expected the pods to hold against what they say
    // they served from their caches: each prompt's 18 blocks of 16 tokens, at least.
    let predicted = text
        .lines()
        .find_map(|l| {
            l.strip_prefix("kvroute_prefix_predicted_cached_tokens_total{source=\"kv_events\"} ")?
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(0.0);
    assert!(
        predicted >= 6.0 * 18.0 * 16.0,
        "{predicted} tokens predicted:\n{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("kvroute_pod_prefix_cache_hit_tokens_total{")),
        "the pods' own hits are mirrored:\n{text}"
    );
    // The decision trace says the prefix scores came from the events.
    assert_eq!(prefix_sources(&kvroute).await, ["kv_events"; 6]);
    fleet.shutdown().await;
}

/// The lab's test tokenizer: a byte-level BPE with a Llama-3-style chat template.
fn test_tokenizer() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("crates/lab/tokenizers/bpe-4k")
}

/// A chat whose system message is `context`, asking `question`.
fn chat(context: &str, question: &str) -> serde_json::Value {
    json!({
        "model": MODEL,
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": context},
            {"role": "user", "content": question},
        ],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvroute_tokenizes_chats_as_the_pods_do_and_asks_a_pod_only_what_it_cannot_render() {
    let (fleet, templates) = fleet_tokenizing(Some(test_tokenizer())).await;
    let pods = fleet.endpoints();
    let mut config = test_config(pods.clone());
    config.debug_decisions = 16;
    config.tokenizers = vec![TokenizerSpec {
        model: None,
        dir: test_tokenizer(),
    }];
    // Every prompt kvroute tokenizes is also checked against a pod's.
    config.tokenizer_check_every = 1;
    let kvroute = following_events(config, &templates, &pods).await;

    // Each conversation's context is computed on one pod directly, rendered with the
    // pods' chat template and tokenized by their tokenizer: only that pod's events hold
    // its blocks.
    let client = http_client();
    let contexts: Vec<(String, SocketAddr)> = (0..4).map(|k| (prompt(k), pods[k % 2])).collect();
    for (context, pod) in &contexts {
        compute_chat_on(*pod, context).await;
    }
    wait_for_metric(&kvroute, "kvroute_kv_event_index_entries", 4.0 * 18.0).await;

    // The same conversations with another question, through Envoy; one also offers a tool
    // and answers a call of it (rendered here, as vLLM hands tools and calls over), the
    // last one brings an image, which kvroute leaves to a pod's /tokenize to render.
    let envoy = Envoy::start(Gateway::OriginalDst, kvroute.addrs.grpc, &pods).await;
    let url = envoy.url("/v1/chat/completions");
    // Each context twice: the second time kvroute has it remembered and tokenizes the
    // request on the spot.
    let mut asked: Vec<(serde_json::Value, SocketAddr)> = ["And the last one?", "And then?"]
        .into_iter()
        .flat_map(|question| {
            contexts
                .iter()
                .map(move |(context, warm)| (chat(context, question), *warm))
        })
        .collect();
    let mut with_tool = chat(&contexts[1].0, "Which tool fits?");
    with_tool["tools"] = json!([{"type": "function", "function": {"name": "lookup",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]);
    let messages = with_tool["messages"].as_array_mut().expect("messages");
    messages.push(
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call1",
        "type": "function", "function": {"name": "lookup", "arguments": "{\"word\": \"kv\"}"}}]}),
    );
    messages.push(json!({"role": "tool", "tool_call_id": "call1", "content": "found"}));
    asked.push((with_tool, contexts[1].1));
    let mut with_image = chat(&contexts[0].0, "");
    with_image["messages"][1]["content"] = json!([{"type": "text", "text": "What is drawn?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]);
    asked.push((with_image, contexts[0].1));
    for (k, (body, warm)) in asked.iter().enumerate() {
        let response = post(&client, &url, body).await;
        assert_eq!(response.status(), 200, "{}", envoy.log());
        let served = served_by(&response).expect("the pod names itself");
        assert_eq!(
            pods[served],
            *warm,
            "chat {k} went to pod {served}, not to the pod caching its context:\n{}",
            kvroute.metrics_text().await
        );
    }
    let text = kvroute.metrics_text().await;
    assert_eq!(tokenized(&text, "ok", "local"), 9.0, "{text}");
    assert_eq!(tokenized(&text, "left_to_pod", "local"), 1.0, "{text}");
    assert_eq!(tokenized(&text, "ok", "pod"), 1.0, "{text}");
    // The contexts were encoded once each (with the first questions), then copied: the
    // second round encoded only its questions and headers.
    let tokens = |source: &str| {
        metric_value(
            &text,
            &format!("kvroute_local_tokenizer_tokens_total{{source=\"{source}\"}}"),
        )
    };
    let (remembered, encoded) = (tokens("remembered"), tokens("encoded"));
    assert!(
        remembered > 4.0 * 300.0 && encoded - remembered < 4.0 * 2.0 * 20.0,
        "{text}"
    );
    assert_eq!(prefix_sources(&kvroute).await, ["kv_events"; 10]);
    // The checks run beside the requests: each of the nine agreed with the pods.
    let agreed = "kvroute_local_tokenizer_checks_total{result=\"agree\"}";
    let text = scrape_after(&kvroute, agreed, 9.0).await;
    assert_eq!(metric_value(&text, agreed), 9.0, "{text}");
    assert_eq!(
        metric_value(
            &text,
            "kvroute_local_tokenizer_checks_total{result=\"differ\"}"
        ),
        0.0,
        "{text}"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_that_disagrees_with_the_pods_is_found_by_its_first_check_and_set_aside() {
    let (fleet, templates) = fleet_tokenizing(Some(test_tokenizer())).await;
    let pods = fleet.endpoints();
    // The model's tokenizer with another chat template: the roles in capitals.
    let (kvroute, _dir) = tokenizing_with_template(
        &pods,
        &templates,
        "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m.role | upper }}\
         <|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{%- endfor %}\
         {%- if add_generation_prompt %}<|start_header_id|>ASSISTANT<|end_header_id|>\n\n{%- endif %}",
    )
    .await;
    let client = http_client();
    let context = prompt(7);
    let warm = pods[1];
    compute_chat_on(warm, &context).await;
    wait_for_metric(&kvroute, "kvroute_kv_event_index_entries", 18.0).await;

    let envoy = Envoy::start(Gateway::OriginalDst, kvroute.addrs.grpc, &pods).await;
    let url = envoy.url("/v1/chat/completions");
    // The first prompt is tokenized with the wrong template, and checked (the default
    // checks each model's first prompt).
    let response = post(&client, &url, &chat(&context, "And the last one?")).await;
    assert_eq!(response.status(), 200, "{}", envoy.log());
    let first = response_pod(&pods, &response);
    let differed = "kvroute_local_tokenizer_checks_total{result=\"differ\"}";
    let text = scrape_after(&kvroute, differed, 1.0).await;
    assert_eq!(metric_value(&text, differed), 1.0, "{text}");
    // Its tokens matched no block the pods stored.
    let predicted = "kvroute_prefix_predicted_cached_tokens_total{source=\"kv_events\"}";
    assert_eq!(metric_value(&text, predicted), 0.0, "{text}");
    // From then on the pods tokenize this model's prompts: the next ones match the
    // context's blocks (held by the pod that computed it, and by the one that served the
    // first prompt, if another) and go to a pod holding them.
    for question in ["And then?", "And after that?"] {
        let response = post(&client, &url, &chat(&context, question)).await;
        assert_eq!(response.status(), 200, "{}", envoy.log());
        let served = response_pod(&pods, &response);
        assert!(
            served == warm || served == first,
            "{served} holds none of the context:\n{}",
            kvroute.metrics_text().await
        );
    }
    let text = kvroute.metrics_text().await;
    // Both matched the context's 18 whole blocks of 16 tokens.
    assert!(
        metric_value(&text, predicted) >= 2.0 * 18.0 * 16.0,
        "{text}"
    );
    assert_eq!(tokenized(&text, "ok", "local"), 1.0, "{text}");
    assert_eq!(tokenized(&text, "ok", "pod"), 2.0, "{text}");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_difference_found_on_a_prompt_with_tools_leaves_only_prompts_with_tools_to_the_pods() {
    let (fleet, templates) = fleet_tokenizing(Some(test_tokenizer())).await;
    let pods = fleet.endpoints();
    // The pods' template with the tools written before it: the same tokens for a chat
    // without tools, others for one with tools (as an engine release that dumps its tool
    // models otherwise would make).
    let config_json =
        std::fs::read_to_string(test_tokenizer().join("tokenizer_config.json")).expect("read");
    let config: serde_json::Value = serde_json::from_str(&config_json).expect("JSON");
    let template = config["chat_template"]
        .as_str()
        .expect("the fixture's template");
    let (kvroute, _dir) = tokenizing_with_template(
        &pods,
        &templates,
        &format!("{{%- if tools %}}Tools: {{{{ tools | tojson }}}}{{% endif %}}{template}"),
    )
    .await;
    let client = http_client();
    let context = prompt(5);
    compute_chat_on(pods[0], &context).await;
    wait_for_metric(&kvroute, "kvroute_kv_event_index_entries", 18.0).await;

    let envoy = Envoy::start(Gateway::OriginalDst, kvroute.addrs.grpc, &pods).await;
    let url = envoy.url("/v1/chat/completions");
    let with_tools = |question: &str| {
        let mut body = chat(&context, question);
        body["tools"] = json!([{"type": "function", "function": {"name": "lookup"}}]);
        body
    };
    let send = |body: serde_json::Value| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let response = post(&client, &url, &body).await;
            assert_eq!(response.status(), 200);
        }
    };
    let agreed = "kvroute_local_tokenizer_checks_total{result=\"agree\"}";
    let differed = "kvroute_local_tokenizer_checks_total{result=\"differ\"}";
    // The first prompt of each kind is checked: without tools it agrees, with tools it
    // differs.
    send(chat(&context, "And the last one?")).await;
    scrape_after(&kvroute, agreed, 1.0).await;
    send(with_tools("Which tool?")).await;
    let text = scrape_after(&kvroute, differed, 1.0).await;
    assert_eq!(metric_value(&text, agreed), 1.0, "{text}");
    // From then on prompts with tools are the pods' to tokenize, the others still
    // kvroute's; both match the context where the pod holds it.
    send(with_tools("Which tool now?")).await;
    send(chat(&context, "And then?")).await;
    let text = kvroute.metrics_text().await;
    assert_eq!(tokenized(&text, "ok", "local"), 3.0, "{text}");
    assert_eq!(tokenized(&text, "left_to_pod", "local"), 1.0, "{text}");
    assert_eq!(tokenized(&text, "ok", "pod"), 1.0, "{text}");
    let predicted = "kvroute_prefix_predicted_cached_tokens_total{source=\"kv_events\"}";
    assert!(
        metric_value(&text, predicted) >= 3.0 * 18.0 * 16.0,
        "the plain prompts and the one tokenized by a pod match the context: {text}"
    );
    fleet.shutdown().await;
}

/// kvroute following the fleet's events and tokenizing with the test tokenizer under
/// another chat template, `template`; and the directory holding them.
async fn tokenizing_with_template(
    pods: &[SocketAddr],
    templates: &kvroute_lab::compare::KvEventTemplates,
    template: &str,
) -> (Kvroute, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(test_tokenizer().join(file), dir.path().join(file)).expect("copy");
    }
    std::fs::write(dir.path().join("chat_template.jinja"), template).expect("write");
    let mut config = test_config(pods.to_vec());
    config.tokenizers = vec![TokenizerSpec {
        model: None,
        dir: dir.path().to_owned(),
    }];
    (following_events(config, templates, pods).await, dir)
}

/// `context` computed on `pod` directly (a chat whose system message it is): that pod's
/// events announce its blocks.
async fn compute_chat_on(pod: SocketAddr, context: &str) {
    let status = http_client()
        .post(format!("http://{pod}/v1/chat/completions"))
        .json(&chat(context, "What is the first word?"))
        .send()
        .await
        .expect("the pod answers")
        .status();
    assert_eq!(status, 200);
}

/// Prompts tokenized by `tokenizer` (`pod` or `local`) with `outcome`, in kvroute's
/// exposition `text`.
fn tokenized(text: &str, outcome: &str, tokenizer: &str) -> f64 {
    metric_value(
        text,
        &format!(
            "kvroute_tokenize_duration_seconds_count{{outcome=\"{outcome}\",tokenizer=\"{tokenizer}\"}}"
        ),
    )
}

/// The pod of `pods` that served `response`.
fn response_pod(pods: &[SocketAddr], response: &reqwest::Response) -> SocketAddr {
    pods[served_by(response).expect("the pod names itself")]
}

/// A `kvroute serve` process following the fleet's events: a replica.
struct Replica {
    child: std::process::Child,
    grpc: SocketAddr,
    metrics: SocketAddr,
    debug: SocketAddr,
}

impl Replica {
    fn start(pods: &[SocketAddr], templates: &kvroute_lab::compare::KvEventTemplates) -> Replica {
        let port = || kvroute_lab::envoy::free_port().expect("a free port");
        let local = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        let (grpc, metrics, debug) = (local(port()), local(port()), local(port()));
        let endpoints: Vec<String> = pods.iter().map(ToString::to_string).collect();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--endpoints", &endpoints.join(",")])
            .args(["--grpc-addr", &grpc.to_string()])
            .args(["--metrics-addr", &metrics.to_string()])
            .args(["--debug-addr", &debug.to_string()])
            .args(["--health-addr", "off", "--admin-addr", "off"])
            .args([
                "--refresh-metrics-interval",
                "20ms",
                "--debug-decisions",
                "64",
            ])
            .arg("--prefix-source=auto")
            .arg(format!("--kv-events-endpoint={}", templates.endpoint))
            .arg(format!("--kv-events-replay-endpoint={}", templates.replay))
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start kvroute");
        Replica {
            child,
            grpc,
            metrics,
            debug,
        }
    }

    /// Waits until its exposition shows both pods' streams and `entries` indexed blocks.
    async fn wait_following(&self, entries: f64) {
        let client = http_client();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = match client
                .get(format!("http://{}/metrics", self.metrics))
                .send()
                .await
            {
                Ok(response) => response.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            if metric_value(&text, "kvroute_kv_event_streams") == 2.0
                && metric_value(&text, "kvroute_kv_event_index_entries") >= entries
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "replica {} did not catch up:\n{text}",
                self.grpc
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// How many requests it routed, by its decision log.
    async fn routed(&self) -> usize {
        let decisions = decision_log(self.debug).await;
        decisions.as_array().map_or(0, |d| {
            d.iter().filter(|d| d["decision"].is_object()).count()
        })
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `text` and a question through Envoy: its status and the pod that served it.
async fn ask(client: &reqwest::Client, url: &str, text: &str) -> (u16, Option<usize>) {
    let response = post(
        client,
        url,
        &json!({"model": MODEL, "prompt": format!("{text} and then?"), "max_tokens": 2}),
    )
    .await;
    (response.status().as_u16(), served_by(&response))
}

/// `body` posted through Envoy at `url`.
async fn post(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> reqwest::Response {
    client
        .post(url)
        .json(body)
        .send()
        .await
        .expect("Envoy answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_agree_from_the_events_and_one_left_alone_routes_everything() {
    let (fleet, templates) = fleet().await;
    let pods = fleet.endpoints();
    // The prompts are cached before either replica starts: what the replicas know of
    // them comes from the events' replay alone, and neither ever sent them anywhere.
    let client = http_client();
    let prompts: Vec<(String, SocketAddr)> = (0..6).map(|k| (prompt(k), pods[k % 2])).collect();
    compute_on(&client, &prompts).await;
    let replicas = [
        Replica::start(&pods, &templates),
        Replica::start(&pods, &templates),
    ];
    for replica in &replicas {
        replica.wait_following(6.0 * 18.0).await;
    }
    let envoy = kvroute_lab::envoy::EnvoyProcess::start(
        kvroute_lab::envoy::Gateway::OriginalDstReplicas {
            observed: false,
            kvroutes: [replicas[0].grpc, replicas[1].grpc],
        },
        &pods,
        &support::envoy_binary(),
        "warning",
    )
    .await
    .expect("Envoy starts");
    let url = envoy.url("/v1/completions");

    // Envoy spreads the requests over both replicas; each sends every prompt where the
    // events say it is cached.
    for round in 0..2 {
        for (k, (text, warm)) in prompts.iter().enumerate() {
            let (status, served) = ask(&client, &url, text).await;
            assert_eq!(status, 200, "round {round}, prompt {k}: {}", envoy.log());
            let served = served.expect("the pod names itself");
            assert_eq!(pods[served], *warm, "round {round}, prompt {k}");
        }
    }
    let (a, b) = (replicas[0].routed().await, replicas[1].routed().await);
    assert!(a > 0 && b > 0 && a + b == 12, "replicas routed {a} and {b}");

    // One replica dies. Until the gateway's health check takes it out (two missed
    // checks a second apart), a request sent its way is answered 503 at once; nothing
    // hangs, and then the survivor routes every request, still by the events.
    let [mut gone, survivor] = replicas;
    gone.child.kill().expect("kill a replica");
    gone.child.wait().expect("reaped");
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut in_a_row = 0;
    let mut refused = 0;
    while in_a_row < 12 {
        assert!(
            Instant::now() < deadline,
            "the survivor did not take over: {refused} refused\n{}",
            envoy.log()
        );
        let (k, (text, warm)) = prompts
            .iter()
            .enumerate()
            .nth(in_a_row % prompts.len())
            .expect("a prompt");
        match ask(&client, &url, text).await {
            (200, Some(served)) => {
                assert_eq!(pods[served], *warm, "prompt {k} after the kill");
                in_a_row += 1;
            }
            (503, None) => {
                refused += 1;
                in_a_row = 0;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("prompt {k} after the kill: {other:?}\n{}", envoy.log()),
        }
    }
    assert!(survivor.routed().await >= 12);
    drop(envoy);
    fleet.shutdown().await;
}

/// One batch storing a chain of `blocks` new 16-token blocks, hashes from `first`,
/// encoded as vLLM 0.26 publishes it.
fn stored(first: u64, blocks: u64) -> bytes::Bytes {
    use kvroute_sim::engine::{BlockStored, KvCacheEvent, KvEventBatch};
    let batch = KvEventBatch {
        at: Duration::ZERO,
        events: vec![KvCacheEvent::BlockStored(BlockStored {
            block_hashes: (first..first + blocks).collect(),
            parent_block_hash: None,
            token_ids: (0..blocks * 16)
                .map(|t| (first * 1_000 + t) as u32)
                .collect(),
            block_size: 16,
            lora: None,
        })],
    };
    kvroute_sim::kv_events::wire::encode_batch(&batch, 1.0, 0)
        .expect("encodes")
        .into()
}

/// A pod's publisher driven by hand: what it published, for its replay socket.
#[derive(Clone, Default)]
struct Published(std::sync::Arc<std::sync::Mutex<Vec<(u64, bytes::Bytes)>>>);

impl Published {
    fn keep(&self, seq: u64, payload: &bytes::Bytes) {
        self.0.lock().expect("lock").push((seq, payload.clone()));
    }

    /// Answers replay requests as vLLM 0.26 does: every kept batch from the asked
    /// sequence number on, `[identity, "", topic, seq, payload]`, then the end marker.
    async fn serve_replays(self, mut router: zeromq::RouterSocket) {
        use zeromq::{SocketRecv, SocketSend};
        while let Ok(request) = router.recv().await {
            let frames = request.into_vec();
            let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
                continue;
            };
            let start = u64::from_be_bytes(start.as_ref().try_into().unwrap_or([0; 8]));
            let kept: Vec<(u64, bytes::Bytes)> = self.0.lock().expect("lock").clone();
            for (seq, payload) in kept.into_iter().filter(|(seq, _)| *seq >= start) {
                let reply = vec![
                    identity.clone(),
                    bytes::Bytes::new(),
                    bytes::Bytes::from_static(b"kv"),
                    bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ];
                let _ = router
                    .send(zeromq::ZmqMessage::try_from(reply).expect("frames"))
                    .await;
            }
            let end = vec![
                identity.clone(),
                bytes::Bytes::new(),
                bytes::Bytes::new(),
                bytes::Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                bytes::Bytes::new(),
            ];
            let _ = router
                .send(zeromq::ZmqMessage::try_from(end).expect("frames"))
                .await;
        }
    }
}

/// Sends batch `seq` on the PUB socket (and keeps it for replays).
async fn publish(
    publisher: &mut zeromq::PubSocket,
    kept: &Published,
    seq: u64,
    payload: &bytes::Bytes,
) {
    use zeromq::SocketSend;
    kept.keep(seq, payload);
    let message = vec![
        bytes::Bytes::from_static(b"kv"),
        bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload.clone(),
    ];
    publisher
        .send(zeromq::ZmqMessage::try_from(message).expect("frames"))
        .await
        .expect("published");
}

/// One simulated pod for HTTP (publishing nothing itself) and, for each of its
/// data-parallel ranks, a publisher this test drives: rank `r` on each endpoint's port +
/// `r`, as vLLM offsets them.
struct HandDriven {
    fleet: SimFleet,
    config: kvroute::config::ServeConfig,
    ranks: Vec<(zeromq::PubSocket, Published, tokio::task::JoinHandle<()>)>,
}

impl HandDriven {
    async fn start(ranks: u16) -> HandDriven {
        use zeromq::Socket;
        let (http, _http) = kvroute_lab::envoy::reserve_port_range(1).expect("a port");
        let (events, _events) = kvroute_lab::envoy::reserve_port_range(ranks).expect("ports");
        let (replay, _replay) = kvroute_lab::envoy::reserve_port_range(ranks).expect("ports");
        drop((_http, _events, _replay));
        let fleet = SimFleet::start(FleetConfig {
            model: MODEL.into(),
            port: http,
            speedup: 20.0,
            ..FleetConfig::uniform(1, PodConfig::default())
        })
        .await
        .expect("the pod starts");
        let mut publishers = Vec::new();
        for rank in 0..ranks {
            let mut publisher = zeromq::PubSocket::new();
            publisher
                .bind(&format!("tcp://127.0.0.1:{}", events + rank))
                .await
                .expect("PUB binds");
            let mut router = zeromq::RouterSocket::new();
            router
                .bind(&format!("tcp://127.0.0.1:{}", replay + rank))
                .await
                .expect("ROUTER binds");
            let kept = Published::default();
            let replays = tokio::spawn(kept.clone().serve_replays(router));
            publishers.push((publisher, kept, replays));
        }
        let template = |to: u16| {
            EndpointTemplate::parse(&kvroute_lab::compare::port_shift_template(http, to))
                .expect("template")
        };
        let mut config = test_config(fleet.endpoints());
        config.prefix_source = PrefixSource::Auto;
        config.kv_events.endpoint = template(events);
        config.kv_events.replay_endpoint = Some(template(replay));
        config.kv_events.dp_ranks = u32::from(ranks);
        HandDriven {
            fleet,
            config,
            ranks: publishers,
        }
    }

    async fn stop(self) {
        for (_, _, replays) in &self.ranks {
            replays.abort();
        }
        self.fleet.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_replayed_and_a_restarted_publisher_starts_the_pod_over() {
    let mut pod = HandDriven::start(1).await;
    let (mut publisher, kept, replays) = pod.ranks.pop().expect("rank 0");
    // Batch 0 exists before kvroute subscribes: it comes through the first replay.
    kept.keep(0, &stored(100, 4));
    let kvroute = Kvroute::start(pod.config.clone()).await;
    wait_for_metric(&kvroute, "kvroute_kv_event_streams", 1.0).await;
    wait_for_metric(&kvroute, "kvroute_kv_event_index_entries", 4.0).await;

    // Batch 1, live.
    wait_until_subscribed(&kvroute, &mut publisher).await;
    publish_and_wait(&kvroute, &mut publisher, &kept, 1, &stored(200, 4), 8.0).await;

    // Batch 2 is lost on the way; batch 3 shows the gap and the replay fills it.
    kept.keep(2, &stored(300, 4));
    publish(&mut publisher, &kept, 3, &stored(400, 4)).await;
    wait_for_metric(&kvroute, "kvroute_kv_event_index_entries", 16.0).await;
    let text = kvroute.metrics_text().await;
    assert_eq!(
        metric_value(&text, "kvroute_kv_event_gaps_total"),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric_value(&text, "kvroute_kv_event_resets_total"),
        0.0,
        "{text}"
    );

    // The pod restarts: its publisher counts from 0 again and its cache is empty. The
    // pod's 16 blocks are dropped; only what the new publisher stores is indexed.
    publish(&mut publisher, &kept, 0, &stored(500, 2)).await;
    let applied = "kvroute_kv_event_blocks_total{action=\"stored\"}";
    let text = scrape_after(&kvroute, applied, 18.0).await;
    assert_eq!(
        metric_value(&text, "kvroute_kv_event_resets_total"),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric_value(&text, "kvroute_kv_event_index_entries"),
        2.0,
        "only the new publisher's blocks:\n{text}"
    );
    replays.abort();
    pod.stop().await;
}

/// One batch evicting the blocks `first..first + blocks`.
fn removed(first: u64, blocks: u64) -> bytes::Bytes {
    use kvroute_sim::engine::{KvCacheEvent, KvEventBatch};
    let batch = KvEventBatch {
        at: Duration::ZERO,
        events: vec![KvCacheEvent::BlockRemoved {
            block_hashes: (first..first + blocks).collect(),
        }],
    };
    kvroute_sim::kv_events::wire::encode_batch(&batch, 1.0, 0)
        .expect("encodes")
        .into()
}

/// Waits until kvroute's subscription to `publisher` has reached it: a PUB socket drops
/// what it sends before a subscription arrives, a moment after the connection. Probes are
/// one-frame messages kvroute counts as malformed and otherwise ignores, so unlike a
/// batch sent twice (which kvroute must read as a restarted publisher) they cannot change
/// what it holds. One probe at a time, each given time to arrive.
async fn wait_until_subscribed(kvroute: &Kvroute, publisher: &mut zeromq::PubSocket) {
    use zeromq::SocketSend;
    let malformed = "kvroute_kv_event_batches_total{result=\"malformed\"}";
    let before = metric_value(&kvroute.metrics_text().await, malformed);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let probe = zeromq::ZmqMessage::from(bytes::Bytes::from_static(b"kv"));
        publisher.send(probe).await.expect("probe sent");
        let settle = Instant::now() + Duration::from_millis(200);
        while Instant::now() < settle {
            if metric_value(&kvroute.metrics_text().await, malformed) > before {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(Instant::now() < deadline, "the subscription never arrived");
    }
}

/// Publishes batch `seq` once and waits until kvroute's index holds exactly `entries`
/// blocks.
async fn publish_and_wait(
    kvroute: &Kvroute,
    publisher: &mut zeromq::PubSocket,
    kept: &Published,
    seq: u64,
    payload: &bytes::Bytes,
    entries: f64,
) {
    publish(publisher, kept, seq, payload).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = kvroute.metrics_text().await;
        if metric_value(&text, "kvroute_kv_event_index_entries") == entries {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "batch {seq} never showed {entries} entries:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_parallel_pod_holds_a_block_while_any_of_its_ranks_does() {
    let mut pod = HandDriven::start(2).await;
    let kvroute = Kvroute::start(pod.config.clone()).await;
    // The pod streams once both ranks do.
    wait_for_metric(&kvroute, "kvroute_kv_event_streams", 1.0).await;

    // Both ranks compute the same prompt, each under its own hashes: one pod, 4 blocks.
    let (mut publisher1, kept1, replays1) = pod.ranks.pop().expect("rank 1");
    let (mut publisher0, kept0, replays0) = pod.ranks.pop().expect("rank 0");
    wait_until_subscribed(&kvroute, &mut publisher1).await;
    publish_and_wait(&kvroute, &mut publisher1, &kept1, 0, &stored(100, 4), 4.0).await;
    let same_prompt = {
        use kvroute_sim::engine::{BlockStored, KvCacheEvent, KvEventBatch};
        let batch = KvEventBatch {
            at: Duration::ZERO,
            events: vec![KvCacheEvent::BlockStored(BlockStored {
                block_hashes: (900..904).collect(),
                parent_block_hash: None,
                token_ids: (0..64).map(|t| (100 * 1_000 + t) as u32).collect(),
                block_size: 16,
                lora: None,
            })],
        };
        bytes::Bytes::from(
            kvroute_sim::kv_events::wire::encode_batch(&batch, 1.0, 1).expect("encodes"),
        )
    };
    // Rank 0: 4 shared blocks and 2 of its own. (Should a late probe of rank 1 have
    // passed for rank 0's, and its first batch be dropped, its second shows the gap
    // and the replay brings the first.)
    wait_until_subscribed(&kvroute, &mut publisher0).await;
    publish(&mut publisher0, &kept0, 0, &same_prompt).await;
    publish_and_wait(&kvroute, &mut publisher0, &kept0, 1, &stored(700, 2), 6.0).await;
    // Rank 1 evicts the prompt: rank 0 still holds it, so the pod does.
    publish(&mut publisher1, &kept1, 1, &removed(100, 4)).await;
    let removed_total = "kvroute_kv_event_blocks_total{action=\"removed\"}";
    let text = scrape_after(&kvroute, removed_total, 4.0).await;
    assert_eq!(
        metric_value(&text, "kvroute_kv_event_index_entries"),
        6.0,
        "{text}"
    );
    // Rank 0 evicts it too: gone from the pod.
    publish_and_wait(&kvroute, &mut publisher0, &kept0, 2, &removed(900, 4), 2.0).await;
    for handle in [replays0, replays1] {
        handle.abort();
    }
    pod.stop().await;
}

/// The cached tokens a response's usage reports (vLLM leaves the details out at 0).
fn usage_cached(usage: &serde_json::Value) -> u64 {
    assert!(usage["prompt_tokens"].is_u64(), "a usage object: {usage}");
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// The usage object of a streamed completion's last event before `[DONE]`.
async fn streamed_usage(response: reqwest::Response) -> serde_json::Value {
    let text = response.text().await.expect("the stream ends");
    let last = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .rfind(|l| *l != "[DONE]")
        .expect("events");
    serde_json::from_str::<serde_json::Value>(last).expect("an event")["usage"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_response_observer_checks_each_prediction_against_the_pods_own_usage() {
    let (fleet, templates) = fleet().await;
    let pods = fleet.endpoints();
    let kvroute = following_events(test_config(pods.clone()), &templates, &pods).await;
    let client = http_client();
    let prompts: Vec<(String, SocketAddr)> = (0..4).map(|k| (prompt(k), pods[k % 2])).collect();
    compute_on(&client, &prompts).await;
    wait_for_metric(&kvroute, "kvroute_kv_event_index_entries", 4.0 * 18.0).await;

    // The shipped gateways with their commented-out observer turned on: fail closed, then
    // fail open (whose responses name the pod that served them, checked against the pick).
    let mut texts: Vec<String> = prompts.iter().map(|(t, _)| t.clone()).collect();
    texts.push(prompt(99));
    let mut served = 0;
    for (round, gateway) in [Gateway::OriginalDstObserved, Gateway::OverrideHostObserved]
        .into_iter()
        .enumerate()
    {
        let envoy = Envoy::start(gateway, kvroute.addrs.grpc, &pods).await;
        let url = envoy.url("/v1/completions");
        // Two answered whole, two streamed with usage asked for, then a prompt no pod held
        // before the first round.
        for (k, text) in texts.iter().enumerate() {
            let stream = k % 2 == 1;
            let mut body =
                json!({"model": MODEL, "prompt": format!("{text} and then?"), "max_tokens": 3});
            if stream {
                body["stream"] = json!(true);
                body["stream_options"] = json!({"include_usage": true});
            }
            let response = post(&client, &url, &body).await;
            assert_eq!(response.status(), 200, "{}", envoy.log());
            let usage = if stream {
                streamed_usage(response).await
            } else {
                response.json::<serde_json::Value>().await.expect("json")["usage"].clone()
            };
            let cached = usage_cached(&usage);
            assert_eq!(
                cached > 0,
                k < 4 || round > 0,
                "{gateway:?}, prompt {k}: {usage}"
            );
            served += cached;
        }
        // The observing stream ends after the client has its answer: wait for the checks.
        let checked = "kvroute_prefix_checks_total{source=\"kv_events\",outcome=\"as_predicted\"}";
        wait_for_metric(&kvroute, checked, 5.0 * (round + 1) as f64).await;
    }
    let text = kvroute.metrics_text().await;
    let tokens = |kind: &str| {
        metric_value(
            &text,
            &format!("kvroute_prefix_checked_tokens_total{{source=\"kv_events\",kind=\"{kind}\"}}"),
        ) as u64
    };
    // Each prediction came from the events, within a block of what the pod served, and
    // for the pod that served it.
    assert_eq!(tokens("served"), served, "{text}");
    assert!(
        tokens("predicted").abs_diff(served) <= 10 * 16,
        "predicted {} against {served} served:\n{text}",
        tokens("predicted")
    );
    for outcome in ["fewer", "more", "other_pod", "unreported"] {
        assert_eq!(
            metric_value(
                &text,
                &format!(
                    "kvroute_prefix_checks_total{{source=\"kv_events\",outcome=\"{outcome}\"}}"
                )
            ),
            0.0,
            "{outcome}:\n{text}"
        );
    }
    fleet.shutdown().await;
}
