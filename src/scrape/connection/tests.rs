use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

/// A pod answering every GET with `body`; after `answers_per_connection` answers it closes
/// the connection (as a server's keep-alive timeout would, between requests). Counts the
/// connections it accepted.
async fn pod(body: &'static str, answers_per_connection: usize) -> (SocketAddr, Arc<AtomicUsize>) {
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
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if socket.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
                // Closes the connection, idle, between requests.
            });
        }
    });
    (addr, accepted)
}

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test]
async fn one_connection_serves_every_scrape() {
    let (addr, accepted) = pod("vllm:num_requests_running 1.0\n", usize::MAX).await;
    let mut client = PodClient::new(addr, None);
    for _ in 0..5 {
        let body = client
            .get(&Uri::from_static("/metrics"), None, 1 << 20, SECOND)
            .await
            .expect("answer");
        assert_eq!(body, b"vllm:num_requests_running 1.0\n");
    }
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
        assert_eq!(body.expect("answer").as_slice(), b"ok", "round {round}");
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
