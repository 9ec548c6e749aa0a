//! TLS where production needs it: the ext_proc port served over TLS, with gateways made to
//! present a client certificate (mutual TLS), and pods scraped, and asked to tokenize
//! prompts, over HTTPS against a CA bundle. Certificates are made for each run (a CA, a server certificate for 127.0.0.1,
//! a client certificate).

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, SanType,
};
use tokio_rustls::rustls;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use kvroute::app::EXTPROC_SERVICE;
use kvroute::config::GrpcTls;
use support::{Envoy, FakePod, Gateway, Kvroute, test_config};

/// A certificate authority and what it signed, as PEM files in a temporary directory.
struct Pki {
    dir: tempfile::TempDir,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

/// A signed certificate: PEM text and DER, with its key.
struct Issued {
    cert_pem: String,
    cert_der: Vec<u8>,
    key_pem: String,
    key_der: Vec<u8>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let ca = params.self_signed(&ca_key).expect("CA");
        Pki {
            dir: tempfile::tempdir().expect("tempdir"),
            ca,
            ca_key,
        }
    }

    fn issue(&self, name: &str, purpose: ExtendedKeyUsagePurpose) -> Issued {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        if purpose == ExtendedKeyUsagePurpose::ServerAuth {
            params.subject_alt_names = vec![SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST))];
        }
        params.extended_key_usages = vec![purpose];
        let cert = params
            .signed_by(&key, &self.ca, &self.ca_key)
            .expect("signed");
        Issued {
            cert_pem: cert.pem(),
            cert_der: cert.der().to_vec(),
            key_pem: key.serialize_pem(),
            key_der: key.serialize_der(),
        }
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).expect("write PEM");
        path
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }
}

async fn extproc_status(addr: SocketAddr, tls: ClientTlsConfig) -> Result<ServingStatus, String> {
    let channel = Endpoint::from_shared(format!("https://{addr}"))
        .expect("endpoint")
        .tls_config(tls)
        .expect("client TLS")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: EXTPROC_SERVICE.into(),
        })
        .await
        .map_err(|e| format!("check: {e:?}"))?;
    Ok(answer.into_inner().status())
}

/// `exchange`'s answer, or a failure naming `step` after 20 s.
async fn within<T>(step: &str, exchange: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), exchange)
        .await
        .unwrap_or_else(|_| panic!("{step}: no answer within 20 s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ext_proc_port_speaks_tls_and_admits_only_gateways_with_a_client_certificate() {
    let pki = Pki::new("kvroute test CA");
    let server = pki.issue("kvroute", ExtendedKeyUsagePurpose::ServerAuth);
    let gateway = pki.issue("gateway", ExtendedKeyUsagePurpose::ClientAuth);
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    let mut config = test_config(vec![pod.addr]);
    config.grpc_tls = Some(GrpcTls {
        cert: pki.write("server.pem", &server.cert_pem),
        key: pki.write("server-key.pem", &server.key_pem),
        client_ca: Some(pki.write("ca.pem", &pki.ca_pem())),
    });
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_scraped(1).await;
    let trusting = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(pki.ca_pem()))
        .domain_name("127.0.0.1");

    let with_certificate = trusting
        .clone()
        .identity(Identity::from_pem(&gateway.cert_pem, &gateway.key_pem));
    // Each exchange is bounded, so that a hang names its step (one such hang was seen once,
    // under a loaded machine, before the server bounded its handshakes).
    let with = within(
        "with a client certificate",
        extproc_status(kvroute.addrs.grpc, with_certificate),
    )
    .await;
    assert_eq!(with, Ok(ServingStatus::Serving));
    let without = within(
        "without a client certificate",
        extproc_status(kvroute.addrs.grpc, trusting),
    )
    .await;
    assert!(
        without.is_err(),
        "no client certificate, no service: {without:?}"
    );
    // Plain HTTP/2 on a TLS port gets nowhere either.
    let plain = within("plain text", async {
        let channel = Endpoint::from_shared(format!("http://{}", kvroute.addrs.grpc))
            .expect("endpoint")
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| format!("connect: {e:?}"))?;
        HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: EXTPROC_SERVICE.into(),
            })
            .await
            .map_err(|e| format!("check: {e:?}"))
    })
    .await;
    assert!(plain.is_err(), "plain text answered: {plain:?}");
}

/// A TLS front for a plain pod: vLLM started with `--ssl-certfile` looks like this.
async fn https_front(target: SocketAddr, issued: &Issued) -> SocketAddr {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![issued.cert_der.clone().into()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(issued.key_der.clone().into()),
        )
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(client).await else {
                    return;
                };
                let Ok(mut pod) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut pod).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_are_scraped_over_https_trusting_only_the_given_ca_bundle() {
    let pki = Pki::new("pod CA");
    let pod_cert = pki.issue("pod", ExtendedKeyUsagePurpose::ServerAuth);
    let pod = FakePod::start("pod-0", "llama", &[]).await;
    let front = https_front(pod.addr, &pod_cert).await;

    let mut config = test_config(vec![front]);
    config.scrape.pod_ca_bundle = Some(pki.write("pod-ca.pem", &pki.ca_pem()));
    let kvroute = Kvroute::start(config).await;
    kvroute
        .wait_for("the pod scraped over HTTPS", |s| {
            s.pods()
                .iter()
                .any(|p| p.healthy && p.metrics().is_some() && p.models.is_some())
        })
        .await;

    // Another CA's bundle: the pod's certificate is not trusted, so it never comes up.
    // (Its own front, so its scrape counters are its own.)
    let second_front = https_front(pod.addr, &pod_cert).await;
    let stranger = Pki::new("another CA");
    let mut config = test_config(vec![second_front]);
    config.scrape.pod_ca_bundle = Some(stranger.write("other-ca.pem", &stranger.ca_pem()));
    let untrusting = Kvroute::start(config).await;
    // Scrape results are only visible as counters: read them until a few have failed.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let failed = |text: &str| {
        text.lines().any(|l| {
            l.starts_with("kvroute_scrape_errors_total")
                && l.contains(&second_front.to_string())
                && l.rsplit(' ').next().and_then(|n| n.parse::<f64>().ok()) >= Some(3.0)
        })
    };
    let mut text = untrusting.metrics_text().await;
    while !failed(&text) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        text = untrusting.metrics_text().await;
    }
    assert!(failed(&text), "{text}");
    let snapshot = untrusting.store.fleet();
    assert!(
        !snapshot.snapshot().pods().iter().any(|p| p.healthy),
        "an untrusted pod is never up"
    );
}

/// Precise routing tokenizes each prompt on a pod (`POST /tokenize`): on pods that speak
/// HTTPS it does so over TLS, trusting the same bundle as the scrapes, and gets the very
/// tokens the pod gives over plain HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_are_tokenized_on_https_pods_trusting_only_the_given_ca_bundle() {
    use kvroute::tokenize::{PodTokenizer, tokenize_body};
    use kvroute_core::request::ApiKind;
    use kvroute_sim::{FleetConfig, PodConfig, SimFleet};

    let pki = Pki::new("pod CA");
    let pod_cert = pki.issue("pod", ExtendedKeyUsagePurpose::ServerAuth);
    let fleet = SimFleet::start(FleetConfig {
        model: "tls-model".into(),
        ..FleetConfig::uniform(1, PodConfig::default())
    })
    .await
    .expect("the pod starts");
    let pod = fleet.endpoints()[0];
    let front = https_front(pod, &pod_cert).await;
    let body = tokenize_body(
        ApiKind::ChatCompletions,
        br#"{"model":"tls-model","messages":[{"role":"user","content":"Which pod holds this prompt's blocks?"}]}"#,
    )
    .expect("a chat to tokenize");
    let timeout = Duration::from_secs(5);

    let plain = PodTokenizer::new(timeout, None, None)
        .tokenize(pod, body.clone())
        .await
        .expect("tokenized over plain HTTP");
    assert!(plain.len() > 8, "{plain:?}");
    let trusting = kvroute::scrape::tls_connector(&pki.write("pod-ca.pem", &pki.ca_pem()))
        .expect("the bundle loads");
    let https = PodTokenizer::new(timeout, None, Some(trusting));
    for _ in 0..2 {
        // The second time over the pooled connection.
        let tokens = https
            .tokenize(front, body.clone())
            .await
            .expect("tokenized over HTTPS");
        assert_eq!(tokens, plain);
    }

    // Another CA's bundle: the pod's certificate is refused, and the prompt is not sent.
    let stranger = Pki::new("another CA");
    let untrusting =
        kvroute::scrape::tls_connector(&stranger.write("other-ca.pem", &stranger.ca_pem()))
            .expect("the bundle loads");
    let refused = PodTokenizer::new(timeout, None, Some(untrusting))
        .tokenize(front, body.clone())
        .await
        .expect_err("an untrusted pod");
    assert_eq!(refused.kind(), "http", "{refused}");
    // Plain HTTP to the TLS port does not get an answer either.
    let plain_to_tls = PodTokenizer::new(timeout, None, None)
        .tokenize(front, body)
        .await
        .expect_err("plain text to a TLS port");
    assert_eq!(plain_to_tls.kind(), "http", "{plain_to_tls}");
    fleet.shutdown().await;
}

/// HTTPS pods end to end with precise routing: kvroute scrapes the pod and tokenizes each
/// prompt on it over TLS (`--pod-ca-bundle`) and follows its KV events (ZeroMQ, plain, as
/// vLLM publishes them); Envoy's fail-closed gateway, its pod cluster given
/// `PODS_TLS_TRANSPORT_SOCKET`, forwards each request over TLS to the pod kvroute names.
/// The second request finds the first's blocks in the events, matched on the tokens the
/// pod gave over HTTPS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_routing_reaches_https_pods_through_envoy() {
    use kvroute::kvevents::{EndpointTemplate, PrefixSource};
    use kvroute_lab::compare::{port_shift_template, with_kv_events};
    use kvroute_sim::{FleetConfig, PodConfig, SimFleet};

    let pki = Pki::new("pod CA");
    let pod_cert = pki.issue("pod", ExtendedKeyUsagePurpose::ServerAuth);
    let ca = pki.write("pod-ca.pem", &pki.ca_pem());
    let (fleet_config, _) = with_kv_events(FleetConfig {
        model: "tls-model".into(),
        speedup: 20.0,
        ..FleetConfig::uniform(1, PodConfig::default())
    })
    .expect("ports for the events");
    let events = fleet_config.pods[0].kv_events.clone().expect("events on");
    let fleet = SimFleet::start(fleet_config).await.expect("the pod starts");
    let front = https_front(fleet.endpoints()[0], &pod_cert).await;

    // The pod is known by its HTTPS address; its publishers keep their own ports.
    let port_of = |endpoint: &str| {
        endpoint
            .rsplit(':')
            .next()
            .and_then(|p| p.parse::<u16>().ok())
            .expect("a port")
    };
    let template = |to: &str| {
        EndpointTemplate::parse(&port_shift_template(front.port(), port_of(to))).expect("template")
    };
    let mut config = test_config(vec![front]);
    config.debug_decisions = 8;
    config.scrape.pod_ca_bundle = Some(ca.clone());
    config.prefix_source = PrefixSource::Auto;
    config.kv_events.endpoint = template(&events.endpoint);
    config.kv_events.replay_endpoint = Some(template(
        events.replay_endpoint.as_deref().expect("a replay socket"),
    ));
    let kvroute = Kvroute::start(config).await;
    kvroute
        .wait_for("the pod scraped over HTTPS", |s| {
            s.pod(front)
                .is_some_and(|p| p.healthy && p.metrics().is_some() && p.models.is_some())
        })
        .await;
    support::wait_for_metric(&kvroute, "kvroute_kv_event_streams", 1.0).await;

    let pod_ca: &'static str =
        Box::leak(ca.to_str().expect("UTF-8 path").to_owned().into_boxed_str());
    let envoy = Envoy::start(
        Gateway::OriginalDstToHttpsPods(pod_ca),
        kvroute.addrs.grpc,
        &[front],
    )
    .await;
    let client = support::http_client();
    let prompt: String = (0..300).map(|i| format!(" w{i}")).collect();
    for round in 0..2 {
        let response = client
            .post(envoy.url("/v1/completions"))
            .json(&serde_json::json!({"model": "tls-model", "prompt": prompt, "max_tokens": 2}))
            .send()
            .await
            .expect("Envoy answers");
        assert_eq!(response.status(), 200, "round {round}: {}", envoy.log());
        let body: serde_json::Value = response.json().await.expect("JSON");
        assert!(body["choices"][0]["text"].is_string(), "{body}");
        if round == 0 {
            // The prompt's full blocks, announced by the pod's events.
            support::wait_for_metric(&kvroute, "kvroute_kv_event_index_entries", 18.0).await;
        }
    }
    let text = kvroute.metrics_text().await;
    assert!(
        support::metric_value(
            &text,
            "kvroute_tokenize_duration_seconds_count{outcome=\"ok\",tokenizer=\"pod\"}"
        ) >= 2.0,
        "both prompts tokenized over HTTPS:\n{text}"
    );
    let decisions = support::decision_log(kvroute.addrs.debug.expect("debug pages")).await;
    let decisions = decisions.as_array().expect("a list");
    assert_eq!(decisions.len(), 2, "{decisions:#?}");
    for decision in decisions {
        assert_eq!(decision["prefix_source"], "kv_events", "{decision:#}");
    }
    let cached: Vec<u64> = decisions
        .iter()
        .map(|d| {
            d["decision"]["ranked"][0]["cached_tokens"]
                .as_u64()
                .unwrap_or(0)
        })
        .collect();
    assert!(
        cached.contains(&0) && cached.iter().any(|&c| c >= 18 * 16),
        "the first prompt found nothing cached, the second its blocks: {decisions:#?}"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_reaches_kvroute_over_mutual_tls_and_routes_as_before() {
    let pki = Pki::new("kvroute test CA");
    let server = pki.issue("kvroute", ExtendedKeyUsagePurpose::ServerAuth);
    let gateway = pki.issue("gateway", ExtendedKeyUsagePurpose::ClientAuth);
    let ca = pki.write("ca.pem", &pki.ca_pem());
    pki.write("gateway.pem", &gateway.cert_pem);
    pki.write("gateway-key.pem", &gateway.key_pem);
    let pods = [
        FakePod::start("pod-a", "llama", &[]).await,
        FakePod::start("pod-b", "llama", &[]).await,
    ];
    let mut config = test_config(pods.iter().map(|p| p.addr).collect());
    config.grpc_tls = Some(GrpcTls {
        cert: pki.write("server.pem", &server.cert_pem),
        key: pki.write("server-key.pem", &server.key_pem),
        client_ca: Some(ca),
    });
    let kvroute = Kvroute::start(config).await;
    kvroute.wait_until_current(&pods).await;
    // The test's own directory, for as long as the test runs.
    let certs: &'static str = Box::leak(
        pki.dir
            .path()
            .to_str()
            .expect("UTF-8 path")
            .to_owned()
            .into_boxed_str(),
    );
    let endpoints: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
    let envoy = Envoy::start(
        Gateway::OriginalDstOverTls(certs),
        kvroute.addrs.grpc,
        &endpoints,
    )
    .await;
    let client = support::http_client();
    let (status, pod, body) = support::complete(
        &client,
        &envoy,
        serde_json::json!({"model": "llama", "prompt": "hello", "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{body}\n{}", envoy.log());
    assert!(pod.is_some(), "served by a picked pod");
}
