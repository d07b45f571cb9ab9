"""The `genq` console script: a dispatcher over sub-commands.

Each sub-command is "module:function" taking argv (list[str]) and returning an exit code. It is
imported only when chosen, so `genq submit` never imports torch (only `genq worker` does). Adding
a command is one line in COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from typing import Any

import redis

from producer.events import DoneEvent
from producer.flags import DefaultsHelpFormatter, add_limit_args, add_redis_args, limits_from_args
from producer.limits import check_limits
from producer.protocol import ProtocolError
from producer.status import live_consumers, worker_rows

COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("producer.cli:submit_main", "submit one job and stream its text"),
    "status": ("producer.status:status_main", "queues and workers as a table"),
    "worker": ("worker.main:main", "serve one model on one device (imports the engine)"),
    "gateway": ("producer.gateway_app:main", "OpenAI-compatible HTTP gateway (FastAPI + uvicorn)"),
    "celery-bridge": ("producer.celery_bridge:main", "serve genq.generate to Celery apps"),
    "bench": ("producer.bench:bench_main", "round trips through a running fleet, timed by Redis"),
    "run-batch": ("producer.run_batch:main", "an OpenAI batch file through the queue (vLLM's "
                  "run-batch)"),
}
# The extra of the genq distribution a command needs beyond the base install (the client), and
# modules that extra brings: without them the command names the install line instead of failing
# on an import.
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "worker": ("worker", ("torch", "transformers", "safetensors", "tokenizers", "numpy", "tqdm",
                          "prometheus_client")),
    "gateway": ("gateway", ("fastapi", "uvicorn", "pydantic")),
    "run-batch": ("gateway", ("pydantic",)),
    "celery-bridge": ("celery", ("celery",)),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"genq: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    missing = missing_extra(name)
    if missing is not None:
        print(f"genq {name}: {missing}", file=sys.stderr)
        return 1
    module_name, func_name = COMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(rest) or 0)
    except redis.AuthenticationError as exc:  # one line, not a traceback
        print(f"genq {name}: Redis refused the credentials in the URL: {exc}", file=sys.stderr)
        return 1
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"genq {name}: cannot reach Redis ({exc}); is redis-server running at the URL "
              "given by --redis / GENQ_REDIS?", file=sys.stderr)
        return 1


def missing_extra(command: str) -> str | None:
    """What to install for `command` when this install lacks its extra, else None."""
    if command not in EXTRAS:
        return None
    extra, modules = EXTRAS[command]
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if not absent:
        return None
    return (f"needs the '{extra}' extra, which this install lacks (no module "
            f"{', '.join(absent)}): pip install 'genq[{extra}]'")


def _usage() -> str:
    lines = ["usage: genq <command> [options]", "", "commands:"]
    lines += [f"  {name:<14} {help_}" for name, (_target, help_) in COMMANDS.items()]
    return "\n".join(lines)


# --------------------------------------------------------------------------- submit

def submit_main(argv: list[str]) -> int:
    from producer.client import Client, make_job_spec
    from producer.errors import JobError

    parser = argparse.ArgumentParser(prog="genq submit", description="submit one job: a "
                                     "prompt, or a chat with --messages",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("prompt", nargs="?", default=None, help="prompt text")
    parser.add_argument("--messages", default=None, metavar="JSON_OR_FILE",
                        help='a chat instead of a prompt: a JSON list of {"role", "content"} '
                             "maps, inline or in a file ('-': stdin); the worker applies the "
                             "model's chat template")
    parser.add_argument("--model", required=True, help="served model name")
    add_redis_args(parser)
    parser.add_argument("--n", type=int, default=None,
                        help="completions to generate (default: 1; more than one: printed at "
                             "the end, not streamed)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens to generate at most (default: 16, as in vLLM)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 is greedy (default: 1.0)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=None, help="(default: -1, off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (default: one the producer picks, so a re-run after "
                             "a worker failure samples the same tokens)")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--job-id", default=None, help="idempotency key: an id runs once")
    parser.add_argument("--priority", type=int, default=0,
                        help="lower runs sooner (vLLM's meaning; workers under "
                             "--scheduling-policy priority order the jobs they hold by it)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for the end; then the job is cancelled "
                             "(default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the done event as JSON")
    parser.add_argument("--allow-no-worker", action="store_true",
                        help="enqueue even when no live worker serves --model (the job waits "
                             "for one); without it such a job is refused at once")
    add_limit_args(parser, "genq submit (before enqueueing: give it the workers' caps)")
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.messages is None):
        parser.error("give a prompt or --messages, not both")
    try:
        messages = None if args.messages is None else load_messages(args.messages)
    except ValueError as exc:
        print(f"genq submit: {exc}", file=sys.stderr)
        return 2
    params = {k: v for k, v in (("n", args.n), ("max_tokens", args.max_tokens),
                                ("temperature", args.temperature), ("top_p", args.top_p),
                                ("top_k", args.top_k), ("seed", args.seed), ("stop", args.stop))
              if v is not None}
    try:  # the protocol's own checks and the caps, before anything is enqueued
        check_limits(make_job_spec(args.prompt, params, args.model, args.job_id, None, True,
                                   messages), limits_from_args(args))
    except ProtocolError as exc:
        print(f"genq submit: {exc.message}", file=sys.stderr)
        return 2
    with Client(args.redis, prefix=args.prefix) as client:
        unserved = unserved_warning(client, args.model)
        if unserved and not args.allow_no_worker:
            print(f"genq submit: {unserved.split('; ')[0]}: nothing was enqueued "
                  "(--allow-no-worker queues it for a worker yet to start)", file=sys.stderr)
            return 1
        try:
            job = client.submit(args.prompt, params, model=args.model, messages=messages,
                                job_id=args.job_id, priority=args.priority)
        except ProtocolError as exc:
            print(f"genq submit: {exc}", file=sys.stderr)
            return 2
        if unserved:
            print(f"genq submit: {unserved}", file=sys.stderr)
        live = not args.json and params.get("n", 1) == 1
        try:
            for event in job.stream(timeout=args.timeout):
                if live and event["type"] == "tokens":
                    print(event["text"], end="", flush=True)
                elif live and event["type"] == "restart":
                    print(f"\n[restart: {event['reason']}]", flush=True)
                elif event["type"] == "error":
                    raise JobError(job.id, event["code"], event["message"])
                elif event["type"] == "done":
                    _print_done(event, args.json, live)
        except JobError as exc:
            print(f"\ngenq submit: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            job.cancel()
            print(f"\ngenq submit: cancelled job {job.id}", file=sys.stderr)
            return 130
        except TimeoutError as exc:  # nobody waits for it any more: it stops (as on Ctrl-C)
            job.cancel()
            hint = f" ({unserved})" if unserved else ""
            print(f"\ngenq submit: {exc}{hint}; cancelled it", file=sys.stderr)
            return 1
    return 0


def unserved_warning(client: Any, model: str) -> str | None:
    """A note when no live worker serves `model` (the job waits for one; it is not refused,
    since a worker may be starting), naming the models live workers do serve."""
    conn, keys = client.redis, client.keys
    try:
        if live_consumers(conn, keys, model):  # cheap first: no SCAN
            return None
        served = {w["model"] for w in worker_rows(conn, keys)}
    except redis.RedisError:
        return None
    if model in served:
        return None
    known = ", ".join(sorted(str(m) for m in served)) or "none"
    return (f"no live worker serves {model!r} (live workers serve: {known}); the job waits in "
            "its queue until one starts")


def load_messages(value: str) -> Any:
    """--messages: inline JSON (it starts with "["), '-' (JSON on stdin) or a JSON file's path.
    A list of maps; their fields are checked by the protocol on submit."""
    if value.lstrip().startswith("["):
        source, text = "--messages", value
    elif value == "-":
        source, text = "--messages - (stdin)", sys.stdin.read()
    else:
        try:
            with open(value, encoding="utf-8") as f:
                source, text = f"--messages file {value}", f.read()
        except OSError as exc:
            raise ValueError(f"--messages: cannot read {value}: {exc.strerror or exc} (give "
                             "inline JSON starting with '[', a file, or '-' for stdin)") from None
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f'{source} must be a JSON list of {{"role", "content"}} maps, got '
                         f"{json.dumps(messages)[:80]}")
    return messages


def _print_done(event: DoneEvent, as_json: bool, live: bool) -> None:
    if as_json:
        print(json.dumps(event, ensure_ascii=False))
        return
    if live:
        print()
    else:
        for out in event["outputs"]:
            print(f"[{out['index']}] {out['text']}")
    reasons = ",".join(str(o["finish_reason"]) for o in event["outputs"])
    print(f"-- finish={reasons} usage={event['usage']}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

