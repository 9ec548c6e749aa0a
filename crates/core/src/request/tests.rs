use super::*;

fn parse(api: ApiKind, body: &str) -> Result<InferenceRequest, RequestError> {
    parse_request(api, body.as_bytes())
}

fn parsed(api: ApiKind, body: &str) -> InferenceRequest {
    match parse(api, body) {
        Ok(request) => request,
        Err(err) => panic!("{body} should parse, got {err}"),
    }
}

/// The field an `InvalidField` error names, or a panic showing what came instead.
fn invalid_field(api: ApiKind, body: &str) -> &'static str {
    match parse(api, body) {
        Err(RequestError::InvalidField { field, .. }) => field,
        other => panic!("{body} should be an invalid field, got {other:?}"),
    }
}

fn chat(messages: &str) -> InferenceRequest {
    parsed(
        ApiKind::ChatCompletions,
        &format!(r#"{{"model":"m","messages":{messages}}}"#),
    )
}

fn completion(prompt: &str) -> InferenceRequest {
    parsed(
        ApiKind::Completions,
        &format!(r#"{{"model":"m","prompt":{prompt}}}"#),
    )
}

const OVERHEAD: u32 = MESSAGE_OVERHEAD_TOKENS;

#[test]
fn the_api_kind_comes_from_the_path_without_its_query() {
    assert_eq!(ApiKind::from_path("/v1/completions"), ApiKind::Completions);
    assert_eq!(
        ApiKind::from_path("/v1/chat/completions?stream=true"),
        ApiKind::ChatCompletions
    );
    assert_eq!(ApiKind::from_path("/v1/embeddings"), ApiKind::Other);
    assert_eq!(ApiKind::from_path("/v1/responses"), ApiKind::Other);
    assert_eq!(ApiKind::from_path("/v1/completions/x"), ApiKind::Other);
    assert_eq!(ApiKind::from_path(""), ApiKind::Other);
}

#[test]
fn estimates_round_up_four_bytes_to_a_token_and_saturate() {
    assert_eq!(estimate_tokens(0), 0);
    assert_eq!(estimate_tokens(1), 1);
    assert_eq!(estimate_tokens(4), 1);
    assert_eq!(estimate_tokens(5), 2);
    assert_eq!(estimate_tokens(usize::MAX), u32::MAX);
}

#[test]
fn a_completions_request_yields_model_prompt_budget_and_stream() {
    let request = parsed(
        ApiKind::Completions,
        r#"{"model":"llama-3-8b","prompt":"Hello, world!","max_tokens":64,"stream":true}"#,
    );
    assert_eq!(
        request,
        InferenceRequest {
            model: "llama-3-8b".to_owned(),
            prompt_tokens: 4,
            max_output_tokens: Some(64),
            stream: true,
            prompt_prefix: b"Hello, world!".to_vec(),
            prefix_context: 0,
        }
    );
}

#[test]
fn a_batch_of_string_prompts_sums_each_estimate_and_keeps_the_first_as_prefix() {
    let request = completion(r#"["abcd", "abcde", ""]"#);
    assert_eq!(request.prompt_tokens, 1 + 2);
    assert_eq!(request.prompt_prefix, b"abcd");
}

#[test]
fn token_id_prompts_count_one_token_per_id_and_have_no_prefix() {
    let request = completion("[101, 2023, 2003, 0]");
    assert_eq!(request.prompt_tokens, 4);
    assert!(request.prompt_prefix.is_empty());
    assert_eq!(completion("[[1, 2], [3, 4, 5], []]").prompt_tokens, 5);
}

#[test]
fn a_missing_or_null_completions_prompt_is_an_invalid_prompt() {
    assert_eq!(
        parse(ApiKind::Completions, r#"{"model":"m"}"#),
        Err(RequestError::InvalidField {
            field: "prompt",
            reason: "is required".to_owned()
        })
    );
    assert_eq!(
        invalid_field(ApiKind::Completions, r#"{"model":"m","prompt":null}"#),
        "prompt"
    );
    // Chat-style fields do not stand in for the prompt of a completion.
    assert_eq!(
        invalid_field(
            ApiKind::Completions,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#
        ),
        "prompt"
    );
}

#[test]
fn a_prompt_of_the_wrong_shape_is_an_invalid_prompt() {
    for prompt in [
        "5",
        "true",
        r#"{"text":"hi"}"#,
        "[1.5]",
        "[[1, \"x\"]]",
        "[{}]",
        "[null]",
    ] {
        let body = format!(r#"{{"model":"m","prompt":{prompt}}}"#);
        assert_eq!(
            invalid_field(ApiKind::Completions, &body),
            "prompt",
            "{body}"
        );
    }
}

#[test]
fn a_wrong_type_error_says_what_was_expected_and_where() {
    let Err(RequestError::InvalidField { field, reason }) = parse(
        ApiKind::ChatCompletions,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"user","content":7}]}"#,
    ) else {
        panic!("content 7 should be refused");
    };
    assert_eq!(field, "messages");
    assert!(reason.contains("messages[1].content"), "{reason}");
    assert!(reason.contains("line 1 column"), "{reason}");
}

#[test]
fn chat_messages_count_their_text_plus_a_per_message_overhead() {
    let request = chat(
        r#"[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello, world!"}]"#,
    );
    assert_eq!(request.prompt_tokens, OVERHEAD + 3 + OVERHEAD + 4);
}

#[test]
fn the_chat_prefix_joins_role_and_content_of_each_message_with_newlines() {
    let request = chat(
        r#"[{"role":"system","content":"Be brief."},{"content":"Hi","role":"user","name":"x"}]"#,
    );
    // The role comes first even when the JSON gives it after the content.
    assert_eq!(request.prompt_prefix, b"system\nBe brief.\nuser\nHi");
}

#[test]
fn chat_text_parts_are_counted_together_and_joined_in_the_prefix() {
    let request = chat(
        r#"[{"role":"user","content":[{"type":"text","text":"abcd"},{"text":"efgh","type":"text"},{"text":"ij"}]}]"#,
    );
    assert_eq!(request.prompt_tokens, OVERHEAD + estimate_tokens(10));
    assert_eq!(request.prompt_prefix, b"user\nabcd\nefgh\nij");
}

#[test]
fn null_or_absent_chat_content_counts_only_the_overhead() {
    let request = chat(
        r#"[{"role":"user","content":"What is 2+2?"},{"role":"assistant","content":null},{"role":"assistant"}]"#,
    );
    assert_eq!(request.prompt_tokens, OVERHEAD + 3 + OVERHEAD + OVERHEAD);
    assert_eq!(
        request.prompt_prefix,
        b"user\nWhat is 2+2?\nassistant\nassistant"
    );
}

#[test]
fn image_parts_add_a_fixed_estimate_and_mark_their_place_in_the_prefix() {
    let image = "A".repeat(1 << 20);
    let with_image = |image: &str| {
        chat(&format!(
            r#"[{{"role":"user","content":[
                {{"type":"image_url","image_url":{{"url":"data:image/png;base64,{image}"}}}},
                {{"type":"text","text":"What is this?"}},
                {{"type":"input_audio","input_audio":{{"data":"AAAA","format":"wav"}}}}]}}]"#
        ))
    };
    let request = with_image(&image);
    assert_eq!(
        request.prompt_tokens,
        OVERHEAD + estimate_tokens(13) + 2 * NON_TEXT_PART_TOKENS
    );
    // "user", the image's marker, the text, the audio's marker.
    let pieces: Vec<&[u8]> = request.prompt_prefix.split(|b| *b == b'\n').collect();
    assert_eq!(
        pieces.len(),
        4,
        "{:?}",
        String::from_utf8_lossy(&request.prompt_prefix)
    );
    assert_eq!(pieces[0], b"user");
    assert!(pieces[1].starts_with(b"\0part:") && pieces[1].len() == 22);
    assert_eq!(pieces[2], b"What is this?");
    assert!(pieces[3].starts_with(b"\0part:") && pieces[1] != pieces[3]);
    // The same image gives the same prefix; another image another one.
    assert_eq!(with_image(&image).prompt_prefix, request.prompt_prefix);
    assert_ne!(with_image("BBBB").prompt_prefix, request.prompt_prefix);
    // A part that is not text keeps its text out of the count and the prefix.
    let request = chat(r#"[{"role":"user","content":[{"text":"ignored","type":"refusal"}]}]"#);
    assert_eq!(request.prompt_tokens, OVERHEAD + NON_TEXT_PART_TOKENS);
    assert!(!request.prompt_prefix.windows(7).any(|w| w == b"ignored"));
}

#[test]
fn requests_that_differ_only_in_tools_have_different_prefix_contexts() {
    let with_tools = |tools: &str| {
        parsed(
            ApiKind::ChatCompletions,
            &format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"tools":{tools}}}"#
            ),
        )
    };
    let weather = r#"[{"type":"function","function":{"name":"weather","parameters":{}}}]"#;
    let stocks = r#"[{"type":"function","function":{"name":"stocks","parameters":{}}}]"#;
    let spaced = r#"[ { "type" : "function", "function" : {"name":"weather","parameters":{} } } ]"#;
    let (a, b) = (with_tools(weather), with_tools(stocks));
    assert_eq!(
        a.prompt_prefix, b.prompt_prefix,
        "the messages are the same"
    );
    assert_ne!(a.prefix_context, b.prefix_context);
    assert_ne!(a.prefix_context, 0);
    assert_eq!(
        with_tools(spaced).prefix_context,
        a.prefix_context,
        "whitespace is not content"
    );
    let without = chat(r#"[{"role":"user","content":"hi"}]"#);
    assert_eq!(without.prefix_context, 0);
    assert_eq!(without.prompt_prefix, a.prompt_prefix);
}

#[test]
fn tools_functions_and_tool_calls_add_their_json_length() {
    let tools = r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#;
    let functions = r#"[{"name":"f","parameters":{"n":-1.5,"ok":true,"x":null}}]"#;
    let request = parsed(
        ApiKind::ChatCompletions,
        &format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"tools": {tools},"functions":{functions},"tool_choice":"auto"}}"#
        ),
    );
    assert_eq!(
        request.prompt_tokens,
        OVERHEAD + 1 + estimate_tokens(tools.len()) + estimate_tokens(functions.len())
    );

    let calls = r#"[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]"#;
    let request = chat(&format!(
        r#"[{{"role":"assistant","content":null,"tool_calls":{calls}}},{{"role":"tool","tool_call_id":"c1","content":"sunny"}}]"#
    ));
    assert_eq!(
        request.prompt_tokens,
        OVERHEAD + estimate_tokens(calls.len()) + OVERHEAD + 2
    );
}

#[test]
fn null_tools_count_nothing() {
    let request = parsed(
        ApiKind::ChatCompletions,
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":null,"functions":null}"#,
    );
    assert_eq!(request.prompt_tokens, OVERHEAD + 1);
}

#[test]
fn missing_null_or_empty_messages_are_invalid_messages() {
    for body in [
        r#"{"model":"m"}"#,
        r#"{"model":"m","messages":null}"#,
        r#"{"model":"m","messages":[]}"#,
        r#"{"model":"m","messages":"hi"}"#,
        r#"{"model":"m","prompt":"hi"}"#,
    ] {
        assert_eq!(
            invalid_field(ApiKind::ChatCompletions, body),
            "messages",
            "{body}"
        );
    }
}

#[test]
fn malformed_messages_are_invalid_messages() {
    for messages in [
        r#"["hi"]"#,
        r#"[{"content":"hi"}]"#,
        r#"[{"role":1,"content":"hi"}]"#,
        r#"[{"role":"user","content":{"text":"hi"}}]"#,
        r#"[{"role":"user","content":["hi"]}]"#,
        r#"[{"role":"user","content":[{"type":"text","text":5}]}]"#,
        r#"[{"role":"user","content":[{"type":7,"text":"hi"}]}]"#,
    ] {
        let body = format!(r#"{{"model":"m","messages":{messages}}}"#);
        assert_eq!(
            invalid_field(ApiKind::ChatCompletions, &body),
            "messages",
            "{body}"
        );
    }
}

#[test]
fn max_completion_tokens_takes_precedence_over_max_tokens() {
    let body = r#"{"model":"m","prompt":"x","max_tokens":10,"max_completion_tokens":20}"#;
    assert_eq!(
        parsed(ApiKind::Completions, body).max_output_tokens,
        Some(20)
    );
    let body = r#"{"model":"m","prompt":"x","max_completion_tokens":20,"max_tokens":10}"#;
    assert_eq!(
        parsed(ApiKind::Completions, body).max_output_tokens,
        Some(20)
    );
    let body = r#"{"model":"m","prompt":"x","max_completion_tokens":null,"max_tokens":10}"#;
    assert_eq!(
        parsed(ApiKind::Completions, body).max_output_tokens,
        Some(10)
    );
    let body = r#"{"model":"m","prompt":"x","max_tokens":null}"#;
    assert_eq!(parsed(ApiKind::Completions, body).max_output_tokens, None);
}

#[test]
fn token_limits_accept_integral_numbers_and_saturate_above_u32() {
    for (value, expected) in [
        ("0", 0),
        ("100.0", 100),
        ("1e3", 1000),
        ("4294967296", u32::MAX),
        ("18446744073709551616", u32::MAX),
        ("1e30", u32::MAX),
    ] {
        let body = format!(r#"{{"model":"m","prompt":"x","max_tokens":{value}}}"#);
        assert_eq!(
            parsed(ApiKind::Completions, &body).max_output_tokens,
            Some(expected),
            "{body}"
        );
    }
}

#[test]
fn negative_fractional_or_non_numeric_token_limits_are_invalid() {
    for value in ["-1", "1.5", "-0.5", r#""100""#, "true", "[1]", "{}"] {
        for field in ["max_tokens", "max_completion_tokens"] {
            let body = format!(r#"{{"model":"m","prompt":"x","{field}":{value}}}"#);
            assert_eq!(invalid_field(ApiKind::Completions, &body), field, "{body}");
        }
    }
}

#[test]
fn stream_must_be_a_bool_and_null_or_absent_means_false() {
    let body = r#"{"model":"m","prompt":"x","stream":null}"#;
    assert!(!parsed(ApiKind::Completions, body).stream);
    let body = r#"{"model":"m","prompt":"x"}"#;
    assert!(!parsed(ApiKind::Completions, body).stream);
    for value in [r#""true""#, "1", "{}"] {
        let body = format!(r#"{{"model":"m","prompt":"x","stream":{value}}}"#);
        assert_eq!(
            invalid_field(ApiKind::Completions, &body),
            "stream",
            "{body}"
        );
    }
}

#[test]
fn a_missing_or_null_model_is_missing_model() {
    for api in [
        ApiKind::Completions,
        ApiKind::ChatCompletions,
        ApiKind::Other,
    ] {
        assert_eq!(
            parse(
                api,
                r#"{"prompt":"x","messages":[{"role":"user","content":"x"}]}"#
            ),
            Err(RequestError::MissingModel)
        );
        assert_eq!(
            parse(api, r#"{"model":null,"prompt":"x"}"#),
            Err(RequestError::MissingModel)
        );
    }
}

#[test]
fn a_non_string_or_empty_model_is_an_invalid_model() {
    for value in ["7", r#""""#, "[\"m\"]", "{}", "false"] {
        let body = format!(r#"{{"model":{value},"prompt":"x"}}"#);
        assert_eq!(
            invalid_field(ApiKind::Completions, &body),
            "model",
            "{body}"
        );
    }
}

#[test]
fn a_lora_adapter_name_is_kept_as_sent() {
    let body = r#"{"model":"sql-lora\u002dv2","prompt":"x"}"#;
    assert_eq!(parsed(ApiKind::Completions, body).model, "sql-lora-v2");
}

#[test]
fn an_empty_or_blank_body_is_an_empty_body() {
    assert_eq!(
        parse(ApiKind::Completions, ""),
        Err(RequestError::EmptyBody)
    );
    assert_eq!(
        parse(ApiKind::Completions, " \r\n\t"),
        Err(RequestError::EmptyBody)
    );
}

#[test]
fn truncated_json_is_invalid_json_with_a_position() {
    for body in [
        r#"{"model":"m","prompt":"abc"#,
        r#"{"model":"m","prompt":[1,2"#,
        r#"{"model":"m","#,
        "{",
    ] {
        match parse(ApiKind::Completions, body) {
            Err(RequestError::InvalidJson(message)) => {
                assert!(message.contains("line 1 column"), "{message}");
            }
            other => panic!("{body} should be invalid JSON, got {other:?}"),
        }
    }
}

#[test]
fn trailing_garbage_or_broken_syntax_is_invalid_json() {
    for body in [
        r#"{"model":"m","prompt":"x"} x"#,
        r#"{"model":"m","prompt":"x"}{}"#,
        r#"{"model":"m","prompt":[1,2,]}"#,
        r#"{"model":"m","prompt":"x",}"#,
        r#"{model:"m"}"#,
        "[1,",
        "hello",
    ] {
        assert!(
            matches!(
                parse(ApiKind::Completions, body),
                Err(RequestError::InvalidJson(_))
            ),
            "{body}"
        );
    }
    // Whitespace around the object is fine.
    parsed(
        ApiKind::Completions,
        " \n{\"model\":\"m\",\"prompt\":\"x\"}\n ",
    );
}

#[test]
fn invalid_utf8_is_invalid_json() {
    let body = b"{\"model\":\"m\",\"prompt\":\"\xff\"}";
    assert!(matches!(
        parse_request(ApiKind::Completions, body),
        Err(RequestError::InvalidJson(_))
    ));
}

#[test]
fn json_that_is_not_an_object_is_not_an_object() {
    for body in ["[]", r#"[{"model":"m"}]"#, r#""m""#, "42", "null", " true "] {
        assert_eq!(
            parse(ApiKind::ChatCompletions, body),
            Err(RequestError::NotAnObject),
            "{body}"
        );
    }
}

#[test]
fn unknown_fields_are_ignored_whatever_their_shape() {
    let request = parsed(
        ApiKind::Completions,
        r#"{"echo":true,"no_stop_trim":null,"model":"m","logit_bias":{"50256":-100},
                "stop":["\n"],"prompt":"abcd","sampling_params":{"nested":[[{"deep":1}]]},
                "temperature":0.7,"user":"\u00e9","messages":42}"#,
    );
    assert_eq!(request.model, "m");
    assert_eq!(request.prompt_tokens, 1);
}

#[test]
fn a_repeated_key_takes_its_last_value() {
    let request = parsed(
        ApiKind::Completions,
        r#"{"model":"a","prompt":"abcdefgh","model":"b","prompt":"xy"}"#,
    );
    assert_eq!(request.model, "b");
    assert_eq!(request.prompt_tokens, 1);
    assert_eq!(request.prompt_prefix, b"xy");
}

#[test]
fn other_apis_measure_prompt_then_input_then_messages() {
    let body = r#"{"model":"e5","input":"abcdefgh","prompt":"abcd"}"#;
    let request = parsed(ApiKind::Other, body);
    assert_eq!(request.prompt_tokens, 1);
    assert_eq!(request.prompt_prefix, b"abcd");

    let body = r#"{"model":"e5","prompt":null,"input":["abcd","efgh"]}"#;
    let request = parsed(ApiKind::Other, body);
    assert_eq!(request.prompt_tokens, 2);
    assert_eq!(request.prompt_prefix, b"abcd\nefgh");

    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let request = parsed(ApiKind::Other, body);
    assert_eq!(request.prompt_tokens, 2);
    assert_eq!(request.prompt_prefix, b"user\nhi");

    let body = r#"{"model":"e5","input":[[1,2,3],[4]]}"#;
    assert_eq!(parsed(ApiKind::Other, body).prompt_tokens, 4);
}

#[test]
fn other_apis_without_a_prompt_have_zero_tokens() {
    let request = parsed(
        ApiKind::Other,
        r#"{"model":"m","max_tokens":5,"stream":true}"#,
    );
    assert_eq!(request.prompt_tokens, 0);
    assert!(request.prompt_prefix.is_empty());
    assert_eq!(request.max_output_tokens, Some(5));
    assert!(request.stream);
}

#[test]
fn other_apis_accept_unfamiliar_input_shapes() {
    let image = "B".repeat(100_000);
    let body = format!(
        r#"{{"model":"m","input":[{{"type":"message","role":"user","content":[
                {{"type":"input_text","text":"Describe this"}},
                {{"type":"input_image","image_url":"data:image/png;base64,{image}"}}]}}]}}"#
    );
    let request = parsed(ApiKind::Other, &body);
    let text = [
        "message",
        "user",
        "input_text",
        "Describe this",
        "input_image",
    ];
    let text_tokens: u32 = text.iter().map(|t| estimate_tokens(t.len())).sum();
    assert_eq!(request.prompt_tokens, text_tokens + NON_TEXT_PART_TOKENS);
    assert_eq!(request.prompt_prefix, text.join("\n").as_bytes());
    // Other APIs still check the common fields.
    let body = r#"{"model":"m","input":"x","stream":"yes"}"#;
    assert_eq!(invalid_field(ApiKind::Other, body), "stream");
}

#[test]
fn a_ten_megabyte_prompt_gets_a_sane_estimate_and_a_bounded_prefix() {
    let text = "The quick brown fox jumps over the lazy dog. ".repeat((10 << 20) / 45);
    let body = format!(r#"{{"model":"m","prompt":"{text}"}}"#);
    let request = parsed(ApiKind::Completions, &body);
    assert_eq!(request.prompt_tokens, estimate_tokens(text.len()));
    assert!(
        request.prompt_tokens > 2_500_000,
        "{}",
        request.prompt_tokens
    );
    assert_eq!(
        request.prompt_prefix,
        text.as_bytes()[..PROMPT_PREFIX_BYTES]
    );

    // Escaped text is measured after unescaping, in chat as in completions.
    let escaped = "line\\n".repeat(2 << 20);
    let request = chat(&format!(r#"[{{"role":"user","content":"{escaped}"}}]"#));
    assert_eq!(
        request.prompt_tokens,
        OVERHEAD + estimate_tokens(5 * (2 << 20))
    );
    assert_eq!(request.prompt_prefix.len(), PROMPT_PREFIX_BYTES);
    assert!(request.prompt_prefix.starts_with(b"user\nline\nline\n"));
}

#[test]
fn millions_of_token_ids_are_counted() {
    let ids = vec!["31337"; 2 << 20].join(",");
    let request = completion(&format!("[[{ids}],[1]]"));
    assert_eq!(request.prompt_tokens, (2 << 20) + 1);
}

#[test]
fn the_prompt_prefix_is_bounded_and_starts_with_the_prompt_text() {
    let request = completion(&format!(r#""{}""#, "x".repeat(PROMPT_PREFIX_BYTES + 1)));
    assert_eq!(request.prompt_prefix, vec![b'x'; PROMPT_PREFIX_BYTES]);

    // Many messages: later ones still count but no longer grow the prefix.
    let message = format!(r#"{{"role":"user","content":"{}"}}"#, "y".repeat(1000));
    let request = chat(&format!("[{}]", [message.as_str(); 20].join(",")));
    assert_eq!(request.prompt_tokens, 20 * (OVERHEAD + 250));
    assert_eq!(request.prompt_prefix.len(), PROMPT_PREFIX_BYTES);
    assert!(request.prompt_prefix.starts_with(b"user\nyyyy"));

    // A long role is bounded too.
    let role = "r".repeat(3 * PROMPT_PREFIX_BYTES);
    let request = chat(&format!(r#"[{{"role":"{role}","content":"hi"}}]"#));
    assert_eq!(
        request.prompt_prefix,
        role.as_bytes()[..PROMPT_PREFIX_BYTES]
    );
}

#[test]
fn utf8_multibyte_text_is_counted_by_bytes() {
    // 3 characters, 9 bytes; 2 characters, 4 bytes (an escaped é and a literal é).
    assert_eq!(completion(r#""日本語""#).prompt_tokens, 3);
    let request = completion(r#""\u00e9é""#);
    assert_eq!(request.prompt_tokens, 1);
    assert_eq!(request.prompt_prefix, "éé".as_bytes());

    // The prefix is cut at a byte, which may fall inside a character.
    let text = "€".repeat(PROMPT_PREFIX_BYTES);
    let request = completion(&format!(r#""{text}""#));
    assert_eq!(
        request.prompt_tokens,
        estimate_tokens(3 * PROMPT_PREFIX_BYTES)
    );
    assert_eq!(
        request.prompt_prefix,
        text.as_bytes()[..PROMPT_PREFIX_BYTES]
    );
}

#[test]
fn every_error_is_an_invalid_request_with_a_stable_code() {
    let errors = [
        (RequestError::EmptyBody, "empty_body", None),
        (RequestError::InvalidJson("x".into()), "invalid_json", None),
        (RequestError::NotAnObject, "not_an_object", None),
        (RequestError::MissingModel, "missing_model", Some("model")),
        (
            RequestError::InvalidField {
                field: "prompt",
                reason: "is required".into(),
            },
            "invalid_field",
            Some("prompt"),
        ),
    ];
    for (error, code, param) in errors {
        assert_eq!(error.openai_type(), "invalid_request_error");
        assert_eq!(error.code(), code);
        assert_eq!(error.param(), param);
    }
    assert_eq!(
        required("prompt").to_string(),
        "invalid `prompt`: is required"
    );
}
