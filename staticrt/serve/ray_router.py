"""Which replica takes a request (Ray Serve's request router, run in the ingress): the one whose
rows saw the longest prefix of its prompt, where that is at least a tenth of it; else the one that
has seen the least, the other replicas behind it in case it is full.

This is the policy of Ray's own `PrefixCacheAffinityRouter` (ray.llm), kept in the ingress's memory.
That router keeps its prefix tree in an actor of its own and reads it with a blocking `ray.get`
inside the ingress's event loop, on every request routed and every answer. The soak with replicas
killed (bench/soak_replicas.py; tiny-llama, 2 replicas, bench/results/soak-ray-kills-tiny-llama*.json)
found a routing task cancelled (a client that left), after which the tree actor waited 30 s for
the lost call's sequence number ("Timed out waiting for seq_no") and the ingress with it: answers
fell to none for 30 s and three requests got no answer within 120 s. With this router the same
soak answered throughout, every request. Here the lookup is a dictionary's, and nothing waits.

A prompt is `EngineCall.prompt`: its token ids as characters, so prefixes of characters are
prefixes of tokens. Prefixes are kept a `BLOCK` of tokens at a time, each under a hash chained
from the block before, by the last replica routed one; the oldest go past `MAX_KEYS`.

Imports Ray: only serve/ray.py names this module (Ray imports it in the ingress).
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

BLOCK = 8  # tokens a key covers: a prompt's first 8, first 16, ...
MATCH = 0.1  # a match shorter than this share of the prompt is no match (Ray's router's threshold)
MAX_KEYS = 200_000  # prefixes remembered (~20 MB), the oldest forgotten first


def prefix_keys(prompt: str) -> list[int]:
    """The keys of `prompt`'s whole blocks: key k stands for its first (k + 1) x BLOCK tokens."""
    keys, key = [], 0
    for end in range(BLOCK, len(prompt) + 1, BLOCK):
        key = hash((key, prompt[end - BLOCK : end]))
        keys.append(key)
    return keys


class PrefixRouter(RequestRouter):
    """Ray Serve's `RequestRouter` with `PrefixCacheAffinityRouter`'s policy over a local map."""

    def initialize_state(self, **_: Any) -> None:
        self.owner: OrderedDict[int, ReplicaID] = OrderedDict()  # prefix key -> replica that last saw it
        self.held: Counter[ReplicaID] = Counter()  # keys each replica owns

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ranks: the preferred replica, then up to two others (the first that has room takes it)."""
        if not candidate_replicas:
            return []
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        prompt = _prompt(pending_request)
        first = None
        for k, key in reversed(list(enumerate(prefix_keys(prompt)))):
            if (k + 1) * BLOCK < MATCH * len(prompt):
                break
            if self.owner.get(key) in by_id:
                first = by_id[self.owner[key]]
                break
        if first is None:  # no match: the replica that holds the fewest prefixes
            first = min(candidate_replicas, key=lambda replica: self.held[replica.replica_id])
        rest = [replica for replica in candidate_replicas if replica is not first]
        return [[first], random.sample(rest, min(2, len(rest)))] if rest else [[first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """The prompt's prefixes now belong to `replica_id`."""
        for key in prefix_keys(_prompt(pending_request)):
            previous = self.owner.pop(key, None)
            if previous is not None:
                self.held[previous] -= 1
            self.owner[key] = replica_id
            self.held[replica_id] += 1
        while len(self.owner) > MAX_KEYS:
            _, gone = self.owner.popitem(last=False)
            self.held[gone] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [key for key, owner in self.owner.items() if owner == replica_id]:
            del self.owner[key]
        self.held.pop(replica_id, None)


def _prompt(pending_request: PendingRequest | None) -> str:
    """The routed call's prompt (ray_ingress.py's `EngineCall`); "" for any other call."""
    args = pending_request.args if pending_request is not None else None
    return getattr(args[0], "prompt", "") if args else ""
