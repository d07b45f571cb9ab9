"""The job streams one worker reads, and the refs that name an entry across them.

A worker reads every priority lane (producer/lanes.py) of every shard (producer/shards.py) of
its model: stream index = shard * 3 + lane. Entry ids are unique only within one stream, so
inside the worker an entry is named by a ref: its id alone in the first stream (shard 0's
default lane: a plain deployment's names are unchanged), "<stream index>/<id>" in the others.
The ref is the held-job key and the engine request id; the writer turns it back into (stream, id)
for the fenced scripts, which each touch the one stream (and slot) of their entries.
"""

from __future__ import annotations

from typing import NamedTuple

from producer.lanes import LANES, URGENCY, lane_keys
from producer.protocol import Keys


class JobStream(NamedTuple):
    """One stream's keys as its fenced writes need them (all in the stream's slot)."""

    jobs: str
    dead: str  # the model's dead-letter stream (its lanes share it)
    fence: str | None  # this worker's fence counter (None: a writer that checks every write)


class WorkerKeys:
    """Which keys this worker uses: one owner for "the served model's keys"."""

    def __init__(self, keys: Keys, model: str, me: str, shards: int = 1) -> None:
        self.keys = keys
        self.model = model
        self.me = me
        self.shards = shards
        self.streams = [JobStream(jobs, keys.dead(model, shard), keys.fence(model, me, shard))
                        for shard in range(shards) for jobs in lane_keys(keys, model, shard)]
        # Per shard (one slot: one read script), its stream indexes, most urgent first.
        self.read_order = [[shard * len(LANES) + lane for lane in URGENCY]
                           for shard in range(shards)]

    def shard_of(self, stream: int) -> int:
        return stream // len(LANES)

    @property
    def jobs(self) -> list[str]:
        return [s.jobs for s in self.streams]

    @property
    def heartbeat(self) -> str:
        return self.keys.worker(self.model, self.me)

    @property
    def shard_heartbeats(self) -> list[tuple[str, str]]:
        """(heartbeat key, registry set) of this worker in shards 1.. (a shard's reclaim looks
        for the heartbeats of its consumers in its own slot)."""
        return [(self.keys.worker(self.model, self.me, shard), self.keys.workers(self.model, shard))
                for shard in range(1, self.shards)]

    @property
    def cancel_channel(self) -> str:
        return self.keys.cancel_channel(self.model)


def ref(stream: int, entry_id: str) -> str:
    return entry_id if stream == 0 else f"{stream}/{entry_id}"


def split_ref(entry_ref: str) -> tuple[int, str]:
    """(stream index, entry id) of a ref (Redis entry ids hold no '/')."""
    stream, sep, entry_id = entry_ref.partition("/")
    return (int(stream), entry_id) if sep else (0, entry_ref)
