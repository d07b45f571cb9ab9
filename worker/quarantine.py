"""Quarantine: what the worker does when engine.step() raises. A bad job never stops a worker.

After a step raised, the engine's state is not trusted: Engine.abort_all drops every request and
rebuilds the scheduler's queues and the block tables. The suspects then run again, a group at a
time, alone in the engine, while the worker reads no new jobs; worker/isolation.py decides the
groups, the culprit and which re-runs stream.

A culprit (a suspect that fails alone) ends with an error event (code engine_error, naming the
exception), fenced and acked like any finish, never dead-lettered, once a probe (a tiny greedy
request of the worker's own, alone in the engine) shows that the engine still serves. Every
other suspect completes with the output it would have had: greedy and seeded outputs do not
depend on the batch, and a re-run streams only past what its client already has, so the reply
stream holds each (index, pos) once.

It is the engine, not a job, when the probe fails too or after a long streak of failed steps:
EngineBroken is raised, and the worker exits non-zero so that other workers reclaim its jobs (as
when a worker process dies).

The normal path pays nothing for this: the loop calls `isolate` only from its except clause
around step(), and an isolation runs its own steps until every suspect has ended. Those steps
are the loop's iteration without reading, through the few methods of `Host` the Worker offers.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Protocol

from engine.sampling_params import SamplingParams
from worker.admission import Admission, Rejection
from worker.held import Held
from worker.isolation import Isolation
from worker.jobs import ActiveJob

log = logging.getLogger("genq.worker")
EXIT_ENGINE_BROKEN = 3  # genq worker's exit status when the engine fails whatever it runs
_PROBE_PROMPT = [1, 2, 3, 4]  # token ids: every vocabulary has them
_PROBE_STEPS = 8  # a prefill and a decode step; more means the probe is stuck
_MESSAGE_CHARS = 500
_probe_ids = itertools.count(1)


class EngineBroken(RuntimeError):
    """The engine cannot serve (not one job's fault): the worker must exit."""


class Host(Protocol):
    """What an isolation needs of the worker (worker/loop.py's Worker)."""

    engine: Any
    held: Held
    admission: Admission
    counters: dict[str, int]

    def priority_of(self, job: ActiveJob) -> int: ...

    def housekeeping(self) -> None:
        """Before a step: the writer's feedback, cancels, deadlines."""

    def after_step(self) -> None:
        """After a step: refresh the stats, wait while the writer is behind."""

    def stopping(self) -> bool:
        """Whether the worker is stopping (its drain then runs or hands back the rest)."""


class Quarantine:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.engine = host.engine
        self.isolation = Isolation()
        self._logged: set[tuple[str, str]] = set()  # (type, message) logged with a traceback

    @property
    def behind(self) -> dict[str, dict[int, int] | None]:
        """Re-runs held back until they catch up with their clients (Isolation.behind)."""
        return self.isolation.behind

    def isolate(self, exc: Exception) -> None:
        """engine.step() raised `exc`: end the culprit(s), re-run every other suspect to its end.
        Returns when no suspect is left (or when the worker stops: drain hands back the rest);
        raises EngineBroken when the engine cannot serve."""
        host = self.host
        counters = host.counters
        self._logged = set()
        before = (counters["engine_failures"], counters["culprits"])
        log.error("engine.step() raised %s: %s; isolating the %d job(s) it was running (no "
                  "new jobs are read until that is done)", type(exc).__name__, exc,
                  len(host.held.jobs), exc_info=exc)
        self._logged.add((type(exc).__name__, str(exc)))
        started = time.monotonic()
        self._failed(exc)
        self._run()
        self.isolation.settle(host.held.jobs)
        log.info("isolation over in %.2f s: %d failed step(s), %d culprit(s) ended with "
                 "engine_error; %d job(s) held, %d left to re-run", time.monotonic() - started,
                 counters["engine_failures"] - before[0], counters["culprits"] - before[1],
                 len(host.held.jobs), self.isolation.num_waiting)

    def _run(self) -> None:
        host, engine = self.host, self.engine
        while not host.stopping():
            if not engine.has_unfinished():
                group = self.isolation.next_group()
                if group is None:
                    return
                self._start(group)
                continue
            host.housekeeping()
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # the group holds a culprit (or the engine is broken)
                self._log(exc)
                self._failed(exc)
                continue
            if self.isolation.behind:
                self._resume_streams()
            host.held.emit(outputs)
            host.after_step()

    def _failed(self, exc: Exception) -> None:
        """A step raised: empty the engine, then end the culprit or run the suspects halved."""
        self.host.counters["engine_failures"] += 1
        failure = self.isolation.failed(list(self.host.held.jobs),
                                        self.engine.stats()["num_steps"])
        self.engine.abort_all()  # (rebuilds what a step that raised half-way left inconsistent)
        if failure.broken:
            raise EngineBroken(f"engine.step() failed {self.isolation.streak} times in a row "
                               f"without a successful step ({_describe(exc)})")
        if failure.culprit is not None:
            self._convict(self.host.held.jobs[failure.culprit], exc)

    def _start(self, group: list[str]) -> None:
        """Put one group of suspects into the (empty) engine, each from its first token."""
        host = self.host
        for entry in group:
            job = host.held.jobs.get(entry)
            if job is None:
                continue  # ended while it waited (cancel, deadline, reclaimed by another worker)
            decided = host.admission.admit(entry, job.fields, job.deliveries)
            if isinstance(decided, Rejection):  # e.g. its deadline passed while it waited
                host.held.end_early(job, decided.code, decided.message)
                continue
            self._rewind(job, decided.params)
            try:
                self.engine.add_request(entry, decided.prompt, decided.params,
                                        host.priority_of(job))
            except Exception as exc:  # it was added once already; do not retry it
                host.held.end_early(job, "engine_error", _verdict(exc))

    def _rewind(self, job: ActiveJob, params: SamplingParams) -> None:
        """Forget what the job's last run produced; the re-run streams only past what its client
        already has."""
        streamed = {i: len(ids) for i, ids in job.token_ids.items()} if job.stream_tokens else {}
        same = params.temperature == 0 or params.seed is not None
        if self.isolation.rerun(job.entry_id, streamed, same):
            job.stream_tokens = False
        job.token_ids, job.texts, job.top_logprobs, job.logprob_rows = {}, {}, {}, {}
        self.host.held.last_tokens_at.pop(job.entry_id, None)

    def _resume_streams(self) -> None:
        """Before a step's events are built: a re-run that caught up with what its client has
        streams again, from exactly that position (one token per sequence per step)."""
        jobs = self.host.held.jobs
        produced = {entry: {i: len(ids) for i, ids in jobs[entry].token_ids.items()}
                    for entry in self.isolation.behind if entry in jobs}
        for entry in self.isolation.caught_up(produced):
            jobs[entry].stream_tokens = True

    def _convict(self, job: ActiveJob, exc: Exception) -> None:
        self._probe(exc)
        log.warning("job %s (entry %s) fails engine.step() on its own: ending it with "
                    "engine_error (%s)", job.job_id, job.entry_id, _describe(exc))
        self.host.counters["culprits"] += 1
        self.host.held.end_early(job, "engine_error", _verdict(exc))

    def _probe(self, exc: Exception) -> None:
        """Run a tiny greedy request of our own, alone: if it fails too, the engine is broken."""
        engine = self.engine
        request_id = f"genq-probe-{next(_probe_ids)}"
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        try:
            engine.add_request(request_id, list(_PROBE_PROMPT), params)
            for _ in range(_PROBE_STEPS):
                if not engine.has_unfinished():
                    break
                engine.step()
            else:
                raise RuntimeError(f"the probe did not finish in {_PROBE_STEPS} steps")
        except Exception as probe_exc:
            self.engine.abort_all()
            raise EngineBroken(f"engine.step() failed ({_describe(exc)}) and so did a probe "
                               f"request of the worker's own, alone in the engine "
                               f"({_describe(probe_exc)})") from probe_exc

    def _log(self, exc: Exception) -> None:
        key = (type(exc).__name__, str(exc))
        waiting = self.isolation.num_waiting
        in_engine = len(self.host.held.jobs) - waiting
        if key in self._logged:
            log.warning("engine.step() raised again (%s) with %d suspect(s) in the engine, %d "
                        "waiting", _describe(exc), in_engine, waiting)
            return
        self._logged.add(key)
        log.warning("engine.step() raised %s with %d suspect(s) in the engine, %d waiting",
                    _describe(exc), in_engine, waiting, exc_info=exc)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _verdict(exc: BaseException) -> str:
    return f"the engine failed on this job: {_describe(exc)}"[:_MESSAGE_CHARS]
