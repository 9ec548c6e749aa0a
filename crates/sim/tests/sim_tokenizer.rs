//! `--tokenizer`: pods that tokenize with a model's own tokenizer and chat template, as vLLM
//! does, over HTTP; and pods without it keep the synthetic tokenizer.

// A test that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::PathBuf;

use kvroute_sim::tokenizer::HfTokenizer;
use kvroute_sim::{FleetConfig, PodConfig, SimFleet};
use serde_json::{Value, json};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const BOS: u64 = 0;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../lab/tokenizers/bpe-4k")
}

async fn start(tokenizer: Option<PathBuf>) -> SimFleet {
    let pod = PodConfig {
        lora_adapters: vec!["sql-lora".into()],
        ..PodConfig::default()
    };
    SimFleet::start(FleetConfig {
        speedup: 50.0,
        tokenizer,
        ..FleetConfig::uniform(1, pod)
    })
    .await
    .expect("fleet starts")
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let res = reqwest::Client::new()
        .post(format!("http://{addr}{path}"))
        .json(&body)
        .send()
        .await
        .expect("request");
    let status = res.status().as_u16();
    (status, res.json().await.expect("json body"))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("a list of ids")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("an id")).expect("u32"))
        .collect()
}

#[tokio::test]
async fn tokenize_answers_what_the_model_tokenizer_computes() {
    let fleet = start(Some(fixture_dir())).await;
    let addr = fleet.endpoints()[0];
    let lib = HfTokenizer::load(&fixture_dir()).expect("loads");

    let prompt = "The KV cache of every pod is scraped every 50 ms.";
    let (status, tok) = post(addr, "/tokenize", json!({"model": MODEL, "prompt": prompt})).await;
    assert_eq!(status, 200, "{tok}");
    assert_eq!(
        ids(&tok["tokens"]),
        [
            0, 929, 571, 910, 321, 483, 335, 368, 3049, 483, 767, 413, 18
        ]
    );
    assert_eq!(tok["count"], 13);
    assert!(tok["max_model_len"].is_u64());
    assert!(tok["token_strs"].is_null());

    let (_, tok) = post(
        addr,
        "/tokenize",
        json!({"prompt": prompt, "add_special_tokens": false}),
    )
    .await;
    assert_eq!(tok["tokens"][0], 929, "no BOS when declined: {tok}");

    let chat = json!({"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
    ]});
    let (status, tok) = post(addr, "/tokenize", chat.clone()).await;
    assert_eq!(status, 200, "{tok}");
    let chat_ids = ids(&tok["tokens"]);
    assert_eq!(
        chat_ids,
        lib.encode_chat(&serde_json::to_vec(&chat).expect("serializes"))
            .expect("encodes")
    );
    let text = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
                <|start_header_id|>user<|end_header_id|>\n\nhello\nthere<|eot_id|>\
                <|start_header_id|>assistant<|end_header_id|>\n\n";
    assert_eq!(chat_ids, lib.encode(text, false).expect("encodes"));
    assert_eq!(
        chat_ids.iter().filter(|&&id| u64::from(id) == BOS).count(),
        1
    );

    // The render endpoints and the engine see the same ids; an adapter changes nothing.
    let (_, rendered) = post(addr, "/v1/chat/completions/render", chat.clone()).await;
    assert_eq!(ids(&rendered["token_ids"]), chat_ids);
    let mut on_adapter = chat.clone();
    on_adapter["model"] = json!("sql-lora");
    let (_, tok) = post(addr, "/tokenize", on_adapter).await;
    assert_eq!(ids(&tok["tokens"]), chat_ids);
    let mut generate = chat;
    generate["max_tokens"] = json!(2);
    let (status, done) = post(addr, "/v1/chat/completions", generate).await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["usage"]["prompt_tokens"], chat_ids.len());
    let (_, rendered) = post(
        addr,
        "/v1/completions/render",
        json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(rendered[0]["token_ids"][0], BOS);
    assert_eq!(rendered[0]["token_ids"].as_array().map(Vec::len), Some(13));

    fleet.shutdown().await;
}

#[tokio::test]
async fn a_template_error_is_a_bad_request_with_its_message() {
    let fleet = start(Some(fixture_dir())).await;
    let addr = fleet.endpoints()[0];
    let chat = json!({"messages": [{"role": "wizard", "content": "hi"}]});
    for path in [
        "/tokenize",
        "/v1/chat/completions",
        "/v1/chat/completions/render",
    ] {
        let (status, err) = post(addr, path, chat.clone()).await;
        assert_eq!(status, 400, "{path}: {err}");
        assert_eq!(err["error"]["type"], "BadRequestError");
        let message = err["error"]["message"].as_str().expect("message");
        assert!(
            message.contains("Unknown role: wizard"),
            "{path}: {message}"
        );
    }
    fleet.shutdown().await;
}

#[tokio::test]
async fn without_the_flag_pods_keep_the_synthetic_tokenizer() {
    let fleet = start(None).await;
    let addr = fleet.endpoints()[0];
    let prompt = "The KV cache of every pod is scraped every 50 ms.";
    let (_, tok) = post(addr, "/tokenize", json!({"prompt": prompt})).await;
    assert_eq!(ids(&tok["tokens"]), kvroute_sim::tokens::tokenize(prompt));
    let (status, _) = post(
        addr,
        "/tokenize",
        json!({"messages": [{"role": "wizard", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 200, "the synthetic template takes any role");
    fleet.shutdown().await;
}

#[tokio::test]
async fn a_missing_tokenizer_stops_the_start_naming_the_path() {
    let dir = PathBuf::from("/nonexistent/kvroute-sim-model");
    let err = SimFleet::start(FleetConfig {
        tokenizer: Some(dir),
        ..FleetConfig::uniform(1, PodConfig::default())
    })
    .await
    .err()
    .expect("no such directory");
    let message = format!("{err:#}");
    assert!(
        message.contains("/nonexistent/kvroute-sim-model/tokenizer.json"),
        "{message}"
    );
}

#[test]
fn the_binary_exits_non_zero_on_a_bad_tokenizer_directory() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-sim"))
        .args([
            "--port",
            "0",
            "--tokenizer",
            "/nonexistent/kvroute-sim-model",
        ])
        .env_remove("KVROUTE_SIM_CONFIG")
        .output()
        .expect("the binary runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("loading the tokenizer")
            && stderr.contains("/nonexistent/kvroute-sim-model/tokenizer.json"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
