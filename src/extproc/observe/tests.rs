use super::*;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, HttpTrailers};

fn prediction(cached: u64) -> PrefixPrediction {
    PrefixPrediction {
        cached_tokens: cached,
        source: "kv_events",
        pod: "10.0.0.1:8000".parse().expect("addr"),
        block_tokens: 16,
    }
}

fn scanned(chunks: &[&[u8]]) -> UsageScan {
    let mut scan = UsageScan::default();
    for (index, chunk) in chunks.iter().enumerate() {
        scan.feed(chunk, index + 1 == chunks.len());
    }
    scan
}

/// vLLM's last event of a stream with `stream_options.include_usage`.
const USAGE_EVENT: &[u8] = br#"data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":3200,"total_tokens":3208,"completion_tokens":8,"prompt_tokens_details":{"cached_tokens":2992}}}

data: [DONE]

"#;

#[test]
fn usage_is_read_with_or_without_spaces() {
    let scan = scanned(&[br#"{"usage": {"prompt_tokens" : 12, "completion_tokens": 42}}"#]);
    assert_eq!(scan.prompt_tokens, Some(12));
    assert_eq!(scan.completion_tokens, Some(42));
    assert_eq!(scan.cached_tokens, None);
    let scan = scanned(&[br#"{"completion_tokens":7,"x":1}"#]);
    assert_eq!(scan.completion_tokens, Some(7));
    assert_eq!(scanned(&[b"no usage here"]).prompt_tokens, None);
}

#[test]
fn usage_split_anywhere_between_chunks_is_read_whole() {
    let text = [
        b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n".as_slice(),
        USAGE_EVENT,
    ]
    .concat();
    for cut in 1..text.len() {
        let scan = scanned(&[&text[..cut], &text[cut..]]);
        assert_eq!(scan.cached_tokens, Some(2992), "cut at {cut}");
        assert_eq!(scan.prompt_tokens, Some(3200), "cut at {cut}");
        assert_eq!(scan.completion_tokens, Some(8), "cut at {cut}");
    }
}

#[test]
fn a_number_cut_by_an_abrupt_end_is_not_taken() {
    let mut scan = UsageScan::default();
    scan.feed(br#"{"usage":{"prompt_tokens":32"#, false);
    assert_eq!(scan.prompt_tokens, None, "32 may go on in the next chunk");
    scan.feed(b"00,", false);
    assert_eq!(scan.prompt_tokens, Some(3200));
}

#[test]
fn the_last_usage_object_wins() {
    // vLLM's continuous_usage_stats puts a usage object in every event.
    let scan = scanned(&[
        br#"data: {"usage":{"prompt_tokens":5,"completion_tokens":1}}"#,
        br#"data: {"usage":{"prompt_tokens":5,"completion_tokens":2}}"#,
    ]);
    assert_eq!(scan.completion_tokens, Some(2));
}

#[test]
fn model_text_that_quotes_a_usage_key_is_not_read_as_usage() {
    let scan = scanned(&[br#"data: {"choices":[{"text":"say \"cached_tokens\":5"}]}"#]);
    assert_eq!(scan.cached_tokens, None);
}

#[test]
fn predictions_compare_within_a_block() {
    let usage = |cached: u64| {
        scanned(&[format!(
            r#"{{"prompt_tokens":4000,"prompt_tokens_details":{{"cached_tokens":{cached}}}}}"#
        )
        .as_bytes()])
    };
    let p = prediction(2992);
    assert_eq!(
        compare(&p, &usage(2992), None),
        (CheckOutcome::AsPredicted, Some(2992))
    );
    // The engine recomputes the last token of a wholly cached prompt: one block less.
    assert_eq!(
        compare(&p, &usage(2976), None),
        (CheckOutcome::AsPredicted, Some(2976))
    );
    assert_eq!(
        compare(&p, &usage(1024), None),
        (CheckOutcome::Fewer, Some(1024))
    );
    assert_eq!(
        compare(&prediction(0), &usage(2992), None),
        (CheckOutcome::More, Some(2992))
    );
    let elsewhere = Some("10.0.0.2:8000".parse().expect("addr"));
    assert_eq!(
        compare(&p, &usage(2992), elsewhere),
        (CheckOutcome::OtherPod, None)
    );
    assert_eq!(
        compare(&p, &usage(2992), Some(p.pod)),
        (CheckOutcome::AsPredicted, Some(2992))
    );
}

#[test]
fn a_usage_without_details_counts_as_nothing_cached_once_pods_report_details() {
    // No usage at all says nothing.
    assert_eq!(
        compare(&prediction(64), &scanned(&[b"data: [DONE]"]), None),
        (CheckOutcome::Unreported, None)
    );
    // vLLM leaves prompt_tokens_details out when nothing was cached: once some response
    // carried it, its absence means 0.
    let hit = scanned(&[br#"{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}"#]);
    compare(&prediction(32), &hit, None);
    let miss = scanned(&[br#"{"prompt_tokens":40,"completion_tokens":1}"#]);
    assert_eq!(
        compare(&prediction(32), &miss, None),
        (CheckOutcome::Fewer, Some(0))
    );
}

/// The prediction's metadata as the observing filter forwards it.
fn forwarded(p: &PrefixPrediction) -> Metadata {
    let (namespace, value) = p.metadata_field();
    let Some(Kind::StructValue(fields)) = value.kind else {
        panic!("a struct")
    };
    let mut metadata = Metadata::default();
    metadata.filter_metadata.insert(namespace, fields);
    metadata
}

#[test]
fn the_prediction_survives_the_metadata_round_trip_and_forgeries_are_ignored() {
    let p = prediction(2992);
    let mut metadata = forwarded(&p);
    assert_eq!(PrefixPrediction::from_metadata(&metadata), Some(p));

    let mut forged = metadata.filter_metadata[PREDICTION_NAMESPACE].clone();
    forged.fields.insert(
        "prefix_source".into(),
        Value {
            kind: Some(Kind::StringValue("anything".into())),
        },
    );
    metadata
        .filter_metadata
        .insert(PREDICTION_NAMESPACE.into(), forged);
    assert_eq!(PrefixPrediction::from_metadata(&metadata), None);
    assert_eq!(PrefixPrediction::from_metadata(&Metadata::default()), None);
}

fn observed(message: processing_request::Request, metadata: Option<Metadata>) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(message),
        metadata_context: metadata,
        observability_mode: true,
        ..ProcessingRequest::default()
    }
}

#[test]
fn the_observer_checks_once_from_headers_body_and_trailers() {
    let p = prediction(2992);
    let metadata = forwarded(&p);
    let headers = HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![HeaderValue {
                key: SERVED_HEADER.into(),
                raw_value: b"10.0.0.2:8000".to_vec(),
                ..HeaderValue::default()
            }],
        }),
        ..HttpHeaders::default()
    };
    let mut observer = ResponseObserver::default();
    observer.handle(&observed(
        processing_request::Request::ResponseHeaders(headers),
        Some(metadata),
    ));
    assert_eq!(observer.prediction, Some(p));
    assert_eq!(
        observer.served_by,
        Some("10.0.0.2:8000".parse().expect("addr"))
    );
    observer.handle(&observed(
        processing_request::Request::ResponseBody(HttpBody {
            body: USAGE_EVENT.to_vec(),
            end_of_stream: true,
            ..HttpBody::default()
        }),
        None,
    ));
    assert!(observer.checked);
    assert_eq!(observer.usage.cached_tokens, Some(2992));
    // Trailers, or the stream's end, after the body do not check again.
    observer.handle(&observed(
        processing_request::Request::ResponseTrailers(HttpTrailers::default()),
        None,
    ));
    observer.finish();
}
