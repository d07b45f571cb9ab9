"""`genq gateway`'s HTTP app and command line: routes, errors in OpenAI's shape for every route
and body (unknown routes and malformed JSON included), start-up and shutdown.

    genq gateway --redis redis://127.0.0.1:6379/0 --host 127.0.0.1 --port 8000 [--workers 2]

Shutdown: SIGTERM or SIGINT stops accepting connections, gives requests in flight
`--drain-timeout` seconds, then cuts them; the jobs of cut streams are cancelled at once (their
clients cannot resume on this process).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis import ConnectionError as RedisConnectionError
from redis import ResponseError as RedisResponseError
from redis import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from producer import openai_schema as oa
from producer.flags import DefaultsHelpFormatter, add_limit_args, add_redis_args, limits_from_args
from producer.gateway import Gateway, GatewayConfig
from producer.gateway_batches import add_batch_routes
from producer.gateway_limits import BodyLimit
from producer.limits import Limits
from producer.openai_schema import GatewayError

CONFIG_ENV = "GENQ_GATEWAY_CONFIG"  # --workers N: each uvicorn process reads its config here
log = logging.getLogger("uvicorn.error")


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def validation_error(exc: RequestValidationError) -> GatewayError:
    """pydantic's first complaint as a sentence a person can act on, naming the field."""
    first = exc.errors()[0] if exc.errors() else {}
    kind = first.get("type")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if kind == "json_invalid":
        where = f" (at character {loc[0]})" if loc else ""
        error = (first.get("ctx") or {}).get("error", "invalid JSON")
        return GatewayError(400, f"the request body is not valid JSON: {error}{where}",
                            code="invalid_json")
    if not loc:  # the body as a whole: absent, or not a JSON object
        return GatewayError(400, "the request body must be a JSON object, sent with "
                            "Content-Type: application/json", code="invalid_json")
    field = ".".join(loc)
    return GatewayError(400, f"{field}: {first.get('msg', 'invalid value')}", param=field)


def create_app(cfg: GatewayConfig) -> FastAPI:
    gateway = Gateway(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:  # said once at start-up, not only in each request's 503 (SCRIPT EXISTS: a
            # command the gateway's ACL line grants, where PING is not)
            await gateway.redis.conn.script_exists("0" * 40)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            log.warning("genq gateway: cannot reach Redis (%s); requests answer 503 "
                        "redis_unavailable until it is up", exc)
        except RedisResponseError:  # it answered (a refusal): reachable
            pass
        await gateway.start()
        batches.start()
        yield
        batches.stop()
        await gateway.stop()

    app = FastAPI(title="genq gateway", version="1", lifespan=lifespan)
    app.state.gateway = gateway
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes,
                       paths={"/v1/files": cfg.max_file_bytes + (64 << 10)})  # (+ the form)
    batches = add_batch_routes(app, cfg.redis_url, gateway.keys, cfg.files_dir,
                               cfg.max_file_bytes, cfg.batch_priority)

    @app.exception_handler(GatewayError)
    async def on_gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def on_redis_down(request: Request, exc: Exception) -> JSONResponse:
        return error_response(GatewayError(
            503, f"the gateway cannot reach Redis ({exc}); retry later", type_="server_error",
            code="redis_unavailable"))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = (f"no route {request.method} {request.url.path}: the gateway serves "
                       "/v1/completions, /v1/chat/completions, /v1/models and /health")
        else:
            message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(GatewayError(exc.status_code, message,
                                           code="not_found" if exc.status_code == 404 else None))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = await gateway.fleet.live_models(fresh=True)
        return {"object": "list", "data": [
            model_card(name, count) for name, count in sorted(served.items())]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        served = await gateway.fleet.live_models(fresh=True)
        if model_id not in served:
            raise GatewayError(404, f"the model {model_id!r} does not exist: no live worker "
                               "serves it (see /v1/models)", param="model",
                               code="model_not_found")
        return model_card(model_id, served[model_id])

    @app.post("/v1/completions")
    async def completions(req: oa.CompletionRequest, request: Request) -> Response:
        return await gateway.complete(request, req, req.prompts(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: oa.ChatCompletionRequest, request: Request) -> Response:
        return await gateway.complete(request, req, [], chat=True)

    return app


def model_card(name: str, workers: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "genq", "workers": workers}


def app_from_env() -> FastAPI:
    """The app of one of several uvicorn worker processes (--workers): its config from the
    environment the parent set."""
    fields = json.loads(os.environ[CONFIG_ENV])
    fields["limits"] = Limits(**fields["limits"])
    return create_app(GatewayConfig(**fields))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="genq gateway", description="OpenAI-compatible gateway",
                                formatter_class=DefaultsHelpFormatter)
    add_redis_args(p)
    p.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--workers", type=int, default=1,
                   help="uvicorn processes sharing the port; raise it when the gateway's one "
                        "core is the bottleneck (default: %(default)s)")
    p.add_argument("--max-queue-depth", type=int, default=GatewayConfig.max_queue_depth,
                   help="waiting + running jobs of a model at which requests get 429; a request "
                        "counts prompts x n (default: %(default)s)")
    p.add_argument("--max-prompts-per-request", type=int,
                   default=GatewayConfig.max_prompts_per_request,
                   help="prompts one /v1/completions request may hold (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=GatewayConfig.max_body_bytes,
                   help="a larger request body is refused unread (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=GatewayConfig.timeout_s,
                   help="seconds a job may take from submit to its end, then 504 "
                        "(default: %(default)s)")
    p.add_argument("--resume-grace", type=float, default=GatewayConfig.resume_grace_s,
                   help="seconds a cut stream's job waits for a resume before it is cancelled "
                        "(default: %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=GatewayConfig.drain_timeout_s,
                   help="on SIGTERM/SIGINT, seconds requests in flight get before they are cut "
                        "(default: %(default)s)")
    p.add_argument("--files-dir", default=GatewayConfig.files_dir,
                   help="where the Batch API keeps uploaded files and results; share it between "
                        "gateway replicas (default: %(default)s)")
    p.add_argument("--max-file-bytes", type=int, default=GatewayConfig.max_file_bytes,
                   help="the largest batch file /v1/files takes (default: %(default)s)")
    p.add_argument("--batch-priority", type=int, default=GatewayConfig.batch_priority,
                   help="the priority of batch lines' jobs, lower runs sooner; interactive "
                        "requests run at 0 (default: %(default)s)")
    p.add_argument("--max-connections", type=int, default=GatewayConfig.max_connections,
                   help="Redis connections per process for reading replies; further requests "
                        "wait (default: %(default)s)")
    p.add_argument("--log-level", default="info", help="(default: %(default)s)")
    p.add_argument("--access-log", action="store_true",
                   help="log a line per request (default: off: it costs CPU per request)")
    add_limit_args(p, "the gateway (before enqueueing: give it the workers' caps)")
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = parser()
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    try:
        cfg = GatewayConfig(redis_url=args.redis, prefix=args.prefix,
                            max_queue_depth=args.max_queue_depth, timeout_s=args.timeout,
                            resume_grace_s=args.resume_grace,
                            max_connections=args.max_connections,
                            max_prompts_per_request=args.max_prompts_per_request,
                            max_body_bytes=args.max_body_bytes,
                            drain_timeout_s=args.drain_timeout, files_dir=args.files_dir,
                            max_file_bytes=args.max_file_bytes,
                            batch_priority=args.batch_priority, limits=limits_from_args(args))
    except ValueError as exc:
        p.error(str(exc))
    run: dict[str, Any] = {"host": args.host, "port": args.port, "log_level": args.log_level,
                           "timeout_graceful_shutdown": cfg.drain_timeout_s,
                           "access_log": args.access_log}
    if args.workers == 1:
        uvicorn.run(create_app(cfg), **run)
    else:
        os.environ[CONFIG_ENV] = json.dumps(dataclasses.asdict(cfg))
        uvicorn.run("producer.gateway_app:app_from_env", factory=True, workers=args.workers,
                    **run)
    return 0
