"""Prefix-aware placement of generative requests on the LLM workers of a version.

vLLM keeps the KV cache of the prompt prefixes it computed (prefix caching): a
request whose prompt starts as an earlier one did *on the same engine* skips
that part of the prefill. The version's queue group spreads requests at
random, so with N workers a shared prefix (a system prompt, a few-shot
preamble, a conversation's earlier turns) is found warm about 1/N of the time.

`PrefixTable` remembers, per version, which worker last got each block of
prompt text (`block_chars` characters, hashes chained so that a block's hash
names the whole text up to it). A request goes to the live worker holding its
longest known prefix; a prompt no worker holds goes to the worker its first
block hashes to (rendezvous hashing), so that concurrent first requests of one
prefix agree and a worker leaving moves only its own prefixes. A prompt shorter
than one block is not placed.

`PlacedForwarder` publishes a placed request on the worker's own subject
(``ib.gen.<model>.<version>.<worker>``). A worker subscribes to it only while
it has a free running slot (`inferbus_worker.llm.intake`), so a busy or gone
holder answers with nats-server's "no responders", and the request is sent on
to the version's queue group as it would have been without placement: load
still wins over cache affinity. The request is held for that one round trip
(`hold_s` at most), nothing longer.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter

from inferbus_common.bus import is_no_responders
from inferbus_common.generation import GenerationRequest
from inferbus_common.subjects import Subjects

log = logging.getLogger(__name__)

PLACEMENTS = Counter(
    "inferbus_router_prefix_placements",
    "Generative requests placed by prompt prefix, by outcome: hit (sent to the worker "
    "holding its longest known prefix), new (no worker holds it: sent to the worker its "
    "first block hashes to), fallback (that worker had no free slot or was gone: sent to "
    "the version's queue group).",
    ["model", "version", "outcome"],
)

_DIGEST = 16


def prompt_text(data: bytes) -> str:
    """The text a request's prompt token ids are made from, in order: the prompt,
    or the chat messages with their roles ('' when the body does not decode; the
    worker then answers the error)."""
    try:
        request = GenerationRequest.decode(data)
    except Exception:  # any bad body: no placement, the worker refuses it
        return ""
    if request.kind == "chat":
        return "".join(f"\x1e{m.role}\x1f{m.content}" for m in request.messages)
    return request.prompt


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request goes."""

    worker: str
    """Worker id ('' : not placed, the queue group takes it)."""
    matched_blocks: int
    """Blocks of its prompt the worker is known to hold (0 for a new prefix)."""
    outcome: str
    """``hit``, ``new`` or ``none``."""


NOT_PLACED = Placement("", 0, "none")


class PrefixTable:
    """Which worker last got each prompt block of each version (bounded, LRU).

    Args:
        block_chars: characters per block (vLLM caches whole blocks of 16 tokens;
            256 characters are a few such blocks of English text).
        max_blocks: blocks remembered over all versions; the least recently
            used are forgotten first.
    """

    def __init__(self, block_chars: int = 256, max_blocks: int = 100_000) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError("block_chars and max_blocks must be positive")
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def block_hashes(self, scope: str, text: str) -> list[bytes]:
        """Chained hashes of the whole blocks of `text` within `scope` (a version):
        the i-th names the text's first i+1 blocks."""
        size = self.block_chars
        digest = hashlib.blake2b(scope.encode(), digest_size=_DIGEST).digest()
        out: list[bytes] = []
        for start in range(0, len(text) - size + 1, size):
            block = text[start : start + size].encode("utf-8", "surrogatepass")
            digest = hashlib.blake2b(digest + block, digest_size=_DIGEST).digest()
            out.append(digest)
        return out

    def place(self, scope: str, text: str, workers: Sequence[str]) -> Placement:
        """Choose among `workers` (live, ready) for a prompt, and remember the choice."""
        hashes = self.block_hashes(scope, text)
        if not hashes or not workers:
            return NOT_PLACED
        live = set(workers)
        chosen = NOT_PLACED
        for depth in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[depth - 1])
            if owner is not None and owner in live:
                chosen = Placement(owner, depth, "hit")
                break
        if not chosen.worker:
            first = hashes[0]
            worker = max(
                workers,
                key=lambda w: hashlib.blake2b(first + w.encode(), digest_size=8).digest(),
            )
            chosen = Placement(worker, 0, "new")
        for digest in hashes:
            self._owner[digest] = chosen.worker
            self._owner.move_to_end(digest)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)
        return chosen


@dataclass(slots=True)
class _Held:
    model: str
    version: str
    data: bytes
    headers: dict[str, str]
    queue_reply: str
    at: float


class PlacedForwarder:
    """Sends placed requests to their worker; on "no responders", to the queue group.

    Args:
        nc: the router's connection.
        subjects: naming scheme.
        table: the prefix table.
        hold_s: how long a sent request is kept for its fallback (a "no
            responders" comes back within one round trip).
    """

    def __init__(
        self, nc: Client, subjects: Subjects, table: PrefixTable, hold_s: float = 10.0
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self.table = table
        self._hold_s = hold_s
        self._inbox = subjects.reply_inbox(f"router-{uuid.uuid4().hex[:12]}-placed")
        self._sub: Subscription | None = None
        self._held: OrderedDict[int, _Held] = OrderedDict()
        self._next = 0

    @property
    def holding(self) -> int:
        """Requests kept for a possible fallback now."""
        return len(self._held)

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_holder_refused)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # closing: nothing left to do
                log.debug("placed-request inbox not unsubscribed: %r", exc)
            self._sub = None
        self._held.clear()

    async def send(
        self,
        model: str,
        version: str,
        data: bytes,
        headers: dict[str, str],
        workers: Sequence[str],
        queue_reply: str,
    ) -> bool:
        """Publish to the placed worker; False when the request is not placed (the
        caller sends it to the queue group)."""
        if self._sub is None:
            return False
        placement = self.table.place(f"{model}\x00{version}", prompt_text(data), workers)
        if not placement.worker:
            return False
        self._expire()
        self._next += 1
        key = self._next
        self._held[key] = _Held(model, version, data, headers, queue_reply, time.monotonic())
        PLACEMENTS.labels(model, version, placement.outcome).inc()
        await self._nc.publish(
            self._subjects.gen_worker(model, version, placement.worker),
            data,
            reply=f"{self._inbox}.{key}",
            headers=headers,
        )
        return True

    def _expire(self) -> None:
        cutoff = time.monotonic() - self._hold_s
        while self._held:
            key, held = next(iter(self._held.items()))
            if held.at > cutoff:
                return
            del self._held[key]

    async def _on_holder_refused(self, msg: Msg) -> None:
        """The placed worker had no free slot (or is gone): on to the queue group."""
        if not is_no_responders(msg):
            return
        try:
            key = int(msg.subject.rsplit(".", 1)[-1])
        except ValueError:
            return
        held = self._held.pop(key, None)
        if held is None:
            log.warning("a placed generation request came back after %.1f s", self._hold_s)
            return
        PLACEMENTS.labels(held.model, held.version, "fallback").inc()
        await self._nc.publish(
            self._subjects.gen(held.model, held.version),
            held.data,
            reply=held.queue_reply,
            headers=held.headers,
        )
