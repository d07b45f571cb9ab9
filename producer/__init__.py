"""genq producer: what applications import to submit jobs (never imports torch or the engine)."""

from producer.async_client import AsyncClient, AsyncJob
from producer.client import Client, Job, JobError, ResultExpired
from producer.protocol import ProtocolError

__all__ = ["AsyncClient", "AsyncJob", "Client", "Job", "JobError", "ProtocolError",
           "ResultExpired"]
