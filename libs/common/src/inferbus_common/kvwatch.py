"""Reading a KV bucket from its start: when a watcher's initial values are all in.

Used by the `Catalog` (`inferbus_common.catalog`) and by registry loops that
watch a bucket themselves.
"""

from __future__ import annotations

from nats.js.kv import KeyValue


class InitialValues:
    """Tells when a KV watcher has delivered every value its bucket held when it started.

    Not nats-py's ``None`` marker alone: the watcher sends it when a consumer-info
    reply says nothing is pending and nothing was received yet, and that reply
    can overtake the entries the server already sent. A worker that trusted it
    saw an empty pool, admitted itself over the quota and started loading.
    Here the initial values are in once the entry at the bucket's last revision
    before the watch (or a later one) has arrived, or the consumer has nothing
    pending; for an empty bucket the marker is enough.

    Use `watch` to open the watcher, then feed every item it yields to `see`.
    """

    __slots__ = ("done", "upto")

    def __init__(self, upto: int) -> None:
        self.upto = upto
        """The bucket's last revision (stream sequence) just before the watch."""
        self.done = False

    @classmethod
    async def watch(cls, kv: KeyValue) -> tuple[KeyValue.KeyWatcher, InitialValues]:
        """Watch every key of `kv` (deletes included) and track its initial values."""
        upto = (await kv.status()).stream_info.state.last_seq
        return await kv.watchall(), cls(upto)

    def see(self, entry: KeyValue.Entry | None) -> bool:
        """Account for one item from the watcher; True once the initial values are in."""
        if not self.done:
            if entry is None:
                self.done = self.upto == 0
            else:
                self.done = (entry.revision or 0) >= self.upto or entry.delta == 0
        return self.done
