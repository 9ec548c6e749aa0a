"""An independent decoder of the simulator's KV cache events, for tests/kv_events.rs.

It reads them as a vLLM subscriber would (pyzmq SUB and DEALER sockets, msgpack.unpackb)
and checks them against the shapes of vLLM's `vllm/distributed/kv_events.py` (0.26 and
main): frames `[topic, seq, payload]`, the batch an array `[ts, events, data_parallel_rank]`,
each event a map tagged by `type`; replay replies `["", topic, seq, payload]` then
`["", "", -1, ""]`.

Usage: kv_events_subscriber.py CONFIG, CONFIG being JSON:
  {"topic": "kv", "pods": [{"endpoint": "tcp://127.0.0.1:P", "replay": "tcp://127.0.0.1:R"}]}
It prints "ready" once subscribed to every pod, then reads one JSON line from stdin:
  {"block_size": 16, "pods": [{"prompts": [[token ids], ...], "evicts": true}, ...]}
(each pod's prompts in the order they were sent; `evicts`: the pod must have evicted
blocks), waits until every prompt's full blocks were announced, checks everything, asks
each replay socket for everything from 0, and prints "ok" (exit 0) or the failures (exit 1).
"""

import json
import sys
import time

import msgpack
import zmq
import zmq.utils.monitor

STORED_FIELDS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
]
REMOVED_FIELDS = ["type", "block_hashes", "medium", "group_idx"]
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEADLINE_S = 30.0
BLOCK_SIZE = 16  # the expectations' block_size replaces it

failures = []


def check(condition, message):
    if not condition:
        failures.append(message)
    return condition


def connect_and_wait(sockets, endpoints):
    """Connects each SUB socket and waits until its ZMTP handshake is done, so that the
    subscription that follows reaches the publisher before the test sends requests (ZeroMQ's
    slow joiner)."""
    monitors = [s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) for s in sockets]
    for s, endpoint in zip(sockets, endpoints):
        s.connect(endpoint)
    deadline = time.time() + DEADLINE_S
    for m in monitors:
        while True:
            left = int((deadline - time.time()) * 1000)
            if left <= 0 or not m.poll(left):
                raise SystemExit("FAIL: no handshake with a publisher")
            event = zmq.utils.monitor.recv_monitor_message(m)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                break
    for s in sockets:
        s.disable_monitor()
    # The subscription message is sent right after the handshake; let the publisher read it.
    time.sleep(0.3)


class Pod:
    def __init__(self, index):
        self.index = index
        self.seqs = []
        self.payloads = {}
        self.stored = {}  # hash -> list of (parent, block tokens), one per announcement
        self.announced = {}  # hash -> announcements not yet removed
        self.removed = 0
        self.parents_of_first_blocks = []

    def apply(self, topic_expected, frames):
        if not check(len(frames) == 3, f"pod {self.index}: {len(frames)} frames"):
            return
        topic, seq_bytes, payload = frames
        check(topic == topic_expected, f"pod {self.index}: topic {topic!r}")
        check(len(seq_bytes) == 8, f"pod {self.index}: seq of {len(seq_bytes)} bytes")
        seq = int.from_bytes(seq_bytes, "big")
        check(seq == len(self.seqs), f"pod {self.index}: seq {seq} after {self.seqs[-3:]}")
        self.seqs.append(seq)
        self.payloads[seq] = payload
        batch = msgpack.unpackb(payload, raw=False)
        if not check(
            isinstance(batch, list) and len(batch) == 3,
            f"pod {self.index}: batch {str(batch)[:200]}",
        ):
            return
        ts, events, rank = batch
        check(isinstance(ts, float) and ts > 1.6e9, f"pod {self.index}: ts {ts!r}")
        check(rank == 0, f"pod {self.index}: data_parallel_rank {rank!r}")
        check(len(events) > 0, f"pod {self.index}: an empty batch")
        for event in events:
            self.apply_event(event)

    def apply_event(self, event):
        if not check(isinstance(event, dict), f"pod {self.index}: event {event!r}"):
            return
        kind = event.get("type")
        if kind == "BlockStored":
            check(list(event) == STORED_FIELDS, f"pod {self.index}: fields {list(event)}")
            hashes = event["block_hashes"]
            size = event["block_size"]
            tokens = event["token_ids"]
            check(size == BLOCK_SIZE, f"pod {self.index}: block_size {size}")
            check(len(tokens) == size * len(hashes), f"pod {self.index}: token count")
            check(event["medium"] == "GPU", f"pod {self.index}: medium {event['medium']!r}")
            check(event["lora_id"] is None and event["lora_name"] is None, "adapter fields")
            check(event["extra_keys"] == [None] * len(hashes), f"extra_keys {event['extra_keys']}")
            check(event["group_idx"] == 0, f"group_idx {event['group_idx']!r}")
            check(event["kv_cache_spec_kind"] == "full_attention", "kv_cache_spec_kind")
            parent = event["parent_block_hash"]
            self.parents_of_first_blocks.append((parent, tokens[:size]))
            for i, h in enumerate(hashes):
                check(isinstance(h, int) and 0 <= h < 2**64, f"hash {h!r}")
                block = tuple(tokens[i * size : (i + 1) * size])
                self.stored.setdefault(h, []).append((parent, block))
                self.announced[h] = self.announced.get(h, 0) + 1
                parent = h
        elif kind == "BlockRemoved":
            check(list(event) == REMOVED_FIELDS, f"pod {self.index}: fields {list(event)}")
            check(event["medium"] == "GPU", "removed medium")
            check(len(event["block_hashes"]) == 1, "one hash per BlockRemoved")
            for h in event["block_hashes"]:
                if check(self.announced.get(h, 0) > 0, f"pod {self.index}: {h} removed, never stored"):
                    self.announced[h] -= 1
                self.removed += 1
        elif kind == "AllBlocksCleared":
            check(list(event) == ["type"], f"fields {list(event)}")
            self.announced.clear()
        else:
            check(False, f"pod {self.index}: unknown event {event!r}")

    def chain(self, prompt):
        """The announced hashes of the prompt's full blocks, following parents from None;
        None where a block was never announced."""
        parent, hashes = None, []
        for k in range(len(prompt) // BLOCK_SIZE):
            block = tuple(prompt[k * BLOCK_SIZE : (k + 1) * BLOCK_SIZE])
            found = [h for h, ann in self.stored.items() if (parent, block) in ann]
            if len(found) != 1:
                hashes.append(None)
                return hashes
            parent = found[0]
            hashes.append(parent)
        return hashes


def replay(ctx, endpoint, topic_expected, pod):
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replies = []
    while True:
        if not check(dealer.poll(int(DEADLINE_S * 1000)), f"pod {pod.index}: replay timed out"):
            break
        frames = dealer.recv_multipart()
        if frames[-1] == b"" and len(frames) == 4 and frames[2] == END_SEQ:
            check(frames[:2] == [b"", b""], f"end marker {frames!r}")
            break
        if not check(len(frames) == 4, f"pod {pod.index}: replay frames {len(frames)}"):
            break
        empty, topic, seq, payload = frames
        check(empty == b"" and topic == topic_expected, f"replay envelope {frames[:2]!r}")
        replies.append((int.from_bytes(seq, "big"), payload))
    dealer.close(linger=0)
    check(
        [s for s, _ in replies] == pod.seqs,
        f"pod {pod.index}: replayed {[s for s, _ in replies]} != live {pod.seqs}",
    )
    for seq, payload in replies:
        check(payload == pod.payloads.get(seq), f"pod {pod.index}: replayed batch {seq} differs")


def main():
    global BLOCK_SIZE
    config = json.loads(sys.argv[1])
    topic = config["topic"].encode()
    ctx = zmq.Context()
    subs = []
    for p in config["pods"]:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        subs.append(sub)
    connect_and_wait(subs, [p["endpoint"] for p in config["pods"]])
    print("ready", flush=True)

    expected = json.loads(sys.stdin.readline())
    BLOCK_SIZE = expected["block_size"]
    pods = [Pod(i) for i in range(len(subs))]
    poller = zmq.Poller()
    for s in subs:
        poller.register(s, zmq.POLLIN)

    def complete():
        return all(
            None not in pod.chain(prompt)
            for pod, exp in zip(pods, expected["pods"])
            for prompt in exp["prompts"]
        )

    deadline = time.time() + DEADLINE_S
    while not complete() and time.time() < deadline:
        for sock, _ in poller.poll(100):
            i = subs.index(sock)
            pods[i].apply(topic, sock.recv_multipart())
    # Whatever else is in flight (a last eviction, a decode block).
    while True:
        ready = poller.poll(300)
        if not ready:
            break
        for sock, _ in ready:
            pods[subs.index(sock)].apply(topic, sock.recv_multipart())

    for pod, exp in zip(pods, expected["pods"]):
        chains = [pod.chain(prompt) for prompt in exp["prompts"]]
        for n, (prompt, chain) in enumerate(zip(exp["prompts"], chains)):
            check(
                None not in chain and len(chain) == len(prompt) // BLOCK_SIZE,
                f"pod {pod.index}: prompt {n} announced {chain}",
            )
        # A prompt sharing a cached prefix chains its first new block to the last shared one.
        for n in range(1, len(chains)):
            a, b = chains[n - 1], chains[n]
            shared = 0
            while shared < min(len(a), len(b)) and a[shared] == b[shared]:
                shared += 1
            if 0 < shared < len(b):
                block = tuple(exp["prompts"][n][shared * BLOCK_SIZE : (shared + 1) * BLOCK_SIZE])
                check(
                    (a[shared - 1], list(block)) in pod.parents_of_first_blocks,
                    f"pod {pod.index}: prompt {n}'s first new block is not chained to block {shared - 1}",
                )
        check(not exp["evicts"] or pod.removed > 0, f"pod {pod.index}: nothing evicted")
        # No other pod announced this pod's prompts.
        for other in pods:
            if other is not pod:
                for prompt in exp["prompts"]:
                    check(other.chain(prompt)[0] is None, f"pod {other.index} has pod {pod.index}'s prompt")

    for pod, p in zip(pods, config["pods"]):
        replay(ctx, p["replay"], topic, pod)

    summary = {
        "batches": [len(p.seqs) for p in pods],
        "stored": [sum(len(a) for a in p.stored.values()) for p in pods],
        "removed": [p.removed for p in pods],
    }
    if failures:
        print("FAIL", json.dumps(summary), *failures[:20], sep="\n", flush=True)
        return 1
    print("ok", json.dumps(summary), sep="\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
