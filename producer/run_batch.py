"""`genq run-batch -i in.jsonl -o out.jsonl`: an OpenAI batch file through the queue, as
`vllm run-batch` runs one in-process.

Each input line is `{"custom_id": ..., "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}`. Each output line is OpenAI's batch output line: `{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. A line that cannot be
run (malformed JSON, another endpoint, a parameter out of range) gets `response: null` and an
`error` that says why. A job that fails gets the status code and error body the gateway would
answer.

Rules:
- A line's job id is derived from its content (custom_id, url, body, model), so running the same
  files again skips the lines already in the output file and re-attaches to the jobs still
  running: a resume after a crash runs nothing twice. A job that was cancelled (Ctrl-C of an
  earlier run) is submitted again under the next derived id.
- Ctrl-C cancels the jobs this run is waiting for, and exits 130.
- Results are written as they end: in input order by default (a line waits for those before
  it), or as they come with --unordered. The output file is appended to and flushed per line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.client import Client, Job
from producer.errors import JobError
from producer.flags import DefaultsHelpFormatter, add_redis_args
from producer.protocol import ProtocolError
from producer.results import iter_results

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_PRIORITY = 10  # below interactive traffic (0), as batch work should be
POLL_S = 2.0  # how often a stoppable run asks whether to stop


@dataclass
class Line:
    number: int
    custom_id: str
    line_id: str  # its output line's "id": derived from the line, so a resume can skip it
    chat: bool = False
    req: Any = None  # the request (openai_schema), once checked
    prompts: list[Any] = field(default_factory=list)
    base_id: str = ""
    retry: int = 0  # how many cancelled jobs this line has had
    jobs: list[Job] = field(default_factory=list)
    results: dict[int, Any] = field(default_factory=dict)  # prompt index -> done event
    output: dict[str, Any] | None = None  # the line to write, once it is known
    written: bool = False


def _error_line_of(line_id: str, custom_id: str | None, code: str,
                message: str) -> dict[str, Any]:
    return {"id": line_id, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse(number: int, raw: str, model: str | None, seen: set[str], salt: str = "",
          endpoint: str | None = None) -> Line:
    """An input line: to run, or with its error output line already. Its job ids derive from
    `salt` (e.g. a batch id) and the line's content. `endpoint`: the one url lines may name."""
    checked = _check(number, raw, model, seen, salt, endpoint)
    if isinstance(checked, Line):
        return checked
    return Line(number, checked["custom_id"] or "", checked["id"], output=checked)


def _check(number: int, raw: str, model: str | None, seen: set[str], salt: str,
           endpoint: str | None) -> Line | dict[str, Any]:
    from pydantic import ValidationError

    from producer import openai_schema as oa

    line_id = "batch_req_" + hashlib.sha256(f"{salt}:{number}:{raw}".encode()).hexdigest()[:24]

    def _error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
        return _error_line_of(line_id, custom_id, code, message)

    try:
        obj = json.loads(raw)
    except ValueError as exc:
        return _error_line(None, "invalid_json", f"line {number}: not JSON ({exc})")
    if not isinstance(obj, dict):
        return _error_line(None, "invalid_request", f"line {number}: not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _error_line(None, "invalid_request", f"line {number}: custom_id must be a "
                                                    "non-empty string")
    if custom_id in seen:
        return _error_line(custom_id, "duplicate_custom_id", f"line {number}: custom_id "
                                                            f"{custom_id!r} is used twice")
    seen.add(custom_id)
    url, body = obj.get("url"), obj.get("body")
    if obj.get("method", "POST") != "POST" or url not in ENDPOINTS:
        return _error_line(custom_id, "invalid_url", f"line {number}: POST to one of "
                                                     f"{', '.join(ENDPOINTS)} only, got {url!r}")
    if endpoint is not None and url != endpoint:
        return _error_line(custom_id, "invalid_url", f"line {number}: the batch's endpoint is "
                                                     f"{endpoint}, the line's url {url!r}")
    if not isinstance(body, dict):
        return _error_line(custom_id, "invalid_request", f"line {number}: body must be an object")
    body = {**body, "model": model} if model else body
    chat = url == ENDPOINTS[1]
    try:
        req = (oa.ChatCompletionRequest if chat else oa.CompletionRequest).model_validate(body)
        if req.stream:
            raise oa.GatewayError(400, "stream: true has no meaning in a batch", param="stream")
        req.to_params()
        prompts: list[Any] = [None] if chat else req.prompts()  # type: ignore[union-attr]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return _error_line(custom_id, "invalid_request", f"line {number}: {where}: "
                                                         f"{first['msg']}")
    except oa.GatewayError as exc:
        return _error_line(custom_id, "invalid_request", f"line {number}: {exc.message}")
    digest = hashlib.sha256(json.dumps([salt, custom_id, url, body], sort_keys=True).encode())
    return Line(number, custom_id, line_id, chat, req, prompts, "rb" + digest.hexdigest()[:30])


class Batch:
    """Runs lines through the queue; `emit` gets each output line (in input order when
    `ordered`)."""

    def __init__(self, client: Client, lines: list[Line], emit: Callable[[dict[str, Any]], None],
                 priority: int, ordered: bool) -> None:
        self.client = client
        self.lines = lines
        self.emit = emit
        self.priority = priority
        self.ordered = ordered
        self.next_to_write = 0
        self.done = self.failed = self.tokens = 0
        self.started = time.monotonic()

    def submit(self, line: Line) -> None:
        req = line.req
        params = req.to_params()
        messages = req.wire_messages() if line.chat else None
        base = line.base_id if not line.retry else f"{line.base_id}-r{line.retry}"
        ids = [base] if len(line.prompts) == 1 else [f"{base}-{k}" for k in
                                                     range(len(line.prompts))]
        try:
            line.jobs = [self.client.submit(p, params, model=req.model, messages=messages,
                                            job_id=job_id, stream=False, priority=self.priority)
                         for p, job_id in zip(line.prompts, ids, strict=True)]
        except ProtocolError as exc:
            self._ended(line, _error_line_of(line.line_id, line.custom_id, exc.code,
                                             exc.message))
        line.results = {}

    def run(self, progress: bool = False, stop: Callable[[], bool] | None = None) -> bool:
        """Until every line has its output (True), or `stop()`, asked every POLL_S, says to
        stop (False)."""
        for line in self.lines:
            if line.output is None:
                self.submit(line)
            else:
                self._ended(line, line.output)
        while any(ln.output is None for ln in self.lines):
            if stop is not None and stop():
                return False
            waiting = [(ln, k) for ln in self.lines if ln.output is None
                       for k in range(len(ln.jobs)) if k not in ln.results]
            for index, value in iter_results(self.client.blocking_redis,
                                             [ln.jobs[k] for ln, k in waiting],
                                             None if stop is None else POLL_S):
                line, k = waiting[index]
                if isinstance(value, TimeoutError):
                    continue  # (polling: asked again after the stop check)
                if isinstance(value, JobError) and value.code == "cancelled":
                    line.retry += 1  # (an earlier run's Ctrl-C): run it again, new ids
                    self.submit(line)
                    break  # wait again, on the new jobs too
                line.results[k] = value
                if len(line.results) == len(line.jobs):
                    self._ended(line, self._output(line))
                if progress:
                    self._progress()
        if progress:
            self._progress()
            print(file=sys.stderr)
        return True

    def _output(self, line: Line) -> dict[str, Any]:
        """The output line of a line whose jobs all ended."""
        from producer import openai_schema as oa
        from producer.gateway_fleet import error_status
        from producer.openai_choices import Choices

        request_id, line_id = line.jobs[0].id, line.line_id
        failure = next((r for r in line.results.values() if isinstance(r, Exception)), None)
        if failure is not None:
            if isinstance(failure, JobError):
                err = error_status({"code": failure.code, "message": failure.message})
                return {"id": line_id, "custom_id": line.custom_id, "error": None,
                        "response": {"status_code": err.status, "request_id": request_id,
                                     "body": err.body()}}
            return _error_line_of(line_id, line.custom_id, "timeout", str(failure))
        prefix = "chatcmpl-" if line.chat else "cmpl-"
        shaper = Choices(line.req, line.chat, prefix + request_id, int(time.time()),
                         line.prompts)
        choices: list[dict[str, Any]] = []
        prompt_tokens = completion_tokens = 0
        for k in range(len(line.jobs)):
            result = line.results[k]
            choices.extend(shaper.choice(k, o) for o in result["outputs"])
            prompt_tokens += result["usage"]["prompt_tokens"]
            completion_tokens += result["usage"]["completion_tokens"]
        self.tokens += completion_tokens
        body = oa.completion_response(prefix + request_id, line.req.model, choices,
                                      oa.usage(prompt_tokens, completion_tokens), line.chat)
        return {"id": line_id, "custom_id": line.custom_id, "error": None,
                "response": {"status_code": 200, "request_id": request_id, "body": body}}

    def _ended(self, line: Line, output: dict[str, Any]) -> None:
        """`line` has its output: write it, and in order, the ended lines behind it."""
        line.output = output
        response = output.get("response")
        if response is not None and response["status_code"] == 200:
            self.done += 1
        else:
            self.failed += 1
        if not self.ordered:
            self._write(line)
            return
        lines = self.lines
        while self.next_to_write < len(lines) and lines[self.next_to_write].output is not None:
            self._write(lines[self.next_to_write])
            self.next_to_write += 1

    def _write(self, line: Line) -> None:
        if line.output is None or line.written:
            return
        self.emit(line.output)
        line.written = True

    def _progress(self) -> None:
        total = len(self.lines)
        elapsed = max(time.monotonic() - self.started, 1e-9)
        finished = self.done + self.failed
        eta = (total - finished) * elapsed / finished if finished else float("nan")
        print(f"\r{finished}/{total} lines: {self.done} done, {self.failed} failed, "
              f"{self.tokens / elapsed:.0f} tok/s, ETA {eta:.0f} s ", end="", file=sys.stderr)

    def cancel_unfinished(self) -> int:
        jobs = [job for ln in self.lines if ln.output is None for job in ln.jobs]
        for job in jobs:
            job.cancel()
        return len(jobs)


def done_ids(path: Path) -> set[str]:
    """The ids of the lines an earlier run wrote to an output file. A torn last line (the run
    was killed mid-write) is cut off the file."""
    if not path.exists():
        return set()
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
        with open(path, "r+") as f:
            f.truncate(len(text.encode()))
    ids = set()
    for raw in text.splitlines():
        try:
            ids.add(json.loads(raw)["id"])
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="genq run-batch", description=__doc__,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, type=Path,
                   help="OpenAI batch file (JSONL)")
    p.add_argument("-o", "--output-file", required=True, type=Path,
                   help="where results go (JSONL, appended to: a resume skips what is there)")
    p.add_argument("--model", default=None,
                   help="the model every line runs on (default: each body's own 'model')")
    p.add_argument("--priority", type=int, default=DEFAULT_PRIORITY,
                   help="the jobs' priority, lower runs sooner (default: %(default)s, below "
                        "interactive requests at 0)")
    p.add_argument("--unordered", action="store_true",
                   help="write each result as it ends (default: in input order)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    add_redis_args(p)
    args = p.parse_args(argv)
    try:
        raw_lines = args.input_file.read_text().splitlines()
    except OSError as exc:
        p.error(f"cannot read {args.input_file}: {exc.strerror}")
    skip = done_ids(args.output_file)
    seen: set[str] = set()
    lines = [parse(number, raw, args.model, seen)
             for number, raw in enumerate(raw_lines, 1) if raw.strip()]
    lines = [line for line in lines if line.line_id not in skip]
    with open(args.output_file, "a") as out, Client(args.redis, prefix=args.prefix) as client:
        def emit(output: dict[str, Any]) -> None:
            out.write(json.dumps(output) + "\n")
            out.flush()

        batch = Batch(client, lines, emit, args.priority, not args.unordered)
        try:
            batch.run(progress=not args.no_progress)
        except KeyboardInterrupt:
            cancelled = batch.cancel_unfinished()
            print(f"\ngenq run-batch: interrupted; {cancelled} job(s) cancelled. Run the same "
                  "command again to resume.", file=sys.stderr)
            return 130
    print(f"genq run-batch: {batch.done} done, {batch.failed} failed, "
          f"{len(skip)} skipped (in {args.output_file} already)", file=sys.stderr)
    return 0
