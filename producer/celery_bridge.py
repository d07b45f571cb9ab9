"""`genq celery-bridge`: Celery apps submit genq jobs without knowing genq.

    genq celery-bridge --broker redis://127.0.0.1:6379/0 --redis redis://127.0.0.1:6379/0

An app on Celery with a Redis broker calls

    result = app.send_task("genq.generate",
                           kwargs={"prompt": "def main(", "model": "tiny", "params": {...}})
    result.get()  # the same dict as Job.result(); a failed job raises with the job's message

The bridge is a Celery worker (thread pool) whose one task, `genq.generate`, submits the job to
genq and waits for its result, which Celery writes into its result backend. The genq job id is the
Celery task id, so a task redelivered after a bridge crash (acks are late) attaches to the job
that is already running instead of running it twice. Only json and msgpack are accepted: never
pickle.

Priority: Celery's `priority` option (`send_task(..., priority=p)`) becomes the job's priority.
With the Redis broker, Celery's 0 is its most urgent, as genq's lower value runs sooner, so the
number passes through unchanged. A `priority` in the task's kwargs wins over the option.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

from celery import Celery

from producer.client import Client
from producer.errors import JobError
from producer.events import DoneEvent
from producer.flags import DefaultsHelpFormatter, add_redis_args
from producer.protocol import DEFAULT_PREFIX, ProtocolError

TASK_NAME = "genq.generate"
ACCEPT_CONTENT = ["json", "msgpack"]


class GenqJobFailed(Exception):
    """A genq job ended with an error (or could not be submitted); the message says why."""


def create_app(broker: str, redis_url: str, *, backend: str | None = None,
               queue: str = "celery", prefix: str = DEFAULT_PREFIX, timeout: float = 600.0,
               result_serializer: str = "json",
               visibility_timeout: float | None = None) -> Celery:
    """The bridge's Celery app. Apps read results with their `result_serializer`, which must be
    this one (Celery's Redis backend stores no content type)."""
    if result_serializer not in ACCEPT_CONTENT:
        raise ValueError(f"result serializer must be one of {ACCEPT_CONTENT}, "
                         f"got {result_serializer!r}")
    app = Celery("genq_bridge", broker=broker, backend=backend or broker)
    app.conf.update(
        task_serializer="json", result_serializer=result_serializer,
        accept_content=ACCEPT_CONTENT,
        result_accept_content=ACCEPT_CONTENT, task_default_queue=queue,
        task_acks_late=True, worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True, result_extended=False)
    if visibility_timeout is not None:
        # A task a dead bridge took is handed out again after this many seconds; a live bridge's
        # long task may be handed out twice too, which is harmless: both attach to one job.
        app.conf.broker_transport_options = {
            "visibility_timeout": visibility_timeout,
            "unacked_restore_interval": max(1, int(visibility_timeout // 2)),
            "unacked_restore_throttle": 1}
    client = Client(redis_url, prefix=prefix)

    @app.task(name=TASK_NAME, bind=True)  # type: ignore[untyped-decorator]
    def generate(self: Any, prompt: str | Sequence[int], model: str,
                 params: dict[str, Any] | None = None, job_id: str | None = None,
                 deadline: float | None = None,
                 priority: int | None = None) -> DoneEvent:
        # Nobody reads the result after `timeout`: past it, a worker does not start the job
        # (the deadline) or stops it (the cancel), as the gateway does for its requests.
        if deadline is None:
            deadline = time.time() + timeout
        if priority is None:
            priority = (self.request.delivery_info or {}).get("priority") or 0
        try:
            job = client.submit(prompt, params or {}, model=model,
                                job_id=job_id or self.request.id, deadline=deadline,
                                stream=False, priority=priority)
        except ProtocolError as exc:
            raise GenqJobFailed(f"job rejected ({exc.code}): {exc.message}") from None
        try:
            return job.result(timeout=timeout)
        except JobError as exc:
            raise GenqJobFailed(str(exc)) from None
        except TimeoutError as exc:
            job.cancel()
            raise GenqJobFailed(f"{exc}; the job was cancelled") from None

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="genq celery-bridge", description=__doc__,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--broker", required=True, help="Celery broker URL (redis://...)")
    p.add_argument("--backend", default=None,
                   help="Celery result backend URL (default: the broker URL)")
    add_redis_args(p, "genq's Redis")
    p.add_argument("--queue", default="celery", help="the Celery queue to consume")
    p.add_argument("--concurrency", type=int, default=64,
                   help="jobs in flight (threads, each waiting on one job)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for one job's result")
    p.add_argument("--result-serializer", default="json", choices=ACCEPT_CONTENT,
                   help="how results are written; apps must read them the same way")
    p.add_argument("--visibility-timeout", type=float, default=None,
                   help="seconds before a task a dead bridge held is delivered again "
                        "(default: kombu's, one hour)")
    p.add_argument("--loglevel", default="INFO", help="Celery's log level")
    args = p.parse_args(argv)
    if args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    app = create_app(args.broker, args.redis, backend=args.backend, queue=args.queue,
                     prefix=args.prefix, timeout=args.timeout,
                     result_serializer=args.result_serializer,
                     visibility_timeout=args.visibility_timeout)
    app.worker_main(["worker", "--pool", "threads", "--concurrency", str(args.concurrency),
                     "--queues", args.queue, "--loglevel", args.loglevel, "--without-gossip",
                     "--without-mingle", "--hostname", f"genq-bridge@{os.uname().nodename}"])
    return 0
