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

/// The prompt text the directory `dir` renders for the chat request `body`.
fn rendered(dir: &std::path::Path, body: &[u8]) -> String {
    LocalTokenizer::load(dir, CACHE)
        .expect("loads")
        .prompt_text(ApiKind::ChatCompletions, body)
        .expect("rendered")
        .0
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
        .loaded
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
        .loaded
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
            .loaded
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
            br#"{"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .expect("tokenized");
    let expected = tokenizer
        .loaded
        .tokenizer
        .encode("no documents|hi", false)
        .expect("encodes")
        .get_ids()
        .to_vec();
    assert_eq!(tokens, expected);
}

#[test]
fn what_only_the_pod_renders_exactly_is_left_to_it() {
    let tokenizer = loaded();
    let chat = |body: &str| tokenizer.tokenize(ApiKind::ChatCompletions, body.as_bytes());
    for body in [
        r#"{"messages":[{"role":"user","content":"x"}],"documents":[{"text":"d","page":1}]}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"chat_template":"{{ 1 }}"}"#,
        // The generation prompt is on by default: transformers refuses both.
        r#"{"messages":[{"role":"assistant","content":"x"}],"continue_final_message":true}"#,
        r#"{"messages":[{"role":"assistant","content":"x"}],"continue_final_message":true,"add_generation_prompt":true}"#,
        // Tools and tool calls vLLM refuses, or whose handling changed between releases.
        r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"custom","custom":{"name":"f"}}]}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"tools":{"type":"function"}}"#,
        r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"[1]"}}]}]}"#,
        r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{"}}]}]}"#,
        r#"{"messages":[{"role":"developer","content":"x","tools":[]}]}"#,
        r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}"#,
        // vLLM merges the keyword arguments over its own: these replace what the
        // request's fields say, or fail the request.
        r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"tools":[{"type":"function","function":{"name":"f"}}]}}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"documents":[{"text":"d"}]}}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"chat_template":"{{ 1 }}"}}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"messages":[]}}"#,
        // Python keeps the integer whole, serde_json rounds it to a float.
        r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"seed":[123456789012345678901]}}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"maximum":99999999999999999999}}}]}"#,
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

#[test]
fn every_named_special_token_reaches_the_template() {
    let dir = with_template(
        "{{ bos_token }}|{{ pad_token }}|{{ unk_token }}|{{ sep_token }}|{{ mask_token is defined }}|\
         {{ messages[0].content }}",
    );
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"bos_token": "<s>", "pad_token": {"content": "<pad>", "special": true},
            "unk_token": "<unk>", "sep_token": null}"#,
    )
    .expect("write");
    // The legacy map fills in what the configuration does not name; it does not
    // override what it does.
    std::fs::write(
        dir.path().join("special_tokens_map.json"),
        r#"{"sep_token": "<sep>", "unk_token": "<other>"}"#,
    )
    .expect("write");
    let text = rendered(
        dir.path(),
        br#"{"messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(text, "<s>|<pad>|<unk>|<sep>|False|hi");
}

#[test]
fn an_assistants_reasoning_reaches_the_template_under_its_three_names() {
    let dir = with_template(
        "{% for m in messages %}[{{ (m|list)|first }} {{ m.role }}:{{ m.content }}\
         {% if m.reasoning_content is defined %}:{{ m.reasoning_content }}/{{ m.reasoning }}/{{ m.thinking }}{% endif %}\
         {% if m.name is defined %}:{{ m.name }}{% endif %}]{% endfor %}",
    );
    let text = rendered(
        dir.path(),
        br#"{"messages":[{"role":"user","content":"2+2?","name":"ann","reasoning":"not mine"},
            {"role":"assistant","content":"4","reasoning_content":"two and two"},
            {"role":"assistant","content":"5","reasoning":"r","reasoning_content":"rc"},
            {"role":"user","content":"q","name":7}]}"#,
    );
    // Only an assistant's reasoning is handed over (`reasoning` first, as vLLM reads
    // it; as `thinking` too, the first field, as transformers 5 adds it), and a name only
    // when it is a string.
    assert_eq!(
        text,
        "[role user:2+2?:ann][thinking assistant:4:two and two/two and two/two and two]\
         [thinking assistant:5:r/r/r][role user:q]"
    );
}

#[test]
fn tools_tool_calls_and_tool_results_reach_the_template_as_vllm_hands_them_over() {
    // Each message and tool printed whole: the fields' order and defaults are part of the
    // prompt (pydantic's model_dump for the tools, the typed dict's order for the calls,
    // the arguments parsed from their JSON string; written by vLLM's own models, pydantic
    // 2.14, for this request).
    let dir = with_template(
        "{{ tools | tojson }}\n{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
    );
    let text = rendered(
        dir.path(),
        br#"{"tools":[{"function":{"parameters":{"type":"object","properties":{"city":{"type":"string"}}},"name":"weather"},"type":"function"}],
            "messages":[{"content":"Weather in Paris?","role":"user"},
            {"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"weather","arguments":"{\"city\": \"Paris\", \"unit\": 1.0}"},"id":"call_1"}]},
            {"role":"tool","content":"18 C","tool_call_id":"call_1"},
            {"role":"assistant","content":"18 C.","tool_calls":[]},
            {"role":"developer","content":"Be brief."}]}"#,
    );
    assert_eq!(
        text,
        r#"[{"type": "function", "function": {"name": "weather", "description": null, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
{"role": "user", "content": "Weather in Paris?"}
{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "function": {"arguments": {"city": "Paris", "unit": 1.0}, "name": "weather"}, "type": "function"}]}
{"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
{"role": "assistant", "content": "18 C."}
{"role": "developer", "content": "Be brief.", "tools": null}
"#
    );
}

#[test]
fn documents_reach_the_template_as_the_request_gives_them() {
    let dir = with_template("{{ documents | tojson }}|{{ messages[0].content }}");
    assert_eq!(
        rendered(
            dir.path(),
            br#"{"documents":[{"title":"b","text":"x"},{"text":"y","title":"a"}],
                "messages":[{"role":"user","content":"q"}]}"#
        ),
        r#"[{"title": "b", "text": "x"}, {"text": "y", "title": "a"}]|q"#
    );
}

#[test]
fn a_continued_final_message_is_cut_where_transformers_cuts_it() {
    // transformers appends a marker to the final message's text, renders, and cuts at the
    // marker: right there where the template kept the marker's space, after stripping the
    // whitespace before it where the template trimmed the content.
    let keeps = with_template(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}",
    );
    let trims = with_template(
        "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}",
    );
    let parts = with_template(
        "{% for m in messages %}<{{ m.role }}>{% for p in m.content %}[{{ p.text }}]{% endfor %}</{{ m.role }}>{% endfor %}",
    );
    let body = br#"{"continue_final_message":true,"add_generation_prompt":false,
        "messages":[{"role":"user","content":"Name a color."},{"role":"assistant","content":"The color is "}]}"#;
    assert_eq!(
        rendered(keeps.path(), body),
        "<user>Name a color.</user><assistant>The color is "
    );
    assert_eq!(
        rendered(trims.path(), body),
        "<user>Name a color.</user><assistant>The color is"
    );
    let body = br#"{"continue_final_message":true,"add_generation_prompt":false,
        "messages":[{"role":"assistant","content":[{"type":"text","text":"One"},{"type":"text","text":"Two"}]}]}"#;
    assert_eq!(rendered(parts.path(), body), "<assistant>[One][Two");
    // A template that drops the final message: transformers refuses, so does kvroute.
    let drops = with_template("{% for m in messages[:-1] %}{{ m.content }}{% endfor %}");
    let refused = LocalTokenizer::load(drops.path(), CACHE)
        .expect("loads")
        .prompt_text(ApiKind::ChatCompletions, body);
    assert!(
        matches!(refused, Err(Unsupported::Render(_))),
        "{refused:?}"
    );
}

#[test]
fn a_request_with_tools_renders_the_tool_use_template_where_the_tokenizer_names_one() {
    let dir = with_template("unused");
    std::fs::remove_file(dir.path().join("chat_template.jinja")).expect("remove");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "default", "template": "default {{ tools }}"},
                              {"name": "tool_use", "template": "tool_use {{ tools | length }}"}]}"#,
    )
    .expect("write");
    let render = |body: &[u8]| rendered(dir.path(), body);
    assert_eq!(render(br#"{"messages":[]}"#), "default None");
    assert_eq!(render(br#"{"messages":[],"tools":null}"#), "default None");
    // transformers asks whether tools were given, not whether there are any.
    assert_eq!(render(br#"{"messages":[],"tools":[]}"#), "tool_use 0");
    assert_eq!(
        render(br#"{"messages":[],"tools":[{"type":"function","function":{"name":"f"}}]}"#),
        "tool_use 1"
    );
}

#[test]
fn generation_blocks_render_their_body_and_trim_as_their_tags_do() {
    // transformers' `{% generation %}` marks the assistant's tokens for training masks;
    // jinja2 renders "A" "B" "hi" "C" here, the tags' dashes trimming the whitespace.
    let dir = with_template(
        "A\n  {%- generation %}B{{ messages[0].content }}{% endgeneration -%}\n  C\
         {%generation%}D{%endgeneration%}",
    );
    let text = rendered(
        dir.path(),
        br#"{"messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(text, "ABhiCD");
}

#[test]
fn a_processors_template_comes_before_the_configurations_and_after_the_jinja_file() {
    let dir = with_template("jinja");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "config"}"#,
    )
    .expect("write");
    std::fs::write(
        dir.path().join("chat_template.json"),
        r#"{"chat_template": "processor"}"#,
    )
    .expect("write");
    let rendered = |dir: &std::path::Path| rendered(dir, br#"{"messages":[]}"#);
    assert_eq!(rendered(dir.path()), "jinja");
    std::fs::remove_file(dir.path().join("chat_template.jinja")).expect("remove");
    assert_eq!(rendered(dir.path()), "processor");
    std::fs::remove_file(dir.path().join("chat_template.json")).expect("remove");
    assert_eq!(rendered(dir.path()), "config");
}

#[test]
fn templates_render_as_jinja2_renders_them_where_minijinja_would_not() {
    // Each expected text is what transformers' renderer gives for the same template and
    // conversation (checked by scripts/compare-chat-templates.py's way of rendering).
    let dir = with_template(
        "{{- 'A long system prompt, \\\n cut where Python continues the line.' }}\n\
         {%- for m in messages %}{% for part in m['content'] %}{% endfor %}{% endfor %}\
         |{{ messages[0]['content'] | trim }}|{{ messages[0] }}|{{ {'b': 1, 'a': 2.5e20} }}",
    );
    let text = rendered(
        dir.path(),
        br#"{"messages":[{"role":"user","content":"it's"}]}"#,
    );
    assert_eq!(
        text,
        "A long system prompt,  cut where Python continues the line.\
         |[{'type': 'text', 'text': \"it's\"}]\
         |{'role': 'user', 'content': [{'type': 'text', 'text': \"it's\"}]}\
         |{'b': 1, 'a': 2.5e+20}"
    );
}

#[test]
fn a_tokenizer_checks_its_first_prompt_then_every_nth_and_is_set_aside_once_it_differs() {
    let tokenizers = LocalTokenizers::load(
        &[TokenizerSpec {
            model: None,
            dir: fixture(),
        }],
        0,
    )
    .expect("loads");
    let tokenizer = tokenizers.for_model("m").expect("serves every model");
    let (plain, tools) = (PromptKind::Plain, PromptKind::Tools);
    // Not checking until told to.
    assert!(!tokenizer.due_for_check(plain));
    let tokenizers = tokenizers.checking_every(3);
    let due: Vec<bool> = (0..7).map(|_| tokenizer.due_for_check(plain)).collect();
    assert_eq!(due, [true, false, false, true, false, false, true]);
    // Prompts with tools are counted apart: their first is checked too.
    assert!(tokenizer.due_for_check(tools));
    assert!(!tokenizer.due_for_check(tools));
    assert!(tokenizer.found_different(plain), "the first finding");
    assert!(!tokenizer.found_different(plain), "not the first any more");
    assert!(
        tokenizers.for_model("m").is_none(),
        "the pods tokenize from now on"
    );
}

#[test]
fn one_directory_for_every_model_is_checked_and_set_aside_model_by_model() {
    let tokenizers = LocalTokenizers::load(
        &[TokenizerSpec {
            model: None,
            dir: fixture(),
        }],
        CACHE,
    )
    .expect("loads")
    .checking_every(1000);
    let (a, b) = (
        tokenizers.for_model("a").expect("serves a"),
        tokenizers.for_model("b").expect("serves b"),
    );
    // Each model's first prompt is checked.
    assert!(a.due_for_check(PromptKind::Plain));
    assert!(b.due_for_check(PromptKind::Plain));
    assert!(!a.due_for_check(PromptKind::Plain));
    // One model's tokens differing leaves the other's local tokenizer in place, the
    // directory and its remembered pieces shared.
    assert!(a.found_different(PromptKind::Plain));
    assert!(tokenizers.for_model("a").is_none());
    let b_again = tokenizers.for_model("b").expect("b still tokenized here");
    assert!(Arc::ptr_eq(&b, &b_again));
    assert!(Arc::ptr_eq(&a.loaded, &b.loaded));
}

#[test]
fn a_difference_found_on_a_prompt_with_tools_or_reasoning_sets_aside_only_its_kind() {
    let tokenizer = loaded();
    let chat = |body: &str| tokenizer.tokenize(ApiKind::ChatCompletions, body.as_bytes());
    let plain = r#"{"messages":[{"role":"user","content":"x"}]}"#;
    let with_tools = r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#;
    let tool_result = r#"{"messages":[{"role":"tool","tool_call_id":"a","content":"x"}]}"#;
    let reasoning = r#"{"messages":[{"role":"assistant","content":"4","reasoning_content":"2+2"},{"role":"user","content":"x"}]}"#;
    let both = r#"{"messages":[{"role":"assistant","content":"4","reasoning":"2+2"},{"role":"tool","tool_call_id":"a","content":"x"}]}"#;
    assert_eq!(PromptKind::of(plain.as_bytes()), PromptKind::Plain);
    assert_eq!(PromptKind::of(with_tools.as_bytes()), PromptKind::Tools);
    assert_eq!(PromptKind::of(tool_result.as_bytes()), PromptKind::Tools);
    assert_eq!(PromptKind::of(reasoning.as_bytes()), PromptKind::Reasoning);
    assert_eq!(PromptKind::of(both.as_bytes()), PromptKind::Reasoning);
    for body in [plain, with_tools, tool_result, reasoning, both] {
        assert!(chat(body).is_ok(), "{body}");
    }
    let set_aside = |body: &str| matches!(chat(body), Err(Unsupported::LeftToPod(why)) if why.contains("a check"));
    // An engine that renders reasoning otherwise (on transformers 4): prompts with
    // reasoning go to the pods, those with tools only stay here.
    assert!(tokenizer.found_different(PromptKind::Reasoning));
    assert!(set_aside(reasoning) && set_aside(both));
    assert!(!set_aside(with_tools) && !set_aside(tool_result) && !set_aside(plain));
    // Then tools too: every prompt with tools goes, with or without reasoning.
    assert!(tokenizer.found_different(PromptKind::Tools));
    for body in [with_tools, tool_result, reasoning, both] {
        assert!(set_aside(body), "{body}");
    }
    assert!(
        chat(plain).is_ok(),
        "prompts with neither are still tokenized here"
    );
    assert!(!tokenizer.differs());
}
