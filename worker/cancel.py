"""The cancel listener: job ids published on <prefix>:cancel, handed to the loop via a queue.

Pub/sub can miss a message (a reconnect); the loop also sweeps the cancel keys of its running
jobs every cancel_poll_interval, so a cancel is never lost, only sometimes a little later.
"""

from __future__ import annotations

import logging
import queue
import threading

import redis

log = logging.getLogger("genq.worker")


class CancelListener(threading.Thread):
    def __init__(self, url: str, channel: str) -> None:
        super().__init__(name="genq-cancel", daemon=True)
        self.url = url
        self.channel = channel
        self.cancelled: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._halt = threading.Event()

    def run(self) -> None:
        backoff = 0.05
        while not self._halt.is_set():
            conn = redis.Redis.from_url(self.url, protocol=2, socket_timeout=10,
                                        socket_connect_timeout=5)
            try:
                pubsub = conn.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                backoff = 0.05
                while not self._halt.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message and message["type"] == "message":
                        data = message["data"]
                        self.cancelled.put(data.decode(errors="replace")
                                           if isinstance(data, bytes) else str(data))
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("cancel listener lost Redis (%s); reconnecting", exc)
                self._halt.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                conn.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
