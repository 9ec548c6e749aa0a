use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

/// A pod answering every GET with `body`; after `answers_per_connection` answers it closes
/// the connection (as a server's keep-alive timeout would, between requests). Counts the
/// connections it accepted.
async fn pod(body: &'static str, answers_per_connection: usize) -> (SocketAddr, Arc<AtomicUsize>) {
    let answer: &'static str = Box::leak(
        format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_boxed_str(),
    );
    pod_answering(answer, answers_per_connection, None).await
}

/// A pod answering every GET with the raw `answer`, its head included, written in
/// pieces of `piece` bytes when set; `answers_per_connection` as for [`pod`]. Also keeps
/// the last request it read.
async fn pod_answering(
    answer: &'static str,
    answers_per_connection: usize,
    piece: Option<usize>,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buffer = Vec::new();
                let mut chunk = [0u8; 1024];
                for _ in 0..answers_per_connection {
                    while !buffer.windows(4).any(|w| w == b"\r\n\r\n") {
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buffer.clear();
                    let pieces = answer
                        .as_bytes()
                        .chunks(piece.unwrap_or(answer.len()).max(1));
                    for bytes in pieces {
                        if socket.write_all(bytes).await.is_err() {
                            return;
                        }
                        let _ = socket.flush().await;
                        if piece.is_some() {
                            tokio::task::yield_now().await;
                        }
                    }
                }
                // Closes the connection, idle, between requests.
            });
        }
    });
    (addr, accepted)
}

const SECOND: Duration = Duration::from_secs(1);

/// Scrapes `addr` `times` on one client, every answer expected to be `body`.
async fn scrape_each_time(addr: SocketAddr, times: usize, body: &[u8]) {
    let mut client = PodClient::new(addr, None);
    for round in 0..times {
        let answer = client
            .get(&Uri::from_static("/metrics"), None, 1 << 20, SECOND)
            .await;
        assert_eq!(answer.expect("answer"), body, "round {round}");
    }
}

#[tokio::test]
async fn one_connection_serves_every_scrape() {
    let (addr, accepted) = pod("vllm:num_requests_running 1.0\n", usize::MAX).await;
    scrape_each_time(addr, 5, b"vllm:num_requests_running 1.0\n").await;
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_connection_the_pod_closed_while_idle_is_reopened_without_a_failure() {
    let (addr, accepted) = pod("ok", 1).await;
    let mut client = PodClient::new(addr, None);
    for round in 0..4 {
        // Lets the pod's close arrive before the next request.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let body = client
            .get(&Uri::from_static("/metrics"), None, 1 << 20, SECOND)
            .await;
        assert_eq!(body.expect("answer"), b"ok", "round {round}");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_body_over_the_limit_fails_and_the_next_scrape_starts_clean() {
    let (addr, _) = pod("0123456789", usize::MAX).await;
    let mut client = PodClient::new(addr, None);
    let error = client
        .get(&Uri::from_static("/metrics"), None, 4, SECOND)
        .await
        .expect_err("too large");
    assert!(matches!(error, ScrapeError::TooLarge(4)), "{error}");
    let body = client
        .get(&Uri::from_static("/metrics"), None, 100, SECOND)
        .await
        .expect("answer");
    assert_eq!(body, b"0123456789");
}

#[tokio::test]
async fn nothing_listening_is_a_connect_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let mut client = PodClient::new(addr, None);
    let error = client
        .get(&Uri::from_static("/metrics"), None, 100, SECOND)
        .await
        .expect_err("refused");
    assert_eq!(error.kind(), "connect", "{error}");
}

#[tokio::test]
async fn a_chunked_answer_in_small_pieces_is_read_whole_and_the_connection_kept() {
    let answer = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/plain\r\n\r\n\
                  9\r\nvllm:num_\r\n14\r\nrequests_running 1.0\r\n0\r\n\r\n";
    let (addr, accepted) = pod_answering(answer, usize::MAX, Some(7)).await;
    scrape_each_time(addr, 3, b"vllm:num_requests_running 1.0").await;
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_answer_that_closes_its_connection_is_read_and_the_next_opens_another() {
    // No length and no chunks: the body runs to the close, as HTTP/1.1 allows.
    let (addr, accepted) = pod_answering("HTTP/1.1 200 OK\r\n\r\nto the end", 1, None).await;
    scrape_each_time(addr, 2, b"to the end").await;
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    let (addr, accepted) = pod_answering(
        "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
        usize::MAX,
        None,
    )
    .await;
    let mut client = PodClient::new(addr, None);
    for _ in 0..2 {
        let body = client.get(&Uri::from_static("/m"), None, 100, SECOND).await;
        assert_eq!(body.expect("answer"), b"ok");
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "connection: close is honoured"
    );
}

/// The error of one scrape (of at most 100 bytes) of a pod answering `answer`.
async fn scrape_error(answer: &'static str) -> ScrapeError {
    let (addr, _) = pod_answering(answer, usize::MAX, None).await;
    let mut client = PodClient::new(addr, None);
    client
        .get(&Uri::from_static("/m"), None, 100, SECOND)
        .await
        .expect_err("the scrape fails")
}

#[tokio::test]
async fn an_error_status_or_a_malformed_answer_fails_the_scrape() {
    let error = scrape_error("HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n").await;
    assert!(matches!(error, ScrapeError::Status(503)), "{error}");
    let error = scrape_error("SPDY/9 what\r\n\r\n").await;
    assert_eq!(error.kind(), "http", "{error}");
    let error = scrape_error("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n400\r\n").await;
    assert!(matches!(error, ScrapeError::TooLarge(100)), "{error}");
}

#[tokio::test]
async fn the_request_names_the_pod_and_the_key_and_a_key_that_could_split_it_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut buffer = Vec::new();
        let mut chunk = [0u8; 1024];
        while !buffer.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = socket.read(&mut chunk).await.expect("read");
            buffer.extend_from_slice(&chunk[..n]);
        }
        socket
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n[]")
            .await
            .expect("write");
        String::from_utf8(buffer).expect("text")
    });
    let mut client = PodClient::new(addr, None);
    let key = ApiKey("s3cret".into());
    let body = client
        .get(&Uri::from_static("/v1/models?x=1"), Some(&key), 100, SECOND)
        .await
        .expect("answer");
    assert_eq!(body, b"[]");
    let request = seen.await.expect("the pod read a request");
    assert!(
        request.starts_with("GET /v1/models?x=1 HTTP/1.1\r\n"),
        "{request}"
    );
    assert!(
        request.contains(&format!("\r\nhost: {addr}\r\n")),
        "{request}"
    );
    assert!(
        request.contains("\r\nauthorization: Bearer s3cret\r\n"),
        "{request}"
    );
    let forged = ApiKey("k\r\nx-injected: 1".into());
    let error = client
        .get(&Uri::from_static("/v1/models"), Some(&forged), 100, SECOND)
        .await
        .expect_err("refused");
    assert!(matches!(error, ScrapeError::Request(_)), "{error}");
}
