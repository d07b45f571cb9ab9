"""The gateway's request-level limits, checked before anything is enqueued: the size of a request
body (an ASGI middleware, so an oversized body is refused before it is parsed) and how many jobs
one request may add to a queue (prompts per request, and prompts x n against the queue depth).

A per-job cap alone does not bound a request: one body of many small prompts is many jobs.
"""

from __future__ import annotations

import json
from typing import Any

from producer.openai_schema import GatewayError

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyLimit:
    """Refuse a request body over `max_bytes` with a 400 in OpenAI's shape. A declared
    Content-Length over the cap is refused before any of the body is read; a chunked body is
    read up to the cap and then refused. The body read is replayed to the app unchanged."""

    def __init__(self, app: Any, max_bytes: int, paths: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.paths = paths or {}  # a cap of their own for these paths (file uploads)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        max_bytes = self.paths.get(scope["path"], self.max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._refuse(send, int(declared), max_bytes)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # (a disconnect: the app sees it)
            size += len(message.get("body", b""))
            if size > max_bytes:
                await self._refuse(send, size, max_bytes, at_least=True)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Any, size: int, cap: int, at_least: bool = False) -> None:
        fix = "(--max-body-bytes); send fewer or shorter prompts per request" \
            if cap == self.max_bytes else "(--max-file-bytes); split the batch into files"
        error = GatewayError(400, f"the request body is {'over ' if at_least else ''}{size} "
                             f"bytes, over the gateway's cap of {cap} {fix}",
                             code="request_too_large")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def check_prompt_count(num_prompts: int, max_prompts: int) -> None:
    if num_prompts > max_prompts:
        raise GatewayError(400, f"the request holds {num_prompts} prompts, over the gateway's "
                           f"cap of {max_prompts} per request (--max-prompts-per-request); "
                           "split it into several requests", param="prompt",
                           code="too_many_prompts")


def check_queue_room(model: str, depth: int, num_sequences: int, max_queue_depth: int) -> None:
    """`num_sequences` (prompts x n, or x best_of) join a queue of `depth` jobs: a request that
    could never fit is a 400, one that does not fit now a 429."""
    if num_sequences > max_queue_depth:
        raise GatewayError(400, f"the request asks for {num_sequences} sequences (prompts x n), "
                           f"more than the queue of {model!r} may ever hold ({max_queue_depth}, "
                           "--max-queue-depth); send fewer prompts or a smaller n",
                           param="n", code="request_too_large")
    if depth + num_sequences > max_queue_depth:
        raise GatewayError(429, f"the queue of {model!r} holds {depth} jobs; {num_sequences} "
                           f"more would pass its limit of {max_queue_depth}; retry later",
                           type_="rate_limit_exceeded", code="queue_full")
