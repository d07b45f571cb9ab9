"""The exceptions an application meets: a payload off the wire protocol, a job that ended in an
error or whose result expired, a submit that too few replicas acknowledged. No genq imports, so
every module can raise them without a cycle."""

from __future__ import annotations

from collections.abc import Sequence


class ProtocolError(ValueError):
    """A payload or name that does not follow the wire protocol.

    `code` is machine-readable (e.g. "unknown_field"); `job_id` is set when the payload's id was
    itself valid, so a worker can answer on that job's reply stream.
    """

    def __init__(self, code: str, message: str, job_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.job_id = job_id


class JobError(RuntimeError):
    """A job ended with an error event (code is e.g. "cancelled", "invalid_params")."""

    def __init__(self, job_id: str, code: str, message: str) -> None:
        super().__init__(f"job {job_id} failed ({code}): {message}")
        self.job_id = job_id
        self.code = code
        self.message = message


class ResultExpired(JobError):
    """The job ended, but its reply stream expired before it was read: waiting longer would
    never see it (code "result_expired")."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id, "result_expired",
                         "the job ended, but its reply stream has expired: reply streams live "
                         "the worker's --result-ttl (default 1 h) after the job ends; read "
                         "results within it, or raise it")


class NotReplicated(RuntimeError):
    """A submit reached the primary, but fewer replicas than `min_replicas` acknowledged it in
    time: a failover now could lose it. Submit again under the same job id (it runs once)."""

    def __init__(self, job_ids: Sequence[str], acks: int, wanted: int, timeout: float) -> None:
        shown = ", ".join(job_ids[:3]) + (f" and {len(job_ids) - 3} more" if len(job_ids) > 3
                                          else "")
        super().__init__(f"job {shown} reached the primary but {acks} of the {wanted} replicas "
                         f"wanted acknowledged it within {timeout:g} s: submit again with the "
                         "same job_id (it runs once), or lower min_replicas")
        self.job_ids = list(job_ids)
        self.acks = acks
