//! One pod's event subscription: connect, catch up through the replay socket, then apply
//! live batches in sequence, repairing gaps by replay.
//!
//! Sequence numbers are the publisher's (8 bytes, big-endian, from 0 at its start). Live
//! batches from one publisher only go up, so a live number at or below the previous live
//! one means the publisher started again (the pod restarted, its cache is empty): the
//! pod's entries are dropped and the stream is followed from there. A number above the
//! expected one is a gap (the subscriber's queue overflowed, the connection blinked):
//! the replay socket is asked for the missing batches; if it no longer has them, the
//! pod's entries are dropped too, since the missed batches may have evicted any of them.
//! After a lost connection the pod may have restarted meanwhile and published past the
//! last number applied, which nothing in the stream would then tell: its entries are
//! dropped and rebuilt from the replay buffer.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::time::timeout;
use tracing::{debug, info, warn};
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use kvroute_core::kvevents::{
    Applied, EngineCounts, EventBatch, IndexSink, PodEvents, Sequence, decode_batch,
};

use super::{KvEventsConfig, PreciseIndex, TemplateError};
use crate::store::PodStore;
use crate::telemetry;

/// The replay socket's end-of-replay marker: sequence number -1.
const END_OF_REPLAY: [u8; 8] = (-1i64).to_be_bytes();

/// A replay may take this many times the connect timeout.
const REPLAY_TIMEOUTS: u32 = 5;

/// Longest pause between connection attempts to a publisher that is not there.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
enum StreamError {
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        endpoint: String,
        source: zeromq::ZmqError,
    },
    #[error("connecting to {0} timed out")]
    ConnectTimeout(String),
    #[error("the publisher went away")]
    Disconnected,
    #[error("receiving: {0}")]
    Receive(zeromq::ZmqError),
}

pub(super) struct PodSubscriber {
    endpoint: SocketAddr,
    /// The data-parallel rank followed, of `ranks`.
    rank: u32,
    ranks: u32,
    /// The pod's blocks counted over its ranks' streams, when it has several.
    counts: Option<Arc<Mutex<EngineCounts>>>,
    events: String,
    replay: Option<String>,
    topic: String,
    timeout: Duration,
    store: Arc<PodStore>,
    precise: Arc<PreciseIndex>,
    state: PodEvents,
    /// The sequence number of the last live batch (see the module docs).
    last_live: Option<u64>,
    /// The connection was lost since the entries were built (see the module docs).
    lost: bool,
}

/// What one batch's frames carry.
struct Frames {
    seq: u64,
    payload: Bytes,
}

fn frames(message: ZmqMessage) -> Option<Frames> {
    // topic, sequence, payload (the topic is the subscription's concern).
    let mut parts = message.into_vec();
    if parts.len() != 3 {
        return None;
    }
    let payload = parts.pop()?;
    let seq = <[u8; 8]>::try_from(parts.pop()?.as_ref()).ok()?;
    Some(Frames {
        seq: u64::from_be_bytes(seq),
        payload,
    })
}

impl PodSubscriber {
    pub(super) fn new(
        endpoint: SocketAddr,
        rank: u32,
        config: &KvEventsConfig,
        store: Arc<PodStore>,
        precise: Arc<PreciseIndex>,
        counts: Option<Arc<Mutex<EngineCounts>>>,
    ) -> Result<Self, TemplateError> {
        Ok(PodSubscriber {
            endpoint,
            rank,
            ranks: config.dp_ranks.max(1),
            counts,
            events: config.endpoint.resolve_rank(endpoint, rank)?,
            replay: config
                .replay_endpoint
                .as_ref()
                .map(|t| t.resolve_rank(endpoint, rank))
                .transpose()?,
            topic: config.topic.clone(),
            timeout: config.timeout,
            store,
            precise,
            state: PodEvents::new(),
            last_live: None,
            lost: false,
        })
    }

    /// Subscribes until aborted, reconnecting with backoff.
    pub(super) async fn run(mut self) {
        let mut backoff = Duration::from_millis(250);
        loop {
            let outcome = self.follow().await;
            self.precise
                .set_rank_streaming(self.endpoint, self.rank, self.ranks, false);
            match outcome {
                Err(StreamError::Disconnected) => {
                    info!(pod = %self.endpoint, "KV event stream lost; reconnecting");
                    self.lost = true;
                    backoff = Duration::from_millis(250);
                }
                Err(error) => debug!(pod = %self.endpoint, %error, "no KV event stream"),
                Ok(()) => {}
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One connection: catch up, then follow the live stream until it breaks.
    async fn follow(&mut self) -> Result<(), StreamError> {
        let mut options = SocketOptions::default();
        options.connect_timeout(self.timeout);
        let mut sub = SubSocket::with_options(options);
        let mut monitor = sub.monitor();
        match timeout(self.timeout, sub.connect(&self.events)).await {
            Ok(Ok(())) => {}
            Ok(Err(source)) => {
                return Err(StreamError::Connect {
                    endpoint: self.events.clone(),
                    source,
                });
            }
            Err(_) => return Err(StreamError::ConnectTimeout(self.events.clone())),
        }
        sub.subscribe(&self.topic)
            .await
            .map_err(StreamError::Receive)?;
        if std::mem::take(&mut self.lost) {
            self.reset();
            self.last_live = None;
        }
        // The event index keeps blocks only for pods of a snapshot it follows: a batch
        // applied before the store has published this pod would be dropped, its sequence
        // number taken and never replayed (seen as a new subscriber's first blocks missing
        // for good when the machine was busy).
        self.wait_until_published().await;
        // What was published before this connection: everything the replay buffer still
        // has after the last batch applied (from the start for a new subscriber).
        self.catch_up(self.state.next_seq().unwrap_or(0)).await;
        self.precise
            .set_rank_streaming(self.endpoint, self.rank, self.ranks, true);
        info!(pod = %self.endpoint, events = %self.events, "following KV events");
        loop {
            tokio::select! {
                message = sub.recv() => {
                    let message = message.map_err(StreamError::Receive)?;
                    match frames(message) {
                        Some(frames) => self.live(frames).await,
                        None => telemetry::record_kv_batch("malformed"),
                    }
                }
                event = monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) | None => {
                        return Err(StreamError::Disconnected);
                    }
                    Some(_) => {}
                },
            }
        }
    }

    /// Waits until the store's published fleet holds this pod: at once, but for a pod
    /// just discovered, which the store publishes within milliseconds.
    async fn wait_until_published(&self) {
        let endpoint = self.endpoint;
        let mut fleets = self.store.subscribe();
        // An error means the store is gone, and with it anything to wait for.
        let _ = fleets.wait_for(|fleet| fleet.pod(endpoint).is_some()).await;
    }

    /// A batch from the live stream.
    async fn live(&mut self, frames: Frames) {
        if self.last_live.is_some_and(|last| frames.seq <= last) {
            info!(pod = %self.endpoint, seq = frames.seq, "KV event publisher restarted");
            self.reset();
        }
        self.last_live = Some(frames.seq);
        if let Sequence::Gap { missing_from } = self.state.sequence(frames.seq) {
            telemetry::record_kv_gap();
            self.catch_up(missing_from).await;
            if matches!(self.state.sequence(frames.seq), Sequence::Gap { .. }) {
                // The replay could not fill the gap: the missed batches may have evicted
                // anything, so start over from this batch.
                warn!(pod = %self.endpoint, missing_from, seq = frames.seq, "KV event gap not repaired; the pod's entries are rebuilt");
                self.start_over(frames.seq);
            }
        }
        self.offer(frames);
    }

    /// Applies a batch if it is the next one; counts it either way.
    fn offer(&mut self, frames: Frames) {
        match self.state.sequence(frames.seq) {
            Sequence::Seen => telemetry::record_kv_batch("seen"),
            Sequence::Gap { .. } => telemetry::record_kv_batch("out_of_order"),
            Sequence::Next => match decode_batch(&frames.payload) {
                Ok(batch) => {
                    let applied = self.apply(frames.seq, &batch);
                    telemetry::record_kv_batch("applied");
                    telemetry::record_kv_blocks(&applied);
                }
                Err(error) => {
                    // Skipped, not applied: the next batch will read as a gap, and the
                    // replay will not decode either, so the pod's entries get rebuilt.
                    debug!(pod = %self.endpoint, %error, "undecodable KV event batch");
                    telemetry::record_kv_batch("undecodable");
                }
            },
        }
    }

    fn apply(&mut self, seq: u64, batch: &EventBatch) -> Applied {
        let fleet = self.store.fleet();
        let index = self.precise.index();
        // The index takes blocks only for pods of a snapshot it follows.
        index.follow(fleet.snapshot());
        let capacity = fleet
            .pod(self.endpoint)
            .and_then(|(pod, _)| pod.signals())
            .map_or(0, |s| s.kv_capacity_tokens);
        let sink = IndexSink {
            index,
            endpoint: self.endpoint,
            capacity_tokens: capacity,
        };
        match &self.counts {
            Some(counts) => {
                let mut counts = counts.lock().unwrap_or_else(|p| p.into_inner());
                self.state.apply(seq, batch, &mut counts.sink(sink))
            }
            None => self.state.apply(seq, batch, &mut { sink }),
        }
    }

    /// Takes batch `seq` as the next one, the batches before it being lost: what the pod
    /// held by the earlier ones is dropped (nothing, for a subscriber that applied none).
    fn start_over(&mut self, seq: u64) {
        if self.state.next_seq().is_some() || self.state.held() > 0 {
            self.reset();
        }
        self.state.rebase(seq);
    }

    fn reset(&mut self) {
        let sink = IndexSink {
            index: self.precise.index(),
            endpoint: self.endpoint,
            capacity_tokens: 0,
        };
        let dropped = match &self.counts {
            Some(counts) => {
                let mut counts = counts.lock().unwrap_or_else(|p| p.into_inner());
                self.state.reset(&mut counts.sink(sink))
            }
            None => self.state.reset(&mut { sink }),
        };
        telemetry::record_kv_reset(dropped);
    }

    /// Asks the replay socket for every batch from `from` on and applies those that come
    /// next in sequence. Without a replay socket, or when it does not answer in time,
    /// nothing happens (the caller sees the gap remain).
    async fn catch_up(&mut self, from: u64) {
        let Some(replay) = self.replay.clone() else {
            return;
        };
        // A replay may carry the publisher's whole buffer (10,000 batches by default).
        let result = timeout(
            self.timeout * REPLAY_TIMEOUTS,
            self.replay_from(&replay, from),
        )
        .await;
        let outcome = match result {
            Ok(Ok(batches)) => {
                let count = batches.len();
                // The buffer may begin after `from` (it keeps the last batches only):
                // what came before is lost, so start over from its first batch.
                if let Some(first) = batches.first()
                    && matches!(self.state.sequence(first.seq), Sequence::Gap { .. })
                {
                    self.start_over(first.seq);
                }
                for frames in batches {
                    self.offer(frames);
                }
                debug!(pod = %self.endpoint, from, count, "KV events replayed");
                "answered"
            }
            Ok(Err(error)) => {
                debug!(pod = %self.endpoint, %error, "KV event replay failed");
                "failed"
            }
            Err(_) => "timeout",
        };
        telemetry::record_kv_replay(outcome);
    }

    /// The batches the replay socket sends for `from`, up to its end marker.
    async fn replay_from(&self, replay: &str, from: u64) -> Result<Vec<Frames>, zeromq::ZmqError> {
        let mut dealer = DealerSocket::new();
        dealer.connect(replay).await?;
        // The ROUTER prepends the dealer's identity; vLLM expects [identity, "", start].
        let request = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .map_err(|_| zeromq::ZmqError::Socket("empty replay request"))?;
        dealer.send(request).await?;
        let mut batches = Vec::new();
        loop {
            // vLLM before 0.26: ["", seq, payload]; since: ["", topic, seq, payload], and
            // the end marker ["", "", -1, ""].
            let mut parts = dealer.recv().await?.into_vec();
            if !(3..=4).contains(&parts.len()) {
                continue;
            }
            let payload = parts.pop().unwrap_or_default();
            let Some(seq) = parts
                .pop()
                .and_then(|s| <[u8; 8]>::try_from(s.as_ref()).ok())
            else {
                continue;
            };
            if seq == END_OF_REPLAY {
                return Ok(batches);
            }
            batches.push(Frames {
                seq: u64::from_be_bytes(seq),
                payload,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use kvroute_core::fleet::HealthPolicy;
    use kvroute_core::kvevents::{BlockStored, KvEvent};

    use super::*;

    /// One batch storing `blocks` consecutive blocks of 16 tokens from hash `first` on.
    fn stored(first: u64, blocks: u64) -> EventBatch {
        let tokens = u32::try_from(blocks * 16).expect("small");
        EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: (first..first + blocks).collect(),
                token_ids: (0..tokens).collect(),
                block_size: 16,
                ..BlockStored::default()
            })],
            data_parallel_rank: None,
        }
    }

    /// The event index keeps blocks only for pods of a snapshot it follows: a batch applied
    /// before the store publishes its pod is lost with its sequence number. So a
    /// subscriber waits for the publish before it catches up (a busy CI machine once ran
    /// the replay first, and the pod's first blocks never reached the index).
    #[tokio::test(start_paused = true)]
    async fn a_subscriber_waits_until_the_store_has_published_its_pod() {
        let pod = SocketAddr::from(([127, 0, 0, 1], 8000));
        let store = Arc::new(PodStore::new(HealthPolicy::default()));
        store.set_endpoints(&[pod]);
        let precise = Arc::new(PreciseIndex::with_budget(1 << 20));
        let config = KvEventsConfig::default();
        let mut subscriber = PodSubscriber::new(
            pod,
            0,
            &config,
            Arc::clone(&store),
            Arc::clone(&precise),
            None,
        )
        .expect("valid templates");

        // What applying before the publish does: the blocks are dropped.
        subscriber.apply(0, &stored(100, 4));
        assert_eq!(precise.index().entries(), 0);

        // The wait holds while the pod is unpublished (the paused clock runs the minute
        // out at once) and ends with the publish.
        let minute = Duration::from_secs(60);
        assert!(
            timeout(minute, subscriber.wait_until_published())
                .await
                .is_err()
        );
        store.publish(Instant::now());
        timeout(minute, subscriber.wait_until_published())
            .await
            .expect("the pod is published");
        subscriber.apply(1, &stored(200, 4));
        assert_eq!(precise.index().entries(), 4);
    }
}
