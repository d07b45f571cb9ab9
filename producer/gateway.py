"""The OpenAI-compatible gateway's core: a request's jobs submitted, read and shaped into OpenAI
answers (producer/gateway_app.py holds the HTTP app and the command line).

The OpenAI `model` is the served model name jobs route by; /v1/models lists the names in live
workers' heartbeats.

Contracts:
- One job per prompt; the job's id is the `Genq-Job-Id` request header (an idempotency key: it
  runs once) or a fresh one, and comes back in the `Genq-Job-Id` response header.
- `stream: true` answers plain `data:` server-sent events, as OpenAI's server does (clients that
  strip a leading `data: ` and parse JSON read them). A request that asks to resume (a
  `Last-Event-ID` header) or opts in (`Genq-Resumable: 1`) also gets an `id:` line, the reply
  entry id, before each event: the same request sent again with the same Genq-Job-Id and a
  `Last-Event-ID` header resumes after that entry (the job is not submitted twice).
- A client that disconnects cancels its job(s) after `resume_grace_s` (a resume within it keeps
  the job running; the grace is per gateway process).
- Request-level limits come before anything is enqueued (producer/gateway_limits.py).
- Errors are OpenAI's shape {"error": {message, type, param, code}}: 400 bad params or a request
  over a limit, 404 unknown model or route, 429 no room in the model's queue (waiting + running
  jobs, plus the request's prompts x n, over max_queue_depth), 503 no live worker serves a model
  that has a queue or Redis cannot be reached, 504 the job's deadline (now + timeout_s) passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from producer import openai_schema as oa
from producer.client import make_job_spec
from producer.fleet_view import FleetView
from producer.gateway_async import ClientGone, anext_or_none, chain, watch_disconnect
from producer.gateway_fleet import GatewayRedis, JobReader, check_last_event_id, error_status
from producer.gateway_limits import check_prompt_count
from producer.limits import Limits, check_job_bytes, check_limits
from producer.openai_choices import Choices
from producer.openai_schema import GatewayError
from producer.protocol import DEFAULT_PREFIX, Keys, ProtocolError, encode_job_entry
from producer.reply_hub import ReplyHub
from producer.slot_hubs import SlotHubs, reply_hub

JOB_ID_HEADER = "Genq-Job-Id"
RESUMABLE_HEADER = "Genq-Resumable"  # "1" / "true": `id:` lines on a stream that did not resume


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = DEFAULT_PREFIX
    max_queue_depth: int = 1024  # per model: waiting + running jobs at or over this -> 429
    timeout_s: float = 600.0  # each job's deadline is now + timeout_s; past it -> 504
    resume_grace_s: float = 2.0  # a disconnected stream's job is cancelled after this
    max_connections: int = 1024  # Redis connections for reply reads (more requests wait)
    max_prompts_per_request: int = 256  # more -> 400 (each prompt is a job)
    max_body_bytes: int = 16 << 20  # a larger request body -> 400, before it is parsed
    drain_timeout_s: float = 5.0  # on SIGTERM/SIGINT: requests in flight get this long
    files_dir: str = "genq-files"  # Batch API: uploaded files and batch results
    max_file_bytes: int = 200 << 20  # a larger batch file upload -> 400
    batch_priority: int = 10  # the jobs of batch lines: below interactive requests (0)
    limits: Limits = Limits()

    def __post_init__(self) -> None:
        if self.max_queue_depth < 1:
            raise ValueError(f"--max-queue-depth must be at least 1, got {self.max_queue_depth}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.resume_grace_s < 0:
            raise ValueError(f"--resume-grace must be >= 0, got {self.resume_grace_s}")
        if self.max_prompts_per_request < 1:
            raise ValueError("--max-prompts-per-request must be at least 1, got "
                             f"{self.max_prompts_per_request}")
        if self.max_file_bytes < 1:
            raise ValueError(f"--max-file-bytes must be at least 1, got {self.max_file_bytes}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be at least 1, got {self.max_body_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")


class Gateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.keys = Keys(cfg.prefix)
        self.redis = GatewayRedis(cfg.redis_url, self.keys, cfg.max_connections)
        self.fleet = FleetView(self.redis.conn, self.keys)
        self._pending_cancels: dict[str, tuple[asyncio.TimerHandle, str]] = {}  # -> model
        self._tasks: set[asyncio.Task[None]] = set()
        # Requests reading each job now: a cut request's delayed cancel spares a job that
        # another request (a retry with the same Genq-Job-Id) reads by then.
        self._readers: dict[str, int] = {}
        self.hub: ReplyHub | SlotHubs | None = None  # (made in the event loop, by start())

    async def start(self) -> None:
        """In the app's event loop, before the first request."""
        self.hub = reply_hub(self.cfg.redis_url)

    async def stop(self) -> None:
        """At shutdown (after the drain): the jobs of cut streams are cancelled now, since
        their clients cannot resume on a process that is going away; then Redis is closed."""
        due = [(job_id, model) for job_id, (_, model) in self._pending_cancels.items()]
        for handle, _ in self._pending_cancels.values():
            handle.cancel()
        self._pending_cancels.clear()
        with contextlib.suppress(Exception):  # (Redis may be what is going away)
            await asyncio.wait_for(asyncio.gather(
                *(self.redis.cancel(job_id, model) for job_id, model in due)), timeout=2.0)
        if self.hub is not None:
            await self.hub.close()
        await self.fleet.close()
        await self.redis.close()

    # ------------------------------------------------------------------ submission

    async def submit(self, request: Request, model: str, prompts: list[str | list[int]],
                     params: dict[str, Any], messages: list[dict[str, str]] | None = None,
                     stream: bool = True, priority: int = 0) -> list[str]:
        """Check everything a producer can, then enqueue one job per prompt -> job ids. A chat
        (`messages`, prompts empty) is one job; the worker applies the model's chat template.
        Without `stream` the worker writes no tokens events (the answer needs only the end)."""
        given = request.headers.get(JOB_ID_HEADER)
        base = given or await self.redis.new_job_id(model)
        inputs: list[tuple[str | list[int] | None, list[dict[str, str]] | None]] = (
            [(None, messages)] if messages is not None else [(p, None) for p in prompts])
        ids = [base] if len(inputs) == 1 else [f"{base}-{k}" for k in range(len(inputs))]
        # A retry or a resume (the Genq-Job-Id of jobs submitted already) enqueues nothing:
        # the model's checks are for new work (a full queue, in which the job itself counts,
        # must not refuse the client its own job, nor let a cut stream's cancel fire).
        if given is None or not await self._all_submitted(ids, model):
            per_job = max(int(params.get("n") or 1), int(params.get("best_of") or 1))
            await self.fleet.require_model(model, self.cfg.max_queue_depth,
                                           len(inputs) * per_job)
        deadline = time.time() + self.cfg.timeout_s
        specs = []
        for job_id, (prompt, chat) in zip(ids, inputs, strict=True):
            try:
                spec = dataclasses.replace(  # (OpenAI's rule: over the context is a 400)
                    make_job_spec(prompt, params, model, job_id, deadline, stream, chat,
                                  priority),
                    fit_context=True)
                check_limits(spec, self.cfg.limits)
                payload = encode_job_entry(spec)["job"]  # (encoded once: measured, then sent)
                check_job_bytes(spec.id, payload, self.cfg.limits)  # (else the worker's too_large)
            except ProtocolError as exc:
                raise GatewayError(400, exc.message, code=exc.code) from None
            specs.append((spec, payload))
        for spec, payload in specs:  # only once every prompt passed: a 400 leaves no job running
            self._keep(spec.id)
            await self.redis.submit(spec, payload)
        return ids

    async def _all_submitted(self, job_ids: list[str], model: str) -> bool:
        try:
            keys = [self.keys.idem(job_id, model) for job_id in job_ids]
        except ProtocolError as exc:
            raise GatewayError(400, f"{JOB_ID_HEADER}: {exc.message}", code=exc.code) from None
        return int(await self.redis.conn.exists(*keys)) == len(keys)

    def _keep(self, job_id: str) -> None:
        """A request for a job that is due to be cancelled (its stream was cut) keeps it."""
        pending = self._pending_cancels.pop(job_id, None)
        if pending is not None:
            pending[0].cancel()

    def cancel_later(self, job_ids: list[str], model: str) -> None:
        loop = asyncio.get_running_loop()
        for job_id in job_ids:
            self._keep(job_id)
            self._pending_cancels[job_id] = (loop.call_later(
                self.cfg.resume_grace_s, self._cancel_now, job_id, model), model)

    def _cancel_now(self, job_id: str, model: str) -> None:
        self._pending_cancels.pop(job_id, None)
        if self._readers.get(job_id):
            return  # a retry reads it: it stays wanted
        task = asyncio.get_running_loop().create_task(self.redis.cancel(job_id, model))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @contextlib.contextmanager
    def _reading(self, job_ids: list[str]) -> Iterator[None]:
        """While a request reads these jobs (a cancel that falls due spares them)."""
        for job_id in job_ids:
            self._readers[job_id] = self._readers.get(job_id, 0) + 1
        try:
            yield
        finally:
            for job_id in job_ids:
                left = self._readers.pop(job_id, 1) - 1
                if left:
                    self._readers[job_id] = left

    def reader(self, job_id: str, model: str, after: str | None = None) -> JobReader:
        conn = self.redis.blocking_conn if self.hub is None else self.redis.conn
        return JobReader(conn, self.keys.reply(job_id, model), job_id, after,
                         self.cfg.timeout_s + 30, self.keys.idem(job_id, model), self.hub)

    # ------------------------------------------------------------------ answers

    async def complete(self, request: Request, req: oa.CompletionRequest | oa.ChatCompletionRequest,
                       prompts: list[str | list[int]], chat: bool) -> Response:
        check_prompt_count(len(prompts), self.cfg.max_prompts_per_request)
        params = req.to_params()
        if req.stream and len(prompts) > 1:
            raise GatewayError(400, "stream: true takes one prompt; send one request per prompt",
                               param="prompt")
        messages = req.wire_messages() if isinstance(req, oa.ChatCompletionRequest) else None
        resume_after = check_last_event_id(request.headers.get("last-event-id")) \
            if req.stream else None
        ids = await self.submit(request, req.model, prompts, params, messages, bool(req.stream),
                                req.priority)
        prefix = "chatcmpl-" if chat else "cmpl-"
        headers = {JOB_ID_HEADER: ids[0] if len(ids) == 1 else ids[0].rsplit("-", 1)[0]}
        if req.stream:
            return await self._stream(request, req, ids[0], prefix + headers[JOB_ID_HEADER],
                                      chat, headers, prompts, resume_after)
        try:
            with self._reading(ids):
                results = await watch_disconnect(request, asyncio.gather(
                    *(self.reader(job_id, req.model).result() for job_id in ids)))
        except ClientGone:
            self.cancel_later(ids, req.model)
            return Response(status_code=499)
        except GatewayError:  # one job failed or timed out: the others' work is wasted
            await asyncio.gather(*(self.redis.cancel(job_id, req.model) for job_id in ids))
            raise
        shaper = Choices(req, chat, prefix + headers[JOB_ID_HEADER], int(time.time()), prompts)
        choices: list[dict[str, Any]] = []
        prompt_tokens, completion_tokens = 0, 0
        for k, result in enumerate(results):
            choices.extend(shaper.choice(k, out) for out in result["outputs"])
            prompt_tokens += result["usage"]["prompt_tokens"]
            completion_tokens += result["usage"]["completion_tokens"]
        body = oa.completion_response(prefix + headers[JOB_ID_HEADER], req.model, choices,
                                      oa.usage(prompt_tokens, completion_tokens), chat)
        return JSONResponse(body, headers=headers)

    async def _stream(self, request: Request,
                      req: oa.CompletionRequest | oa.ChatCompletionRequest, job_id: str,
                      response_id: str, chat: bool, headers: dict[str, str],
                      prompts: list[str | list[int]], resume_after: str | None) -> Response:
        reader = self.reader(job_id, req.model, after=resume_after)
        events = reader.events()
        try:  # the first event decides the status: a job the worker rejects is a 4xx/5xx
            with self._reading([job_id]):  # (the body reads on under its own)
                first = await watch_disconnect(request, anext_or_none(events))
        except ClientGone:
            self.cancel_later([job_id], req.model)
            with contextlib.suppress(RuntimeError):  # (a read still ending: it ends on its own)
                await events.aclose()
            return Response(status_code=499)
        if first is not None and first[1]["type"] == "error":
            await events.aclose()
            raise error_status(first[1])
        # From the reply stream's clock, so a resumed stream's chunks match the first ones.
        shaper = Choices(req, chat, response_id, reader.created or int(time.time()), prompts)
        for event in reader.replayed:  # a resume: what the client already has shapes the rest
            shaper.sse_payloads(event)  # (no second role or echo, nor the whole text at the end)
        with_ids = resume_after is not None or wants_ids(request)

        async def body() -> AsyncIterator[str]:
            finished = False
            frames: list[str] = []
            try:
                with self._reading([job_id]):
                    pending = [first] if first is not None else []
                    async for entry_id, event in chain(pending, events):
                        void = shaper.restart_error(event)
                        if void is not None:  # the job runs on; only this stream ends
                            finished = True
                            await events.aclose()
                            yield "".join(frames) + f"data: {json.dumps(void)}\n\n"
                            return
                        head = f"id: {entry_id}\n" if with_ids else ""
                        frames += [f"{head}data: {data}\n\n"
                                   for data in shaper.sse_data(event)]
                        finished = event["type"] in ("done", "error")
                        if frames and reader.batch_left == 0 and not finished:
                            yield "".join(frames)  # (events read together: one write)
                            frames = []
                    yield "".join(frames) + "data: [DONE]\n\n"
            except GatewayError as exc:  # e.g. no terminal event before the deadline
                yield "".join(frames) + f"data: {json.dumps(exc.body())}\n\n"
            finally:
                if not finished:  # the client went away (or we failed): stop the job
                    with anyio.CancelScope(shield=True):
                        await events.aclose()
                    self.cancel_later([job_id], req.model)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})


def wants_ids(request: Request) -> bool:
    """The client opted in to `id:` lines (to resume later) without resuming now."""
    return request.headers.get(RESUMABLE_HEADER, "").strip().lower() in ("1", "true", "yes")
