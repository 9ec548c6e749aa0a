use super::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn parse(args: &[&str]) -> Result<ServeConfig, String> {
    let cli = Cli::try_parse_from(std::iter::once("kvroute").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?;
    ServeConfig::from_args(&cli.serve).map_err(|e| e.to_string())
}

#[test]
fn defaults_match_the_documented_ports_and_intervals() {
    let config = parse(&["--endpoints", "10.0.0.1:8000,10.0.0.2:8000"]).expect("valid");
    assert_eq!(config.grpc_addr, "0.0.0.0:9002".parse().expect("addr"));
    assert_eq!(
        config.health_addr,
        Some("0.0.0.0:9003".parse().expect("addr"))
    );
    assert_eq!(config.metrics_addr, "0.0.0.0:9090".parse().expect("addr"));
    assert_eq!(config.scrape.interval, Duration::from_millis(50));
    assert_eq!(config.max_body_bytes, 16 << 20);
    assert_eq!(config.endpoints.len(), 2);
}

#[test]
fn scrape_concurrency_follows_the_fleet_unless_bounded() {
    let auto = parse(&["--endpoints", "10.0.0.1:8000"]).expect("valid");
    assert_eq!(auto.scrape.concurrency, None, "default: one scrape per pod");
    let bounded =
        parse(&["--endpoints", "10.0.0.1:8000", "--scrape-concurrency", "32"]).expect("valid");
    assert_eq!(bounded.scrape.concurrency, Some(32));
    let explicit = parse(&[
        "--endpoints",
        "10.0.0.1:8000",
        "--scrape-concurrency",
        "AUTO",
    ])
    .expect("valid");
    assert_eq!(explicit.scrape.concurrency, None);
    for bad in ["0", "many", "1.5"] {
        let error = parse(&["--endpoints", "10.0.0.1:8000", "--scrape-concurrency", bad])
            .expect_err("invalid");
        assert!(error.contains("scrape-concurrency"), "{bad}: {error}");
    }
}

#[test]
fn a_typo_in_an_endpoint_is_rejected_with_its_text() {
    let error = parse(&["--endpoints", "10.0.0.1:8000,10.0.0.2"]).expect_err("invalid");
    assert!(error.contains("10.0.0.2"), "{error}");
}

#[test]
fn serving_without_endpoints_is_an_error() {
    let error = parse(&[]).expect_err("invalid");
    assert!(error.contains("no endpoints"), "{error}");
}

#[test]
fn the_health_address_can_be_switched_off() {
    let config = parse(&["--endpoints", "10.0.0.1:8000", "--health-addr", "off"]).expect("valid");
    assert_eq!(config.health_addr, None);
}

#[test]
fn the_admin_api_listens_on_loopback_by_default_and_can_be_switched_off() {
    let config = parse(&["--endpoints", "10.0.0.1:8000"]).expect("valid");
    assert_eq!(
        config.admin_addr,
        Some("127.0.0.1:9004".parse().expect("addr"))
    );
    let config = parse(&["--endpoints", "10.0.0.1:8000", "--admin-addr", "off"]).expect("valid");
    assert_eq!(config.admin_addr, None);
}

#[test]
fn byte_sizes_accept_binary_and_decimal_units() {
    assert_eq!(parse_byte_size("1024"), Ok(1024));
    assert_eq!(parse_byte_size("2KiB"), Ok(2048));
    assert_eq!(parse_byte_size("16MiB"), Ok(16 << 20));
    assert_eq!(parse_byte_size("1MB"), Ok(1_000_000));
    assert!(parse_byte_size("12 parsecs").is_err());
    assert!(parse_byte_size("MiB").is_err());
}

#[test]
fn the_file_supplies_endpoints_weights_and_adapters_and_flags_win() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kvroute.yaml");
    std::fs::write(
        &path,
        "endpoints: ['10.0.0.1:8000', '10.0.0.2:8000']\n\
         scheduler:\n  weights: {kv_headroom: 1, queue: 3, inflight: 0.5, lora_affinity: 4}\n\
         \x20 saturation: {queue_depth: 8, kv_usage: 0.9}\n  fallbacks: 1\n  max_metrics_age: 250ms\n\
         adapters: {sql-lora: llama}\n",
    )
    .expect("write");
    let path = path.to_str().expect("utf-8 path");
    let config = parse(&["--config", path, "--fallbacks", "3"]).expect("valid");
    assert_eq!(config.endpoints.len(), 2);
    assert_eq!(config.scheduler.weights.queue, 3.0);
    assert_eq!(config.scheduler.saturation.queue_depth, 8);
    assert_eq!(config.scheduler.max_metrics_age, Duration::from_millis(250));
    assert_eq!(config.scheduler.fallbacks, 3, "the flag beats the file");
    assert_eq!(
        config
            .scheduler
            .adapters
            .get("sql-lora")
            .map(String::as_str),
        Some("llama")
    );
}

#[test]
fn a_pool_name_selects_kubernetes_discovery_of_that_pool() {
    let config = parse(&["--pool-name", "vllm-llama3", "--pool-namespace", "llm"]).expect("valid");
    let kubernetes = config.kubernetes.expect("kubernetes discovery");
    assert_eq!(kubernetes.namespace.as_deref(), Some("llm"));
    assert_eq!(
        kubernetes.target,
        KubeTarget::Pool {
            name: "vllm-llama3".into()
        }
    );
    assert!(config.endpoints.is_empty());
}

#[test]
fn a_selector_with_ports_selects_kubernetes_discovery_of_pods() {
    let config = parse(&[
        "--endpoint-selector",
        "app=vllm,tier=gpu",
        "--endpoint-target-ports",
        "8001,8000",
    ])
    .expect("valid");
    let kubernetes = config.kubernetes.expect("kubernetes discovery");
    assert_eq!(kubernetes.namespace, None, "the client's namespace");
    let KubeTarget::Pods(target) = kubernetes.target else {
        panic!("expected a pod selector");
    };
    assert_eq!(target.selector().to_string(), "app=vllm,tier=gpu");
    assert_eq!(target.ports(), &[8000, 8001]);
}

#[test]
fn static_endpoints_and_kubernetes_discovery_together_are_one_clear_error() {
    let error = parse(&["--endpoints", "10.0.0.1:8000", "--pool-name", "p"]).expect_err("invalid");
    assert!(error.contains("exclude each other"), "{error}");
    assert!(!error.contains('\n'), "one line: {error}");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kvroute.yaml");
    std::fs::write(&path, "endpoints: ['10.0.0.1:8000']\n").expect("write");
    let path = path.to_str().expect("utf-8 path");
    let error = parse(&[
        "--config",
        path,
        "--endpoint-selector",
        "app=x",
        "--endpoint-target-ports",
        "80",
    ])
    .expect_err("invalid");
    assert!(error.contains("exclude each other"), "{error}");
}

#[test]
fn a_config_file_without_endpoints_goes_with_kubernetes_discovery() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kvroute.yaml");
    std::fs::write(&path, "scheduler: {fallbacks: 1}\n").expect("write");
    let path = path.to_str().expect("utf-8 path");
    let config = parse(&["--config", path, "--pool-name", "p"]).expect("valid");
    assert!(config.kubernetes.is_some());
    assert_eq!(config.scheduler.fallbacks, 1);
}

#[test]
fn incomplete_kubernetes_flags_are_rejected() {
    for (args, expected) in [
        (
            &["--endpoint-selector", "app=x"][..],
            "--endpoint-target-ports",
        ),
        (
            &["--endpoint-target-ports", "8000"][..],
            "--endpoint-selector",
        ),
        (&["--pool-namespace", "llm"][..], "--pool-name"),
        (
            &["--pool-name", "p", "--endpoint-selector", "a=b"][..],
            "exclude",
        ),
        (
            &["--pool-name", "p", "--endpoint-target-ports", "80"][..],
            "targetPorts",
        ),
        (
            &["--endpoint-selector", "", "--endpoint-target-ports", "80"][..],
            "empty selector",
        ),
        (
            &[
                "--endpoint-selector",
                "app",
                "--endpoint-target-ports",
                "80",
            ][..],
            "key=value",
        ),
        (
            &["--endpoint-selector", "a=b", "--endpoint-target-ports", "0"][..],
            "above 0",
        ),
    ] {
        let error = parse(args).expect_err("invalid");
        assert!(error.contains(expected), "{args:?}: {error}");
    }
}

#[test]
fn unknown_keys_in_the_file_are_rejected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kvroute.yaml");
    std::fs::write(&path, "endpoints: ['10.0.0.1:8000']\nschedular: {}\n").expect("write");
    let error = parse(&["--config", path.to_str().expect("utf-8")]).expect_err("invalid");
    assert!(error.contains("schedular"), "{error}");
}

#[test]
fn negative_weights_are_rejected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kvroute.yaml");
    std::fs::write(
        &path,
        "endpoints: ['10.0.0.1:8000']\nscheduler: {weights: {queue: -1}}\n",
    )
    .expect("write");
    let error = parse(&["--config", path.to_str().expect("utf-8")]).expect_err("invalid");
    assert!(error.contains("queue"), "{error}");
}

#[test]
fn tls_flags_go_together_and_reach_the_config() {
    let endpoints = ["--endpoints", "10.0.0.1:8000"];
    let with = |extra: &[&str]| {
        let args: Vec<&str> = endpoints.iter().chain(extra).copied().collect();
        parse(&args)
    };
    assert!(
        with(&["--grpc-tls-cert", "c.pem"]).is_err(),
        "a cert needs its key"
    );
    assert!(
        with(&["--grpc-tls-client-ca", "ca.pem"]).is_err(),
        "mTLS needs TLS"
    );
    let config = with(&[
        "--grpc-tls-cert",
        "c.pem",
        "--grpc-tls-key",
        "k.pem",
        "--grpc-tls-client-ca",
        "ca.pem",
        "--pod-ca-bundle",
        "pods.pem",
    ])
    .expect("valid");
    let tls = config.grpc_tls.expect("TLS on");
    assert_eq!(tls.cert, PathBuf::from("c.pem"));
    assert_eq!(tls.client_ca, Some(PathBuf::from("ca.pem")));
    assert_eq!(config.scrape.pod_ca_bundle, Some(PathBuf::from("pods.pem")));
    assert!(with(&[]).expect("valid").grpc_tls.is_none());
    // Precise routing tokenizes on HTTPS pods too.
    for source in ["precise", "auto"] {
        let config = with(&["--pod-ca-bundle", "pods.pem", "--prefix-source", source])
            .expect("events with HTTPS pods");
        assert!(config.prefix_source.uses_events());
    }
}

#[test]
fn resource_bounds_have_documented_defaults_and_refuse_nonsense() {
    let config = parse(&["--endpoints", "10.0.0.1:8000"]).expect("valid");
    assert_eq!(config.request_read_timeout, Duration::from_secs(30));
    assert_eq!(config.max_held_body_bytes, 1 << 30);
    assert_eq!(config.grpc_max_streams_per_connection, 1024);
    assert_eq!(
        config.debug_addr,
        Some("127.0.0.1:9091".parse().expect("addr"))
    );
    for bad in [
        &["--max-held-body-bytes", "1MiB"][..],
        &["--request-read-timeout", "0s"],
        &["--grpc-max-streams-per-connection", "0"],
        &["--allowed-paths", "v1/completions"],
        &["--allowed-paths", "/v1/completions?x=1"],
    ] {
        let args: Vec<&str> = ["--endpoints", "10.0.0.1:8000"]
            .iter()
            .chain(bad)
            .copied()
            .collect();
        assert!(parse(&args).is_err(), "{bad:?} must be refused");
    }
}

#[test]
fn flow_control_flags_set_the_queue_and_the_objectives() {
    let defaults = parse(&["--endpoints", "10.0.0.1:8000"]).expect("valid");
    assert_eq!(defaults.flow, FlowSettings::default());
    assert_eq!(defaults.flow.max_wait, Duration::from_secs(15));
    let config = parse(&[
        "--endpoints",
        "10.0.0.1:8000",
        "--max-queue-wait",
        "2s",
        "--max-queue-length",
        "10",
        "--no-wait-for-endpoints",
        "--objective-priority",
        "critical=100,batch=-10",
        "--objective-priority",
        "standard=0",
        "--standing-queue-wait",
        "500ms",
        "--standing-queue-after",
        "3s",
    ])
    .expect("valid");
    assert_eq!(
        config.flow.standing,
        Some(crate::flow::StandingQueue {
            after: Duration::from_secs(3),
            wait: Duration::from_millis(500),
        })
    );
    let off = parse(&["--endpoints", "10.0.0.1:8000", "--standing-queue-wait", "0"]);
    assert_eq!(off.expect("valid").flow.standing, None);
    assert_eq!(config.flow.max_wait, Duration::from_secs(2));
    assert_eq!(config.flow.max_waiting, 10);
    assert!(!config.flow.hold_without_endpoints);
    assert_eq!(
        config.flow.objectives,
        HashMap::from([
            ("critical".to_owned(), 100),
            ("batch".to_owned(), -10),
            ("standard".to_owned(), 0)
        ])
    );
}

#[test]
fn a_malformed_or_repeated_objective_is_refused_with_its_text() {
    let malformed = parse(&[
        "--endpoints",
        "10.0.0.1:8000",
        "--objective-priority",
        "critical=high",
    ])
    .expect_err("not a number");
    assert!(malformed.contains("critical=high"), "{malformed}");
    let repeated = parse(&[
        "--endpoints",
        "10.0.0.1:8000",
        "--objective-priority",
        "critical=1,critical=2",
    ])
    .expect_err("named twice");
    assert!(repeated.contains("`critical` twice"), "{repeated}");
}

#[test]
fn tokenizers_name_their_model_or_serve_all_and_need_the_events() {
    let base = ["--endpoints", "10.0.0.1:8000", "--prefix-source", "auto"];
    let with = |extra: &[&str]| parse(&[&base[..], extra].concat());
    let config = with(&[
        "--tokenizer",
        "/models/llama",
        "--tokenizer",
        "mistral=/models/mistral",
        "--tokenizer-cache-mib",
        "8",
        "--tokenizer-check-every",
        "50",
    ])
    .expect("valid");
    assert_eq!(
        config.tokenizers,
        [
            crate::tokenize::TokenizerSpec {
                model: None,
                dir: "/models/llama".into(),
            },
            crate::tokenize::TokenizerSpec {
                model: Some("mistral".into()),
                dir: "/models/mistral".into(),
            },
        ]
    );
    assert_eq!(config.tokenizer_cache_bytes, 8 << 20);
    assert_eq!(with(&[]).expect("valid").tokenizer_cache_bytes, 64 << 20);
    assert_eq!(config.tokenizer_check_every, 50);
    assert_eq!(with(&[]).expect("valid").tokenizer_check_every, 1000);
    let error = with(&["--tokenizer", "=/models/llama"]).expect_err("no model");
    assert!(error.contains("model before `=` is empty"), "{error}");
    // The approximate index matches text, not tokens: a tokenizer there is a mistake.
    let error = parse(&[
        "--endpoints",
        "10.0.0.1:8000",
        "--tokenizer",
        "/models/llama",
    ])
    .expect_err("approximate");
    assert!(error.contains("--prefix-source precise or auto"), "{error}");
}
