//! One pod's ZeroMQ publisher, as vLLM's `ZmqEventPublisher`: a PUB socket sends each batch
//! as `[topic, seq, payload]` (`seq` an 8-byte big-endian count from 0, `payload` the
//! msgpack of [`super::wire`]); a ROUTER socket answers `[identity, "", start]` (start an
//! 8-byte big-endian sequence number) with every buffered batch numbered `start` or later,
//! `[identity, "", topic, seq, payload]` each (the topic frame since
//! vllm-project/vllm#45177), then `[identity, "", "", -1, ""]`; the last `buffer_steps`
//! batches are kept for it.
//!
//! The engine hands batches over through a bounded queue ([`KvEventSink::publish`] never
//! waits): a full queue drops the batch and counts it. Encoding and sending happen in one
//! task, replay in another, so a replay streaming thousands of batches to a slow client never
//! holds up publishing. Like ZeroMQ's PUB, the socket drops what no subscriber is there to
//! take.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

// The `bytes` crate's Bytes (ZeroMQ's frame type), re-exported by axum.
use axum::body::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::config::{KvEventsConfig, PubTarget};
use super::wire;
use crate::engine::KvEventBatch;

/// The replay socket's end-of-replay sequence number.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// How long one attempt to connect a PUB socket to its subscriber may take.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(1);

/// The pause between two attempts.
const CONNECT_BACKOFF: Duration = Duration::from_millis(200);

/// Why a publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    /// The endpoints do not resolve for this pod.
    #[error(transparent)]
    Config(#[from] super::KvEventsError),
    /// A socket could not bind its address.
    #[error("cannot bind {what} tcp://{addr}: {source}")]
    Bind {
        /// `endpoint` or `replay_endpoint`.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// ZeroMQ refused the bound listener.
    #[error("{what}: {source}")]
    Zmq {
        /// `endpoint` or `replay_endpoint`.
        what: &'static str,
        /// Why.
        source: zeromq::ZmqError,
    },
}

/// What a publisher has done, for `/metrics`.
#[derive(Debug, Default)]
pub struct PublisherCounts {
    /// Batches sent on the PUB socket (and kept for replay).
    pub published: AtomicU64,
    /// Batches dropped because the queue to the publisher was full.
    pub dropped: AtomicU64,
}

/// The engine's side of a pod's publisher.
#[derive(Debug)]
pub struct KvEventSink {
    queue: mpsc::Sender<KvEventBatch>,
    counts: Arc<PublisherCounts>,
    /// Where the PUB socket is: `tcp://ADDR:PORT` bound (the port resolved) or connected to.
    pub endpoint: String,
    /// Where the replay socket is bound, if there is one.
    pub replay_endpoint: Option<String>,
    /// The configured topic.
    pub topic: String,
}

impl KvEventSink {
    /// Hands a step's batch to the publisher; drops and counts it if the queue is full.
    pub fn publish(&self, batch: KvEventBatch) {
        if self.queue.try_send(batch).is_err() {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What the publisher has done so far.
    pub fn counts(&self) -> &PublisherCounts {
        &self.counts
    }
}

/// The publisher's tasks: publishing ends once its [`KvEventSink`] is dropped and the queue
/// is drained, replay on shutdown.
#[derive(Debug)]
pub struct PublisherTasks {
    publish: JoinHandle<()>,
    replay: Option<JoinHandle<()>>,
}

impl PublisherTasks {
    /// Waits for both tasks to end.
    pub async fn join(self) {
        let _ = self.publish.await;
        if let Some(replay) = self.replay {
            let _ = replay.await;
        }
    }
}

/// The batches kept for replay, oldest first.
#[derive(Debug)]
struct ReplayBuffer {
    capacity: usize,
    batches: VecDeque<(u64, Bytes)>,
}

impl ReplayBuffer {
    fn push(&mut self, seq: u64, payload: Bytes) {
        if self.capacity == 0 {
            return;
        }
        if self.batches.len() == self.capacity {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    fn from(&self, start: u64) -> Vec<(u64, Bytes)> {
        self.batches
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect()
    }
}

type SharedBuffer = Arc<Mutex<ReplayBuffer>>;

fn lock(buffer: &SharedBuffer) -> MutexGuard<'_, ReplayBuffer> {
    buffer.lock().unwrap_or_else(|p| p.into_inner())
}

/// Binds pod `pod`'s sockets (its index in this process offsets the ports) and starts its
/// tasks. `epoch_unix` is the Unix time of simulated time zero (a batch's `ts` is
/// `epoch_unix + at`); `shutdown` ends the replay task.
pub async fn start(
    config: &KvEventsConfig,
    pod: usize,
    epoch_unix: f64,
    shutdown: watch::Receiver<bool>,
) -> Result<(KvEventSink, PublisherTasks), PublisherError> {
    let endpoints = config.endpoints_for(pod)?;
    let mut socket = PubSocket::new();
    let (endpoint, connect_to) = match &endpoints.publish {
        PubTarget::Bind(addr) => {
            let bound = bind(&mut socket, "endpoint", *addr).await?;
            (format!("tcp://{bound}"), None)
        }
        PubTarget::Connect(target) => (target.clone(), Some(target.clone())),
    };
    let topic = Bytes::from(config.topic.clone().into_bytes());
    let buffer: SharedBuffer = Arc::new(Mutex::new(ReplayBuffer {
        capacity: config.buffer_steps,
        batches: VecDeque::new(),
    }));
    let (replay_endpoint, replay) = match endpoints.replay {
        Some(addr) => {
            let mut router = RouterSocket::new();
            let bound = bind(&mut router, "replay_endpoint", addr).await?;
            let task = tokio::spawn(serve_replay(
                router,
                buffer.clone(),
                topic.clone(),
                shutdown,
            ));
            (Some(format!("tcp://{bound}")), Some(task))
        }
        None => (None, None),
    };
    // Python's Queue(maxsize=0) is unbounded; tokio's largest bound is as good.
    let capacity = match config.max_queue_size {
        0 => tokio::sync::Semaphore::MAX_PERMITS,
        n => n.min(tokio::sync::Semaphore::MAX_PERMITS),
    };
    let (queue, batches) = mpsc::channel(capacity);
    let counts = Arc::new(PublisherCounts::default());
    let publish = tokio::spawn(publish(Publishing {
        socket,
        connect_to,
        batches,
        topic,
        buffer,
        counts: counts.clone(),
        epoch_unix,
    }));
    let sink = KvEventSink {
        queue,
        counts,
        endpoint,
        replay_endpoint,
        topic: config.topic.clone(),
    };
    Ok((sink, PublisherTasks { publish, replay }))
}

/// Binds `addr` (port 0: an ephemeral port) with a std listener first, so a port in use is
/// reported as the OS says it; returns the bound address.
async fn bind<S: Socket>(
    socket: &mut S,
    what: &'static str,
    addr: SocketAddr,
) -> Result<SocketAddr, PublisherError> {
    let listener = std::net::TcpListener::bind(addr).map_err(|source| PublisherError::Bind {
        what,
        addr,
        source,
    })?;
    let bound = listener
        .local_addr()
        .map_err(|source| PublisherError::Bind { what, addr, source })?;
    socket
        .bind_listener(listener)
        .await
        .map_err(|source| PublisherError::Zmq { what, source })?;
    Ok(bound)
}

struct Publishing {
    socket: PubSocket,
    connect_to: Option<String>,
    batches: mpsc::Receiver<KvEventBatch>,
    topic: Bytes,
    buffer: SharedBuffer,
    counts: Arc<PublisherCounts>,
    epoch_unix: f64,
}

/// Numbers, encodes, sends and keeps each batch until the sink is dropped.
async fn publish(mut p: Publishing) {
    if let Some(target) = &p.connect_to {
        // vLLM's PUB connects to an endpoint without a wildcard; batches wait in the queue
        // (and beyond it are dropped) until the subscriber that binds it is there.
        // Short attempts, so that a shutdown is not held up by one.
        loop {
            let attempt = tokio::time::timeout(CONNECT_ATTEMPT, p.socket.connect(target));
            if matches!(attempt.await, Ok(Ok(()))) {
                break;
            }
            if p.batches.is_closed() {
                return;
            }
            tokio::time::sleep(CONNECT_BACKOFF).await;
        }
    }
    let mut seq: u64 = 0;
    while let Some(batch) = p.batches.recv().await {
        let ts = p.epoch_unix + batch.at.as_secs_f64();
        let payload = match wire::encode_batch(&batch, ts, 0) {
            Ok(bytes) => Bytes::from(bytes),
            Err(_) => {
                p.counts.dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        let frames = vec![
            p.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        if let Ok(message) = ZmqMessage::try_from(frames) {
            // Like ZeroMQ's PUB, the socket drops a message no subscriber can take; the
            // replay buffer still has it.
            let _ = p.socket.send(message).await;
        }
        lock(&p.buffer).push(seq, payload);
        p.counts.published.fetch_add(1, Ordering::Relaxed);
        seq += 1;
    }
}

/// Answers replay requests until shutdown.
async fn serve_replay(
    mut router: RouterSocket,
    buffer: SharedBuffer,
    topic: Bytes,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let request = tokio::select! {
            request = router.recv() => request,
            _ = shutdown.changed() => return,
        };
        let Ok(request) = request else { continue };
        let frames = request.into_vec();
        // vLLM answers only [identity, "", start] and ignores anything else.
        let [identity, _, start] = frames.as_slice() else {
            continue;
        };
        let batches = lock(&buffer).from(start_seq(start));
        for (seq, payload) in batches {
            let reply = vec![
                identity.clone(),
                Bytes::new(),
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if send(&mut router, reply).await.is_err() {
                break;
            }
        }
        let end = vec![
            identity.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&END_SEQ),
            Bytes::new(),
        ];
        let _ = send(&mut router, end).await;
    }
}

async fn send(router: &mut RouterSocket, frames: Vec<Bytes>) -> Result<(), zeromq::ZmqError> {
    let message = ZmqMessage::try_from(frames).map_err(|_| zeromq::ZmqError::NoMessage)?;
    router.send(message).await
}

/// The start of a replay request: an unsigned big-endian integer of any length (vLLM's
/// `int.from_bytes(start, "big")`); one beyond 64 bits is past every batch.
fn start_seq(bytes: &[u8]) -> u64 {
    let significant = bytes.iter().skip_while(|b| **b == 0).count();
    if significant > 8 {
        return u64::MAX;
    }
    bytes.iter().fold(0u64, |n, b| (n << 8) | u64::from(*b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::KvCacheEvent;

    #[tokio::test]
    async fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let config = KvEventsConfig {
            enable_kv_cache_events: true,
            endpoint: "tcp://*:0".into(),
            max_queue_size: 2,
            ..KvEventsConfig::default()
        };
        let (_stop, shutdown) = watch::channel(false);
        let (sink, tasks) = start(&config, 0, 0.0, shutdown).await.expect("binds");
        let batch = KvEventBatch {
            at: Duration::ZERO,
            events: vec![KvCacheEvent::AllBlocksCleared],
        };
        // This test's runtime runs one task at a time: the publisher cannot drain in between.
        for _ in 0..5 {
            sink.publish(batch.clone());
        }
        assert_eq!(sink.counts().dropped.load(Ordering::Relaxed), 3);
        let counts = sink.counts.clone();
        drop(sink);
        tasks.join().await;
        assert_eq!(
            counts.published.load(Ordering::Relaxed),
            2,
            "the queued ones go out"
        );
    }

    #[test]
    fn a_replay_start_is_read_as_pythons_int_from_bytes() {
        assert_eq!(start_seq(&7u64.to_be_bytes()), 7);
        assert_eq!(start_seq(&[0x01, 0x00]), 256);
        assert_eq!(start_seq(&[]), 0);
        assert_eq!(start_seq(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 5]), 5);
        assert_eq!(start_seq(&[1, 0, 0, 0, 0, 0, 0, 0, 0]), u64::MAX);
    }

    #[test]
    fn the_replay_buffer_keeps_the_last_batches_and_answers_from_a_start() {
        let mut buffer = ReplayBuffer {
            capacity: 3,
            batches: VecDeque::new(),
        };
        for seq in 0..5u64 {
            buffer.push(seq, Bytes::from(vec![seq as u8]));
        }
        let seqs = |from: u64| -> Vec<u64> { buffer.from(from).iter().map(|(s, _)| *s).collect() };
        assert_eq!(seqs(0), [2, 3, 4]);
        assert_eq!(seqs(3), [3, 4]);
        assert!(seqs(5).is_empty());
        let mut none = ReplayBuffer {
            capacity: 0,
            batches: VecDeque::new(),
        };
        none.push(0, Bytes::new());
        assert!(none.from(0).is_empty());
    }
}
