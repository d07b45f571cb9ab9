"""Quarantine: what the worker does when engine.step() raises. A bad job never stops a worker.

After a step raised, the engine's state is not trusted: Engine.abort_all drops every request and
rebuilds the scheduler's queues and the block tables. The jobs that were in the engine are the
suspects. They run again from scratch, a group at a time, alone in the engine (the worker reads
no new jobs meanwhile), and a group that fails is halved:

    {a b c d e f} fails -> {a b c} passes; {d e f} fails -> {d} passes; {e f} fails -> {e} ...

A suspect that fails alone is a culprit once a probe (a tiny greedy request of the worker's own,
alone in the engine) shows the engine still serves: it ends with an error event (code
engine_error, naming the exception), fenced and acked like any finish, never dead-lettered.
Every other suspect completes with the output it would have had: greedy and seeded outputs do not
depend on the batch, and a re-run streams only the positions past what its client already has,
so the reply stream holds each (index, pos) once. The work is bounded: k suspects take at most
2k - 1 group runs and one probe per culprit.

It is the engine, not a job, when the probe fails too, or after _MAX_STREAK failed steps with
no successful one between: EngineBroken is raised, and the worker exits non-zero so that other
workers reclaim its jobs (as when a worker process dies).

The normal path pays nothing for this: the loop calls in here only from its except clause around
step(), and an isolation runs its own steps (below) until every suspect has ended. Those steps
are the loop's iteration without reading: they use the Worker's own writer feedback, cancels,
deadlines, _emit and _end_early (this module is worker/loop.py's friend, not a library).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from worker.admission import Rejection
from worker.jobs import ActiveJob

if TYPE_CHECKING:
    from worker.loop import Worker

log = logging.getLogger("genq.worker")
EXIT_ENGINE_BROKEN = 3  # genq worker's exit status when the engine fails whatever it runs
_MAX_STREAK = 32  # failed steps in a row, none succeeding between (bisection needs ~log2(k)+1)
_PROBE_PROMPT = [1, 2, 3, 4]  # token ids: every vocabulary has them
_PROBE_STEPS = 8  # a prefill and a decode step; more means the probe is stuck
_MESSAGE_CHARS = 500
_probe_ids = itertools.count(1)


class EngineBroken(RuntimeError):
    """The engine cannot serve (not one job's fault): the worker must exit."""


class Quarantine:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.groups: deque[list[str]] = deque()  # suspects (entry ids) waiting for their run
        # A re-run whose client already has tokens: entry -> tokens per sequence index the
        # client has; the re-run streams again from there (None: never, its tokens may differ).
        self.behind: dict[str, dict[int, int] | None] = {}
        self._steps_at_failure = -1  # the engine's num_steps at the last failure
        self._streak = 0  # failures in a row with no successful step between
        self._logged: set[tuple[str, str]] = set()  # (type, message) logged with a traceback

    # ------------------------------------------------------------------ the loop's entry point

    def isolate(self, exc: Exception) -> None:
        """engine.step() raised `exc`: end the culprit(s), re-run every other suspect to its end.
        Returns when no suspect is left (or when the worker stops: drain hands back the rest);
        raises EngineBroken when the engine cannot serve."""
        w = self.worker
        counters = w.counters
        self._logged = set()
        before = (counters["engine_failures"], counters["culprits"])
        log.error("engine.step() raised %s: %s; isolating the %d job(s) it was running (no "
                  "new jobs are read until that is done)", type(exc).__name__, exc,
                  len(w.held.jobs), exc_info=exc)
        self._logged.add((type(exc).__name__, str(exc)))
        started = time.monotonic()
        self._failed(exc)
        self._run()
        # (re-runs that ended while still behind their clients: nothing more to resume)
        self.behind = {e: had for e, had in self.behind.items() if e in w.held.jobs}
        log.info("isolation over in %.2f s: %d failed step(s), %d culprit(s) ended with "
                 "engine_error; %d job(s) held, %d left to re-run", time.monotonic() - started,
                 counters["engine_failures"] - before[0], counters["culprits"] - before[1],
                 len(w.held.jobs), sum(len(g) for g in self.groups))

    # ------------------------------------------------------------------ the isolation's steps

    def _run(self) -> None:
        w, engine = self.worker, self.engine
        while True:
            if w._drain_expired() or (w.stop_requested.is_set() and w._drain_end is None):
                return  # stopping: the drain runs what is in the engine and hands back the rest
            if not engine.has_unfinished():
                if not self.groups:
                    return
                self._start(self.groups.popleft())
                continue
            w._housekeeping()
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # the group holds a culprit (or the engine is broken)
                self._log(exc)
                self._failed(exc)
                continue
            if self.behind:
                self._resume_streams()
            w.held.emit(outputs)
            w._stats = engine.stats()
            w._wait_for_writer()

    def _failed(self, exc: Exception) -> None:
        """A step raised: abort the engine's requests, then convict or halve its suspects."""
        w = self.worker
        w.counters["engine_failures"] += 1
        steps = self.engine.stats()["num_steps"]
        self._streak = self._streak + 1 if steps == self._steps_at_failure else 1
        self._steps_at_failure = steps
        parked = {entry for group in self.groups for entry in group}
        suspects = [entry for entry in w.held.jobs if entry not in parked]  # the jobs in the engine
        self.engine.abort_all()  # (rebuilds what a step that raised half-way left inconsistent)
        if self._streak > _MAX_STREAK:
            raise EngineBroken(f"engine.step() failed {self._streak} times in a row without a "
                               f"successful step ({_describe(exc)})")
        if len(suspects) == 1:
            self._convict(w.held.jobs[suspects[0]], exc)
        elif suspects:
            half = (len(suspects) + 1) // 2
            self.groups.appendleft(suspects[half:])
            self.groups.appendleft(suspects[:half])

    def _start(self, group: list[str]) -> None:
        """Put one group of suspects into the (empty) engine, each from its first token."""
        w = self.worker
        for entry in group:
            job = w.held.jobs.get(entry)
            if job is None:
                continue  # ended while it waited (cancel, deadline, reclaimed by another worker)
            decided = w.admission.admit(entry, job.fields, job.deliveries)
            if isinstance(decided, Rejection):  # e.g. its deadline passed while it waited
                w.held.end_early(job, decided.code, decided.message)
                continue
            self._rewind(job, decided.params)
            try:
                self.engine.add_request(entry, decided.prompt, decided.params,
                                        w.priority_of(job))
            except Exception as exc:  # it was added once already; do not retry it
                w.held.end_early(job, "engine_error", _verdict(exc))

    def _rewind(self, job: ActiveJob, params: SamplingParams) -> None:
        """Forget what the job's last run produced; the re-run streams only past what its client
        already has (its tokens are the same when the job is greedy or seeded)."""
        entry = job.entry_id
        if entry not in self.behind and job.stream_tokens and job.token_ids:
            same = params.temperature == 0 or params.seed is not None
            self.behind[entry] = {i: len(ids) for i, ids in job.token_ids.items()} \
                if same else None
        if entry in self.behind:
            job.stream_tokens = False
        job.token_ids, job.texts, job.top_logprobs, job.logprob_rows = {}, {}, {}, {}
        self.worker.held.last_tokens_at.pop(entry, None)

    def _resume_streams(self) -> None:
        """Before a step's events are built: a re-run that caught up with what its client has
        streams again, from exactly that position (one token per sequence per step)."""
        jobs = self.worker.held.jobs
        for entry, had in list(self.behind.items()):
            job = jobs.get(entry)
            if job is None:
                del self.behind[entry]
            elif had is not None and all(len(job.token_ids.get(i, ())) >= n
                                         for i, n in had.items()):
                job.stream_tokens = True
                del self.behind[entry]

    # ------------------------------------------------------------------ verdicts

    def _convict(self, job: ActiveJob, exc: Exception) -> None:
        self._probe(exc)
        log.warning("job %s (entry %s) fails engine.step() on its own: ending it with "
                    "engine_error (%s)", job.job_id, job.entry_id, _describe(exc))
        self.behind.pop(job.entry_id, None)
        self.worker.counters["culprits"] += 1
        self.worker.held.end_early(job, "engine_error", _verdict(exc))

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
        parked = sum(len(g) for g in self.groups)
        if key in self._logged:
            log.warning("engine.step() raised again (%s) with %d suspect(s) in the engine, %d "
                        "waiting", _describe(exc), len(self.worker.held.jobs) - parked, parked)
            return
        self._logged.add(key)
        log.warning("engine.step() raised %s with %d suspect(s) in the engine, %d waiting",
                    _describe(exc), len(self.worker.held.jobs) - parked, parked, exc_info=exc)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _verdict(exc: BaseException) -> str:
    return f"the engine failed on this job: {_describe(exc)}"[:_MESSAGE_CHARS]
