"""The one place genq makes Redis connections: every client, worker thread, writer process,
gateway pool, status and bench call comes through `connect` or `connect_async`.

URLs:
- `redis://[user:pass@]host:port/db`, `rediss://...` (TLS), `unix:///path.sock?db=N`: one server.
- `redis+sentinel://[user:pass@]host:port[,host:port...]/service_name[/db]`, and
  `rediss+sentinel://...` for TLS to the sentinels and the data nodes: the primary that the
  sentinels name for service_name, found again after a failover. The credentials in the URL are
  the data nodes'; sentinels that need their own take `?sentinel_username=...&sentinel_password=`.
  Other query parameters (ssl_ca_certs, ssl_cert_reqs, ...) apply to both.

Rules a failover relies on: a sentinel-managed connection that meets READONLY (the node it holds
was demoted) drops itself and raises ConnectionError, so every caller's retry of a lost
connection asks the sentinels again and reaches the new primary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from redis.connection import parse_url

# Refusals that pass, retried as a lost connection is: Redis loading its data, out of memory
# (maxmemory, noeviction), or a replica (a failover demoted it; the name moves to the new
# primary). (The last two are ResponseErrors: catch RETRYABLE first.)
RETRYABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError,
             redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)
SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
DIRECT_SCHEMES = ("redis", "rediss", "unix")
CONNECT_TIMEOUT = 5.0
_SENTINEL_ONLY = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class Target:
    """A parsed URL: one server (`url`), or a sentinel-watched service."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    node_kwargs: dict[str, Any] = field(default_factory=dict)
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_sentinel(self) -> bool:
        return bool(self.sentinels)


def _usage(url: str, why: str) -> ValueError:
    scheme = url.split("://", 1)[0] if "://" in url else "?"
    return ValueError(f"bad Redis URL ({scheme}://...): {why}. Use redis://host:port/db, "
                      "rediss://..., unix:///path.sock, or "
                      "redis+sentinel://host:port[,host:port]/service_name[/db]")


def parse(url: str) -> Target:
    """The connection target of `url`; ValueError naming what is wrong (never echoing a
    password)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in DIRECT_SCHEMES:
        parse_url(url)  # raises ValueError on a malformed URL
        return Target(url=url)
    if scheme.endswith("+cluster"):
        raise _usage(url, "Redis Cluster is not supported yet (its keys would cross slots); "
                          "use one primary, or Sentinel for failover")
    if scheme not in SENTINEL_SCHEMES:
        raise _usage(url, f"unknown scheme {scheme!r}" if scheme else "no scheme")
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, _, hostlist = netloc.rpartition("@")
    sentinels = []
    for hostport in hostlist.split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep:
            host, port = hostport, "26379"
        host = host.strip("[]")
        if not host or not port.isdigit():
            raise _usage(url, f"sentinel address {hostport!r} is not host:port")
        sentinels.append((host, int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise _usage(url, "the path must be /service_name or /service_name/db")
    if len(path) == 2 and not path[1].isdigit():
        raise _usage(url, f"the database {path[1]!r} is not a number")
    query = dict(parse_qsl(parts.query))
    sentinel_auth = {k.removeprefix("sentinel_"): query.pop(k) for k in _SENTINEL_ONLY
                     if k in query}
    base = SENTINEL_SCHEMES[scheme]
    db = path[1] if len(path) == 2 else "0"
    shared = parse_url(f"{base}://localhost/0?{urlencode(query)}")
    node = parse_url(f"{base}://{userinfo + '@' if userinfo else ''}localhost/{db}"
                     f"?{urlencode(query)}")
    for kwargs in (shared, node):
        for key in ("host", "port", "connection_class"):
            kwargs.pop(key, None)
        if base == "rediss":
            kwargs["ssl"] = True
    shared.pop("db", None)
    return Target(url=url, sentinels=tuple(sentinels), service=unquote(path[0]),
                  node_kwargs=node, sentinel_kwargs={**shared, **sentinel_auth})


def _timeouts(socket_timeout: float) -> dict[str, Any]:
    return {"socket_timeout": socket_timeout, "socket_connect_timeout": CONNECT_TIMEOUT}


def connect(url: str, *, socket_timeout: float = 5.0) -> redis.Redis:
    """A blocking-API client of the fleet's Redis (RESP2: the scripts' replies are read as
    such). `socket_timeout` must exceed any BLOCK time the caller uses."""
    target = parse(url)
    if not target.is_sentinel:
        return redis.Redis.from_url(url, protocol=2, **_timeouts(socket_timeout))
    manager = redis.sentinel.Sentinel(
        list(target.sentinels), sentinel_kwargs={**target.sentinel_kwargs,
                                                 **_timeouts(CONNECT_TIMEOUT)})
    return manager.master_for(target.service, protocol=2, **target.node_kwargs,
                              **_timeouts(socket_timeout))


class _BlockingSentinelPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """A sentinel-managed pool that waits for a free connection instead of refusing one."""


def connect_async(url: str, *, socket_timeout: float = 5.0,
                  max_connections: int | None = None) -> aioredis.Redis:
    """connect() for asyncio. With max_connections, at most that many connections are open and a
    caller past the cap waits for one (the gateway's pools)."""
    target = parse(url)
    pool: dict[str, Any] = {} if max_connections is None else {
        "max_connections": max_connections, "timeout": None}
    if not target.is_sentinel:
        if max_connections is None:
            return aioredis.Redis.from_url(url, protocol=2, **_timeouts(socket_timeout))
        return aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            url, protocol=2, **pool, **_timeouts(socket_timeout)))
    manager = aiosentinel.Sentinel(
        list(target.sentinels), sentinel_kwargs={**target.sentinel_kwargs,
                                                 **_timeouts(CONNECT_TIMEOUT)})
    pool_class = aiosentinel.SentinelConnectionPool if max_connections is None \
        else _BlockingSentinelPool
    return manager.master_for(target.service, connection_pool_class=pool_class, protocol=2,
                              **pool, **target.node_kwargs, **_timeouts(socket_timeout))
