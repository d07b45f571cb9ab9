"""genq producer: what applications import to submit jobs (never imports torch or the engine)."""

from producer.async_client import AsyncClient, AsyncJob
from producer.client import Client, Job
from producer.errors import JobError, NotReplicated, ProtocolError, ResultExpired

__all__ = ["AsyncClient", "AsyncJob", "Client", "Job", "JobError", "NotReplicated",
           "ProtocolError", "ResultExpired"]
