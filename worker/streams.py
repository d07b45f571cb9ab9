"""The job streams one worker reads, and the refs that name an entry across them.

A worker reads every priority lane of its model (producer/lanes.py). Entry ids are unique only
within one stream, so inside the worker an entry is named by a ref: its id alone in the first
stream (the default lane: a plain deployment's names are unchanged), "<stream index>/<id>" in the
others. The ref is the held-job key and the engine request id; the writer turns it back into
(stream, id) for the fenced scripts, which each touch the one stream (and slot) of their entries.
"""

from __future__ import annotations

from typing import NamedTuple

from producer.lanes import URGENCY, lane_keys
from producer.protocol import Keys


class JobStream(NamedTuple):
    """One stream's keys as its fenced writes need them (all in the stream's slot)."""

    jobs: str
    dead: str  # the model's dead-letter stream (its lanes share it)
    fence: str | None  # this worker's fence counter (None: a writer that checks every write)


class WorkerKeys:
    """Which keys this worker uses: one owner for "the served model's keys"."""

    def __init__(self, keys: Keys, model: str, me: str) -> None:
        self.keys = keys
        self.model = model
        self.me = me
        self.streams = [JobStream(jobs, keys.dead(model), keys.fence(model, me))
                        for jobs in lane_keys(keys, model)]
        self.read_order = list(URGENCY)  # stream indexes, most urgent first

    @property
    def jobs(self) -> list[str]:
        return [s.jobs for s in self.streams]

    @property
    def heartbeat(self) -> str:
        return self.keys.worker(self.model, self.me)

    @property
    def cancel_channel(self) -> str:
        return self.keys.cancel_channel(self.model)


def ref(stream: int, entry_id: str) -> str:
    return entry_id if stream == 0 else f"{stream}/{entry_id}"


def split_ref(entry_ref: str) -> tuple[int, str]:
    """(stream index, entry id) of a ref (Redis entry ids hold no '/')."""
    stream, sep, entry_id = entry_ref.partition("/")
    return (int(stream), entry_id) if sep else (0, entry_ref)
