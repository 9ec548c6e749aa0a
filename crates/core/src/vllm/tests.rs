use super::*;

const V0_11_SINGLE: &str =
    include_str!("../../tests/fixtures/metrics/vllm-v0.11-single-engine.txt");
const V0_6_LEGACY: &str = include_str!("../../tests/fixtures/metrics/vllm-v0.6-legacy.txt");
const DP2_LORA: &str = include_str!("../../tests/fixtures/metrics/vllm-dp2-lora.txt");
const V0_11_DP4: &str = include_str!("../../tests/fixtures/metrics/vllm-v0.11-dp4.txt");
const NOT_VLLM: &str = include_str!("../../tests/fixtures/metrics/not-vllm.txt");

/// A minimal page with the three required gauges and `extra` lines after.
fn page(waiting: &str, running: &str, kv_usage: &str, extra: &str) -> String {
    format!(
        "vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n\
         vllm:num_requests_running{{model_name=\"m\"}} {running}\n\
         vllm:kv_cache_usage_perc{{model_name=\"m\"}} {kv_usage}\n\
         {extra}\n"
    )
}

fn page_with(extra: &str) -> String {
    page("1.0", "2.0", "0.5", extra)
}

fn assert_close(actual: f64, expected: f64) {
    assert!(
        (actual - expected).abs() < 1e-12,
        "expected {expected}, got {actual}"
    );
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|name| (*name).to_owned()).collect()
}

#[test]
fn v0_11_single_engine_fixture_reads_every_field() {
    let metrics = parse_vllm_metrics(V0_11_SINGLE).unwrap();
    assert_eq!(
        metrics,
        PodMetrics {
            waiting: 2,
            running: 14,
            // 12164 of 29472 blocks in use.
            kv_usage: 12164.0 / 29472.0,
            kv_capacity_tokens: Some(29472 * 16),
            num_gpu_blocks: Some(29472),
            block_size: Some(16),
            engines: 1,
            lora: None,
            preemptions_total: Some(3.0),
            prefix_cache_hits_total: Some(182112.0),
            prefix_cache_queries_total: Some(431360.0),
        }
    );
}

#[test]
fn v0_6_legacy_fixture_reads_gpu_cache_usage_and_the_old_cache_config() {
    let metrics = parse_vllm_metrics(V0_6_LEGACY).unwrap();
    assert_eq!(
        metrics,
        PodMetrics {
            waiting: 5,
            running: 32,
            // 26803 of 27153 blocks in use.
            kv_usage: 26803.0 / 27153.0,
            kv_capacity_tokens: Some(27153 * 16),
            num_gpu_blocks: Some(27153),
            block_size: Some(16),
            engines: 1,
            lora: None,
            preemptions_total: Some(17.0),
            prefix_cache_hits_total: None,
            prefix_cache_queries_total: None,
        }
    );
}

#[test]
fn a_newer_dp2_pod_sums_per_engine_tokens_keeps_the_pod_blocks_and_picks_the_newest_lora_series() {
    let metrics = parse_vllm_metrics(DP2_LORA).unwrap();
    // Engine 0: 31 % of 224000 tokens; engine 1: 62 % of 192000 tokens. Both series carry
    // the pod's 26000 blocks, which must not be added up again.
    let expected_kv = (0.31 * 224000.0 + 0.62 * 192000.0) / 416000.0;
    assert_close(metrics.kv_usage, expected_kv);
    assert_eq!(
        metrics,
        PodMetrics {
            waiting: 4,
            running: 16,
            kv_usage: metrics.kv_usage,
            kv_capacity_tokens: Some(416000),
            num_gpu_blocks: Some(26000),
            block_size: Some(16),
            engines: 2,
            lora: Some(LoraStatus {
                max_lora: 4,
                running: names(&["sql-lora", "tweet-summary"]),
                waiting: names(&["legal-v2"]),
            }),
            preemptions_total: Some(7.0),
            prefix_cache_hits_total: Some(4000.0),
            prefix_cache_queries_total: Some(12000.0),
        }
    );
}

#[test]
fn a_page_without_vllm_metrics_is_reported_as_missing() {
    let err = parse_vllm_metrics(NOT_VLLM).unwrap_err();
    assert!(matches!(err, VllmMetricsError::Missing(_)), "{err}");
}

#[test]
fn an_empty_page_is_reported_as_missing() {
    let err = parse_vllm_metrics("").unwrap_err();
    assert!(matches!(err, VllmMetricsError::Missing(_)), "{err}");
}

#[test]
fn each_required_metric_is_named_when_missing() {
    let without = |skip: &str| {
        page_with("")
            .lines()
            .filter(|line| !line.starts_with(skip))
            .collect::<Vec<_>>()
            .join("\n")
    };
    for metric in [WAITING, RUNNING, KV_USAGE] {
        let err = parse_vllm_metrics(&without(metric)).unwrap_err();
        assert!(
            matches!(err, VllmMetricsError::Missing(name) if name == metric),
            "{metric}: {err}"
        );
    }
}

#[test]
fn a_malformed_line_is_an_exposition_error_with_its_line_number() {
    let err =
        parse_vllm_metrics(&page_with("vllm:num_requests_waiting{model_name=\"m\" 3")).unwrap_err();
    match err {
        VllmMetricsError::Exposition(inner) => assert_eq!(inner.line(), 4),
        other => panic!("expected an exposition error, got {other}"),
    }
}

#[test]
fn the_new_kv_usage_name_wins_over_the_legacy_one() {
    let metrics = parse_vllm_metrics(&page_with(
        "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9",
    ))
    .unwrap();
    assert_eq!(metrics.kv_usage, 0.5);
}

#[test]
fn a_broken_legacy_kv_series_is_ignored_when_the_new_name_is_present() {
    let metrics = parse_vllm_metrics(&page_with("vllm:gpu_cache_usage_perc NaN")).unwrap();
    assert_eq!(metrics.kv_usage, 0.5);
}

#[test]
fn a_broken_legacy_kv_series_is_invalid_when_it_is_the_only_one() {
    let text =
        "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:gpu_cache_usage_perc -1\n";
    let err = parse_vllm_metrics(text).unwrap_err();
    assert!(
        matches!(
            err,
            VllmMetricsError::Invalid {
                metric: KV_USAGE_LEGACY,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn kv_usage_above_one_is_clamped_to_one() {
    let text = page("0", "0", "1.0000001", "");
    assert_eq!(parse_vllm_metrics(&text).unwrap().kv_usage, 1.0);
}

#[test]
fn nan_negative_or_infinite_gauges_are_invalid() {
    let cases = [
        (WAITING, page("NaN", "0", "0", "")),
        (WAITING, page("-1", "0", "0", "")),
        (RUNNING, page("0", "+Inf", "0", "")),
        (KV_USAGE, page("0", "0", "NaN", "")),
        (KV_USAGE, page("0", "0", "-0.1", "")),
        (
            PREEMPTIONS,
            page("0", "0", "0", "vllm:num_preemptions_total -Inf"),
        ),
        (
            PREFIX_HITS,
            page("0", "0", "0", "vllm:prefix_cache_hits_total -3"),
        ),
    ];
    for (metric, text) in cases {
        let err = parse_vllm_metrics(&text).unwrap_err();
        assert!(
            matches!(err, VllmMetricsError::Invalid { metric: name, .. } if name == metric),
            "{metric}: {err}"
        );
    }
}

#[test]
fn a_fractional_queue_length_is_invalid() {
    let err = parse_vllm_metrics(&page("1.5", "0", "0", "")).unwrap_err();
    assert!(
        matches!(
            err,
            VllmMetricsError::Invalid {
                metric: WAITING,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn scientific_notation_values_parse() {
    let metrics = parse_vllm_metrics(&page("1.0e+00", "1.2e+01", "2.5e-01", "")).unwrap();
    assert_eq!(
        (metrics.waiting, metrics.running, metrics.kv_usage),
        (1, 12, 0.25)
    );
}

#[test]
fn queues_are_summed_over_models_and_engines() {
    let text = "\
vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 1
vllm:num_requests_waiting{engine=\"0\",model_name=\"b\"} 2
vllm:num_requests_waiting{engine=\"1\",model_name=\"a\"} 4
vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 8
vllm:num_requests_running{engine=\"1\",model_name=\"a\"} 16
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.2
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"a\"} 0.4
";
    let metrics = parse_vllm_metrics(text).unwrap();
    assert_eq!(
        (metrics.waiting, metrics.running, metrics.engines),
        (7, 24, 2)
    );
    // No cache config, so no capacities: a plain mean.
    assert_close(metrics.kv_usage, 0.3);
    assert_eq!(metrics.kv_capacity_tokens, None);
    assert_eq!(metrics.num_gpu_blocks, None);
}

#[test]
fn kv_cache_size_tokens_is_preferred_over_blocks_times_block_size() {
    let metrics = parse_vllm_metrics(&page_with(
        "vllm:cache_config_info{num_gpu_blocks=\"100\",block_size=\"528\",kv_cache_size_tokens=\"40000\"} 1",
    ))
    .unwrap();
    assert_eq!(metrics.kv_capacity_tokens, Some(40000));
    assert_eq!(metrics.num_gpu_blocks, Some(100));
    assert_eq!(metrics.block_size, Some(528));
}

#[test]
fn cache_config_labels_are_read_by_name_in_any_order() {
    let metrics = parse_vllm_metrics(&page_with(
        "vllm:cache_config_info{swap_space=\"4\",num_gpu_blocks=\"10\",cache_dtype=\"auto\",block_size=\"32\",sliding_window=\"None\"} 1.0",
    ))
    .unwrap();
    assert_eq!(metrics.kv_capacity_tokens, Some(320));
    assert_eq!(metrics.block_size, Some(32));
}

#[test]
fn none_block_counts_leave_the_capacity_unknown() {
    let metrics = parse_vllm_metrics(&page_with(
        "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1",
    ))
    .unwrap();
    assert_eq!(metrics.num_gpu_blocks, None);
    assert_eq!(metrics.kv_capacity_tokens, None);
    assert_eq!(metrics.block_size, Some(16));
}

#[test]
fn a_v0_11_dp4_pod_counts_its_blocks_once_and_its_queues_per_engine() {
    let metrics = parse_vllm_metrics(V0_11_DP4).unwrap();
    // Every engine's cache_config_info repeats the pod's 117888 blocks (4 × 29472).
    assert_eq!(metrics.num_gpu_blocks, Some(117_888));
    assert_eq!(metrics.kv_capacity_tokens, Some(117_888 * 16));
    assert_eq!(metrics.engines, 4);
    assert_eq!(
        (metrics.waiting, metrics.running),
        (2 + 1 + 5, 14 + 12 + 9 + 16)
    );
    let per_engine = [
        0.41273072747014117,
        0.3501357220412595,
        0.2204125950054288,
        0.5817589576547231,
    ];
    assert_close(metrics.kv_usage, per_engine.iter().sum::<f64>() / 4.0);
    assert_eq!(metrics.lora, None);
}

#[test]
fn the_pods_blocks_are_read_once_however_many_engines_repeat_them() {
    let text = "\
vllm:num_requests_waiting{engine=\"0\"} 0
vllm:num_requests_running{engine=\"0\"} 0
vllm:kv_cache_usage_perc{engine=\"0\"} 0.1
vllm:kv_cache_usage_perc{engine=\"1\"} 0.3
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"2000\"} 1
vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"2000\"} 1
";
    let metrics = parse_vllm_metrics(text).unwrap();
    assert_eq!(metrics.num_gpu_blocks, Some(2000));
    assert_eq!(metrics.kv_capacity_tokens, Some(32_000));
    assert_close(metrics.kv_usage, 0.2);
}

#[test]
fn per_engine_tokens_count_only_when_every_engine_states_them() {
    let text = "\
vllm:num_requests_waiting{engine=\"0\"} 0
vllm:num_requests_running{engine=\"0\"} 0
vllm:kv_cache_usage_perc{engine=\"0\"} 0.1
vllm:kv_cache_usage_perc{engine=\"1\"} 0.3
vllm:cache_config_info{block_size=\"16\",engine=\"0\",kv_cache_size_tokens=\"9000\",num_gpu_blocks=\"1000\"} 1
vllm:cache_config_info{block_size=\"16\",engine=\"1\",num_gpu_blocks=\"1000\"} 1
";
    let metrics = parse_vllm_metrics(text).unwrap();
    assert_eq!(metrics.kv_capacity_tokens, Some(16_000));
    assert_close(metrics.kv_usage, 0.2);
}

#[test]
fn a_zero_valued_cache_config_series_is_ignored() {
    let text = "\
vllm:num_requests_waiting{engine=\"0\"} 0
vllm:num_requests_running{engine=\"0\"} 0
vllm:kv_cache_usage_perc{engine=\"0\"} 0.1
vllm:cache_config_info{block_size=\"16\",engine=\"\",num_gpu_blocks=\"None\"} 0.0
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1000\"} 1.0
";
    let metrics = parse_vllm_metrics(text).unwrap();
    assert_eq!(metrics.num_gpu_blocks, Some(1000));
    assert_eq!(metrics.engines, 1);
}

#[test]
fn a_garbled_numeric_cache_label_is_invalid() {
    let err = parse_vllm_metrics(&page_with(
        "vllm:cache_config_info{block_size=\"sixteen\",num_gpu_blocks=\"10\"} 1",
    ))
    .unwrap_err();
    assert!(
        matches!(
            err,
            VllmMetricsError::Invalid {
                metric: CACHE_CONFIG,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn engines_disagreeing_on_block_size_is_invalid() {
    let text = "\
vllm:num_requests_waiting 0
vllm:num_requests_running 0
vllm:kv_cache_usage_perc 0
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1\"} 1
vllm:cache_config_info{block_size=\"32\",engine=\"1\",num_gpu_blocks=\"1\"} 1
";
    let err = parse_vllm_metrics(text).unwrap_err();
    assert!(
        matches!(
            err,
            VllmMetricsError::Invalid {
                metric: CACHE_CONFIG,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn the_lora_series_with_the_largest_timestamp_wins_wherever_it_is() {
    let metrics = parse_vllm_metrics(&page_with(
        "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 1.7e+09\n\
         vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"new\",waiting_lora_adapters=\"\"} 1.9e+09\n\
         vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"middle\",waiting_lora_adapters=\"\"} 1.8e+09",
    ))
    .unwrap();
    let lora = metrics.lora.unwrap();
    assert_eq!(lora.running, names(&["new"]));
    assert!(lora.waiting.is_empty());
    assert_eq!(lora.max_lora, 2);
}

#[test]
fn adapter_lists_are_split_trimmed_and_empty_names_dropped() {
    let metrics = parse_vllm_metrics(&page_with(
        "vllm:lora_requests_info{waiting_lora_adapters=\" a , ,b,\",running_lora_adapters=\"None\",max_lora=\"None\"} 1",
    ))
    .unwrap();
    assert_eq!(
        metrics.lora,
        Some(LoraStatus {
            max_lora: 0,
            running: Vec::new(),
            waiting: names(&["a", "b"]),
        })
    );
}

#[test]
fn a_nan_lora_timestamp_is_invalid() {
    let err = parse_vllm_metrics(&page_with(
        "vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} NaN",
    ))
    .unwrap_err();
    assert!(
        matches!(
            err,
            VllmMetricsError::Invalid {
                metric: LORA_INFO,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_queue_too_long_for_u32_is_invalid() {
    let err = parse_vllm_metrics(&page("5e9", "0", "0", "")).unwrap_err();
    assert!(
        matches!(
            err,
            VllmMetricsError::Invalid {
                metric: WAITING,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn unrelated_series_do_not_count_as_engines() {
    let metrics = parse_vllm_metrics(&page_with(
        "python_info{engine=\"x\"} 1\nvllm:other{engine=\"\"} 1",
    ))
    .unwrap();
    assert_eq!(metrics.engines, 1);
}
