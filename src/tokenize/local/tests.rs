use std::path::PathBuf;

use super::*;

/// The lab's test tokenizer: a byte-level BPE shaped like Llama 3's
/// (`scripts/make-test-tokenizer.py`).
fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("crates/lab/tokenizers/bpe-4k")
}

fn loaded() -> LocalTokenizer {
    LocalTokenizer::load(&fixture(), CACHE).expect("the fixture loads")
}

const BOS: u32 = 0;
/// Room for the long pieces the tests encode.
const CACHE: usize = 1 << 20;

/// A directory holding the fixture's `tokenizer.json` and, as `chat_template.jinja`,
/// `template`.
fn with_template(template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::copy(
        fixture().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .expect("copy");
    std::fs::write(dir.path().join("chat_template.jinja"), template).expect("write");
    dir
}

#[test]
fn a_completion_is_encoded_as_pythons_tokenizers_encodes_it() {
    // Computed with Python's `tokenizers` on the same file.
    let tokens = loaded()
        .tokenize(
            ApiKind::Completions,
            br#"{"model":"m","prompt":"The KV cache of every pod is scraped every 50 ms."}"#,
        )
        .expect("tokenized");
    assert_eq!(
        tokens,
        [
            0, 929, 571, 910, 321, 483, 335, 368, 3049, 483, 767, 413, 18
        ]
    );
    let without_bos = loaded()
        .tokenize(
            ApiKind::Completions,
            br#"{"model":"m","prompt":"The KV cache of every pod is scraped every 50 ms.","add_special_tokens":false}"#,
        )
        .expect("tokenized");
    assert_eq!(without_bos, tokens[1..]);
}

#[test]
fn a_chat_is_rendered_with_the_template_then_encoded_without_a_second_bos() {
    let tokenizer = loaded();
    let chat = tokenizer
        .tokenize(
            ApiKind::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"system","content":"  Be brief. "},{"role":"user","content":"hello there"}]}"#,
        )
        .expect("tokenized");
    let rendered = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
        <|start_header_id|>user<|end_header_id|>\n\nhello there<|eot_id|>\
        <|start_header_id|>assistant<|end_header_id|>\n\n";
    let expected = tokenizer
        .tokenizer
        .encode(rendered, false)
        .expect("encodes")
        .get_ids()
        .to_vec();
    assert_eq!(chat, expected);
    assert_eq!(chat.iter().filter(|&&t| t == BOS).count(), 1);
    assert_eq!(chat[0], BOS);
    // Without the generation prompt the assistant's header is not written.
    let no_prompt = tokenizer
        .tokenize(
            ApiKind::ChatCompletions,
            br#"{"model":"m","add_generation_prompt":false,"messages":[{"role":"system","content":"  Be brief. "},{"role":"user","content":"hello there"}]}"#,
        )
        .expect("tokenized");
    assert!(chat.starts_with(&no_prompt) && chat.len() > no_prompt.len());
}

#[test]
fn text_parts_are_one_string_joined_by_newlines_unless_the_template_loops_over_them() {
    let tokenizer = loaded();
    let parts = tokenizer
        .tokenize(
            ApiKind::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"one"},{"type":"text","text":"two"}]}]}"#,
        )
        .expect("tokenized");
    let joined = tokenizer
        .tokenize(
            ApiKind::ChatCompletions,
            br#"{"model":"m","messages":[{"role":"user","content":"one\ntwo"}]}"#,
        )
        .expect("tokenized");
    assert_eq!(parts, joined);

    let looping = with_template(
        "{% for m in messages %}[{% for part in m['content'] %}{{ part['text'] }};{% endfor %}]{% endfor %}",
    );
    let looping = LocalTokenizer::load(looping.path(), CACHE).expect("loads");
    let expected = looping
        .tokenizer
        .encode("[one;two;][three;]", false)
        .expect("encodes")
        .get_ids()
        .to_vec();
    let tokens = looping
        .tokenize(
            ApiKind::ChatCompletions,
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"one"},{"type":"text","text":"two"}]},{"role":"user","content":"three"}]}"#,
        )
        .expect("tokenized");
    assert_eq!(tokens, expected);
}

#[test]
fn the_requests_template_arguments_reach_the_template() {
    let dir = with_template(
        "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}{{ bos_token }}",
    );
    let tokenizer = LocalTokenizer::load(dir.path(), CACHE).expect("loads");
    let encode = |text: &str| {
        tokenizer
            .tokenizer
            .encode(text, false)
            .expect("encodes")
            .get_ids()
            .to_vec()
    };
    let thinking = tokenizer
        .tokenize(
            ApiKind::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":true,"bos_token":"!"}}"#,
        )
        .expect("tokenized");
    assert_eq!(thinking, encode("<think>hi!"));
    // No tokenizer_config.json here: no BOS text, and nothing to think about.
    let plain = tokenizer
        .tokenize(
            ApiKind::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .expect("tokenized");
    assert_eq!(plain, encode("hi"));
}

#[test]
fn tools_and_documents_are_none_as_transformers_passes_them() {
    let dir = with_template(
        "{% if tools is not none %}tools{% endif %}{% if documents is none %}no documents{% endif %}\
         {% for m in messages %}|{{ m['content'] }}{% endfor %}",
    );
    let tokenizer = LocalTokenizer::load(dir.path(), CACHE).expect("loads");
    let tokens = tokenizer
        .tokenize(
            ApiKind::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"messages":[]}}"#,
        )
        .expect("tokenized");
    let expected = tokenizer
        .tokenizer
        .encode("no documents|hi", false)
        .expect("encodes")
        .get_ids()
        .to_vec();
    assert_eq!(
        tokens, expected,
        "and the keyword arguments do not replace the messages"
    );
}

#[test]
fn what_only_the_pod_renders_exactly_is_left_to_it() {
    let tokenizer = loaded();
    let chat = |body: &str| tokenizer.tokenize(ApiKind::ChatCompletions, body.as_bytes());
    for body in [
        r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"documents":[{"text":"d"}]}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"chat_template":"{{ 1 }}"}"#,
        r#"{"messages":[{"role":"assistant","content":"x"}],"continue_final_message":true}"#,
        r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[]}]}"#,
        r#"{"messages":[{"role":"tool","content":"42","tool_call_id":"a"}]}"#,
        r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}"#,
    ] {
        assert!(
            matches!(chat(body), Err(Unsupported::LeftToPod(_))),
            "{body}: {:?}",
            chat(body)
        );
    }
    // A body past what kvroute tokenizes.
    let long = format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x ".repeat(MAX_BODY_BYTES / 2)
    );
    assert!(matches!(chat(&long), Err(Unsupported::LeftToPod(_))));
    // Fields set to null are as good as absent.
    assert!(chat(r#"{"messages":[{"role":"user","content":"x"}],"tools":null}"#).is_ok());
    // The template's own refusal.
    assert!(matches!(
        chat(r#"{"messages":[{"role":"robot","content":"x"}]}"#),
        Err(Unsupported::Render(message)) if message.contains("Unknown role: robot")
    ));
    // Not one sequence's text: nobody tokenizes it.
    for body in [
        r#"{"prompt":["a","b"]}"#,
        r#"{"prompt":[1,2]}"#,
        r#"{"messages":"x""#,
    ] {
        assert_eq!(
            tokenizer.tokenize(ApiKind::Completions, body.as_bytes()),
            Err(Unsupported::NotOneText),
            "{body}"
        );
    }
}

#[test]
fn a_tokenizer_without_a_template_leaves_chats_to_the_pod() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::copy(
        fixture().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .expect("copy");
    let tokenizer = LocalTokenizer::load(dir.path(), CACHE).expect("loads");
    assert_eq!(
        tokenizer.tokenize(
            ApiKind::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"x"}]}"#
        ),
        Err(Unsupported::NoChatTemplate)
    );
    assert!(
        tokenizer
            .tokenize(ApiKind::Completions, br#"{"prompt":"x"}"#)
            .is_ok()
    );
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = LocalTokenizer::load(dir.path(), CACHE).expect_err("no tokenizer.json");
    assert!(missing.to_string().contains("tokenizer.json"), "{missing}");
    std::fs::copy(
        fixture().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .expect("copy");
    std::fs::write(dir.path().join("chat_template.jinja"), "{% for %}").expect("write");
    let broken = LocalTokenizer::load(dir.path(), CACHE).expect_err("bad template");
    assert!(
        broken.to_string().contains("chat_template.jinja"),
        "{broken}"
    );
    std::fs::remove_file(dir.path().join("chat_template.jinja")).expect("remove");
    std::fs::write(dir.path().join("tokenizer_config.json"), "{").expect("write");
    let config = LocalTokenizer::load(dir.path(), CACHE).expect_err("bad config");
    assert!(
        config.to_string().contains("tokenizer_config.json"),
        "{config}"
    );
}

#[test]
fn specs_name_a_model_or_serve_every_model() {
    assert_eq!(
        "meta-llama/Llama-3.1-8B-Instruct=/models/llama".parse(),
        Ok(TokenizerSpec {
            model: Some("meta-llama/Llama-3.1-8B-Instruct".into()),
            dir: "/models/llama".into(),
        })
    );
    assert_eq!(
        "/models/llama".parse(),
        Ok(TokenizerSpec {
            model: None,
            dir: "/models/llama".into(),
        })
    );
    assert!("=/models/llama".parse::<TokenizerSpec>().is_err());
    assert!("m=".parse::<TokenizerSpec>().is_err());

    let named = LocalTokenizers::load(
        &[TokenizerSpec {
            model: Some("llama".into()),
            dir: fixture(),
        }],
        CACHE,
    )
    .expect("loads");
    assert!(named.for_model("llama").is_some());
    assert!(named.for_model("mistral").is_none());
    let any = LocalTokenizers::load(
        &[TokenizerSpec {
            model: None,
            dir: fixture(),
        }],
        CACHE,
    )
    .expect("loads");
    assert!(any.for_model("mistral").is_some());
}
