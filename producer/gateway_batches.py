"""The gateway's routes of OpenAI's Files and Batches APIs (producer/batches.py does the work;
its calls are blocking Redis and file I/O, so they run in the thread pool)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import redis
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from producer.batches import Batches, Files
from producer.openai_schema import GatewayError
from producer.protocol import Keys

T = TypeVar("T")


async def call(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in the thread pool; Redis refusing the batch keys (ACL) is a 403 that says
    so."""
    try:
        return await run_in_threadpool(fn, *args)
    except redis.exceptions.NoPermissionError as exc:
        raise GatewayError(403, f"Redis refused the Batch API's keys ({exc}): grant the "
                           "gateway's Redis user the batch and file keys (docs/batches.md)",
                           type_="permission_error", code="batch_api_unavailable") from None


def add_batch_routes(app: FastAPI, redis_url: str, keys: Keys, files_dir: str,
                     max_file_bytes: int, priority: int) -> Batches:
    files = Files(redis_url, keys, Path(files_dir))
    batches = Batches(redis_url, keys, files, priority)

    @app.post("/v1/files")
    async def create_file(file: UploadFile = File(...),  # noqa: B008 (FastAPI's idiom)
                          purpose: str = Form(...)) -> dict[str, Any]:
        content = await file.read(max_file_bytes + 1)
        if len(content) > max_file_bytes:
            raise GatewayError(400, f"the file is over --max-file-bytes ({max_file_bytes} "
                               "bytes): split the batch", param="file")
        return await call(files.create, content, file.filename or "batch.jsonl",
                                       purpose)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> dict[str, Any]:
        return await call(files.get, file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        await call(files.get, file_id)
        try:
            body = await run_in_threadpool(files.path(file_id).read_bytes)
        except OSError:
            raise GatewayError(404, f"file {file_id} has no content in this gateway's "
                               "--files-dir (give every gateway replica the same folder)",
                               param="file_id", code="not_found") from None
        return Response(body, media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        return await call(files.delete, file_id)

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> dict[str, Any]:
        body = await request.json()
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object")
        return await call(batches.create, body)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> dict[str, Any]:
        return await call(batches.get, batch_id)

    @app.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise GatewayError(400, "limit must be in [1, 100]", param="limit")
        return await call(batches.list, limit, after)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        return await call(batches.cancel, batch_id)

    return batches
