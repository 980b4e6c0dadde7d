"""Prefix-cache-affinity routing for Ray Serve: requests that share a prompt prefix go to the replica that served it.

Each replica's prefix cache only helps the requests that reach it. :class:`PrefixAffinityRouter` is a Ray Serve request
router (``ray.serve.request_router.RequestRouter``, set with ``RequestRouterConfig``) that remembers, per replica,
which prompt prefixes it was sent, in chunks of ``chunk_chars`` characters keyed like the engine's blocks (each key
hashes the chunk and the key before it, so a key names the whole prefix up to it). A request goes to the replica
holding its longest prefix, unless that replica has ``imbalance`` more requests in flight than the least loaded one:
then load wins (the least loaded first, as Ray's default power-of-two-choices router would pick). A request whose
prefix nobody holds goes to the least loaded replica, the one holding fewest prefixes on a tie.

The table lives in the router (one per deployment handle, i.e. per ingress replica), is bounded (``max_chunks``,
least recently used first out) and forgets a replica that dies or leaves. Ray's own ``PrefixCacheAffinityRouter``
(``ray.serve.llm``) does the same job with a shared tree actor, but imports vLLM or SGLang, which hf_paged does not
need.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter

CHUNK_CHARS = 64  # about one 16-token block of English text
MAX_CHUNKS = 200_000
IMBALANCE = 8


def chunk_keys(text: str, chunk_chars: int = CHUNK_CHARS) -> list[bytes]:
    """Chained keys of ``text``'s full ``chunk_chars``-character chunks: key ``i`` stands for ``text[: (i + 1) *
    chunk_chars]`` (a partial last chunk has no key).

    Example::

        >>> len(chunk_keys("a" * 130, 64))
        2
    """
    keys, prev = [], b""
    for at in range(0, len(text) - chunk_chars + 1, chunk_chars):
        prev = hashlib.blake2b(prev + text[at: at + chunk_chars].encode(), digest_size=12).digest()
        keys.append(prev)
    return keys


class PrefixTable:
    """Which replicas were sent which prefixes: chunk key -> replica ids, least recently used first out.

    Example::

        table = PrefixTable(chunk_chars=4)
        table.insert("abcdefgh", "r1")
        table.match("abcdxyzw", ["r1", "r2"])   # {"r1": 1, "r2": 0}: r1 holds the first chunk
    """

    def __init__(self, chunk_chars: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS):
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()
        self.sizes: dict[str, int] = {}  # replica -> chunks it holds

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, text: str, replicas: list[str]) -> dict[str, int]:
        """For each of ``replicas``, how many leading chunks of ``text`` it was sent."""
        found = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for i, key in enumerate(chunk_keys(text, self.chunk_chars)):
            alive &= self._holders.get(key, set())
            if not alive:
                break
            self._holders.move_to_end(key)
            for replica in alive:
                found[replica] = i + 1
        return found

    def insert(self, text: str, replica: str) -> None:
        """``replica`` was sent ``text``: it holds (or is computing) all its full chunks."""
        for key in chunk_keys(text, self.chunk_chars):
            holders = self._holders.setdefault(key, set())
            self._holders.move_to_end(key)
            if replica not in holders:
                holders.add(replica)
                self.sizes[replica] = self.sizes.get(replica, 0) + 1
        while len(self._holders) > self.max_chunks:
            _, holders = self._holders.popitem(last=False)
            for r in holders:
                self.sizes[r] -= 1

    def drop(self, replica: str) -> None:
        """Forget ``replica`` (it died or left)."""
        if self.sizes.pop(replica, None) is None:
            return
        for key in [k for k, holders in self._holders.items() if replica in holders]:
            holders = self._holders[key]
            holders.discard(replica)
            if not holders:
                del self._holders[key]


def routing_text(pending_request: PendingRequest | None) -> str:
    """The text a request is routed by: the ``prompt`` attribute of its first argument that has one (the ingress
    sends a ``Forwarded`` request whose ``prompt`` is the rendered messages or prompt), else ``""``."""
    for arg in getattr(pending_request, "args", None) or ():
        prompt = getattr(arg, "prompt", None)
        if isinstance(prompt, str):
            return prompt
    return ""


class PrefixAffinityRouter(RequestRouter):
    """Routes a request to the replica holding its longest prompt prefix, or by load when that replica is busy (see
    the module's docstring). Options (``RequestRouterConfig.request_router_kwargs``): ``chunk_chars``,
    ``max_chunks``, ``imbalance`` (requests in flight beyond the least loaded replica's at which load wins).

    Example::

        from ray.serve.config import RequestRouterConfig
        config = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                     request_router_kwargs={"imbalance": 4})
        deployment = EngineReplica.options(request_router_config=config)
    """

    def initialize_state(self, chunk_chars: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS,
                         imbalance: int = IMBALANCE):
        self.table = PrefixTable(chunk_chars, max_chunks)
        self.imbalance = imbalance

    def _load(self, replica) -> int:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if queued is None else queued

    async def choose_replicas(self, candidate_replicas, pending_request: PendingRequest | None = None):
        if not candidate_replicas:
            return []
        text = routing_text(pending_request)
        load = {r.replica_id: self._load(r) for r in candidate_replicas}
        least = min(load.values())
        by_load = sorted(candidate_replicas, key=lambda r: (load[r.replica_id],
                                                            self.table.sizes.get(r.replica_id.unique_id, 0),
                                                            random.random()))
        held = self.table.match(text, [r.replica_id.unique_id for r in candidate_replicas]) if text else {}
        best = max(held.values(), default=0)
        if best == 0:  # a new prefix: the least loaded of two, as power of two choices
            return [by_load[:2]]
        holders = [r for r in by_load if held[r.replica_id.unique_id] == best]
        if load[holders[0].replica_id] - least > self.imbalance:  # its holder is busy: load wins
            return [by_load[:2]]
        return [holders[:1], [r for r in by_load if r is not holders[0]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        text = routing_text(pending_request)
        if text:
            self.table.insert(text, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.table.drop(replica_id.unique_id)

    def update_replicas(self, replicas):
        gone = {r.unique_id for r in self.curr_replicas} - {r.replica_id.unique_id for r in replicas}
        super().update_replicas(replicas)
        for unique_id in gone:
            self.table.drop(unique_id)
