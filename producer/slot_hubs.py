"""The shared reply reader on a Redis Cluster: one ReplyHub per slot (one XREAD may not cross
slots there, and a model's reply streams share its slot: the hash tag of its name), all on one
cluster client."""

from __future__ import annotations

from redis.crc import key_slot

from producer.connection import connect_async, parse
from producer.reply_hub import BLOCK_MS, Entry, ReplyHub, Subscription


def reply_hub(url: str) -> ReplyHub | SlotHubs:
    """The shared reader for the Redis at `url`: one hub, or on a cluster one per slot."""
    return SlotHubs(url) if parse(url).is_cluster else ReplyHub(url)


class SlotHubs:
    """On a Redis Cluster: one ReplyHub per slot of the keys read (a model's reply streams
    share its slot), all on one cluster client. ReplyHub's interface."""

    def __init__(self, url: str, block_ms: int = BLOCK_MS, max_connections: int = 64) -> None:
        self.url = url
        self.block_ms = block_ms
        self.conn = connect_async(url, max_connections=max_connections,
                                  socket_timeout=block_ms / 1000 + 10)
        self._hubs: dict[int, ReplyHub] = {}

    @property
    def subscriptions(self) -> int:
        return sum(hub.subscriptions for hub in self._hubs.values())

    def subscribe(self, key: str, after: str = "0-0") -> Subscription:
        slot = key_slot(key.encode())
        hub = self._hubs.get(slot)
        if hub is None:
            hub = self._hubs[slot] = ReplyHub(self.url, self.block_ms, conn=self.conn)
        sub = hub.subscribe(key, after)
        sub.home = hub
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.home.unsubscribe(sub)

    async def next(self, sub: Subscription, timeout_s: float) -> list[Entry]:
        return await sub.home.next(sub, timeout_s)

    async def close(self) -> None:
        for hub in self._hubs.values():
            await hub.close()
        await self.conn.aclose()
