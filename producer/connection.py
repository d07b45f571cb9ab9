"""The one place genq makes Redis connections: every client, worker thread, writer process,
gateway pool, status and bench call comes through `connect` or `connect_async`.

URLs:
- `redis://[user:pass@]host:port/db`, `rediss://...` (TLS), `unix:///path.sock?db=N`: one server.
- `redis+sentinel://[user:pass@]host:port[,host:port...]/service_name[/db]`, and
  `rediss+sentinel://...` for TLS to the sentinels and the data nodes: the primary that the
  sentinels name for service_name, found again after a failover. The credentials in the URL are
  the data nodes'; sentinels that need their own take `?sentinel_username=...&sentinel_password=`.
  Other query parameters (ssl_ca_certs, ssl_cert_reqs, ...) apply to both.
- `redis+cluster://[user:pass@]host:port[,host:port...]`, and `rediss+cluster://...` for TLS: a
  Redis Cluster, found from any of the nodes named (genq's keys of one model share a slot:
  producer/protocol.py Keys). A plain URL that reaches a cluster node fails with a message that
  names the cluster URL (a MOVED answer says the node is one of many).

Rules a failover relies on: a sentinel-managed connection that meets READONLY (the node it holds
was demoted) drops itself and raises ConnectionError, so every caller's retry of a lost
connection asks the sentinels again and reaches the new primary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.connection as aioconnection
import redis.asyncio.sentinel as aiosentinel
import redis.cluster
import redis.connection
import redis.sentinel
from redis.connection import parse_url

# Refusals that pass, retried as a lost connection is: Redis loading its data, out of memory
# (maxmemory, noeviction), or a replica (a failover demoted it; the name moves to the new
# primary). (The last two are ResponseErrors: catch RETRYABLE first.)
RETRYABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError,
             redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
             # a cluster failing over, or a slot that moves under a multi-key command
             redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
             redis.exceptions.MasterDownError)


def retryable(exc: BaseException) -> bool:
    """A failure to retry as a lost connection is: RETRYABLE, or a blocked read its server
    ended with UNBLOCKED (it became a replica under the read: a failover; the read goes on)."""
    return isinstance(exc, RETRYABLE) or (isinstance(exc, redis.ResponseError)
                                          and str(exc).startswith("UNBLOCKED"))


SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
DIRECT_SCHEMES = ("redis", "rediss", "unix")
CONNECT_TIMEOUT = 5.0
# (WAIT counts the replicas of the one node a connection writes to; a cluster client's writes
# go to many)
NO_REPLICA_WAIT_ON_CLUSTER = ("waiting for replicas (WAIT) is not supported with a "
                              "redis+cluster:// URL: leave it 0 and set min-replicas-to-write on "
                              "the cluster's nodes")
_SENTINEL_ONLY = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class Target:
    """A parsed URL: one server (`url`), a sentinel-watched service, or a cluster's nodes."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    cluster_nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    node_kwargs: dict[str, Any] = field(default_factory=dict)
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_sentinel(self) -> bool:
        return bool(self.sentinels)

    @property
    def is_cluster(self) -> bool:
        return bool(self.cluster_nodes)


def _usage(url: str, why: str) -> ValueError:
    scheme = url.split("://", 1)[0] if "://" in url else "?"
    return ValueError(f"bad Redis URL ({scheme}://...): {why}. Use redis://host:port/db, "
                      "rediss://..., unix:///path.sock, "
                      "redis+sentinel://host:port[,host:port]/service_name[/db], or "
                      "redis+cluster://host:port[,host:port]")


def parse(url: str) -> Target:
    """The connection target of `url`; ValueError naming what is wrong (never echoing a
    password)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in DIRECT_SCHEMES:
        parse_url(url)  # raises ValueError on a malformed URL
        return Target(url=url)
    if scheme not in SENTINEL_SCHEMES and scheme not in CLUSTER_SCHEMES:
        raise _usage(url, f"unknown scheme {scheme!r}" if scheme else "no scheme")
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    is_cluster = scheme in CLUSTER_SCHEMES
    nodes = _host_list(url, hostlist, 6379 if is_cluster else 26379)
    if is_cluster:
        return _cluster_target(url, CLUSTER_SCHEMES[scheme], userinfo, parts.path, parts.query,
                               nodes)
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
    return Target(url=url, sentinels=nodes, service=unquote(path[0]),
                  node_kwargs=node, sentinel_kwargs={**shared, **sentinel_auth})


def _host_list(url: str, hostlist: str, default_port: int) -> tuple[tuple[str, int], ...]:
    nodes = []
    for hostport in hostlist.split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep:
            host, port = hostport, str(default_port)
        host = host.strip("[]")
        if not host or not port.isdigit():
            raise _usage(url, f"node address {hostport!r} is not host:port")
        nodes.append((host, int(port)))
    return tuple(nodes)


def _cluster_target(url: str, base: str, userinfo: str, path: str, query: str,
                    nodes: tuple[tuple[str, int], ...]) -> Target:
    if path.strip("/") not in ("", "0"):
        raise _usage(url, "a cluster has only database 0: give no path")
    kwargs = parse_url(f"{base}://{userinfo + '@' if userinfo else ''}localhost/0?{query}")
    for key in ("host", "port", "connection_class", "db"):
        kwargs.pop(key, None)
    if base == "rediss":
        kwargs["ssl"] = True
    return Target(url=url, cluster_nodes=nodes, node_kwargs=kwargs)


# Without a cap of its own a pool opens what its callers need at once (a stream's XREAD BLOCK
# holds one while it waits): redis-py 8 caps a pool at 100 by default and refuses the 101st
# concurrent caller ("Too many connections"), where earlier versions had no cap.
UNCAPPED = 2 ** 31


def _timeouts(socket_timeout: float) -> dict[str, Any]:
    return {"socket_timeout": socket_timeout, "socket_connect_timeout": CONNECT_TIMEOUT}


def connect(url: str, *, socket_timeout: float = 5.0) -> redis.Redis:
    """A blocking-API client of the fleet's Redis (RESP2: the scripts' replies are read as
    such). `socket_timeout` must exceed any BLOCK time the caller uses. A cluster's client is a
    RedisCluster: it routes each command by its keys' slot and has the same command methods
    (typed as redis.Redis for the callers, which use only those)."""
    target = parse(url)
    if target.is_cluster:
        return cast(redis.Redis, redis.cluster.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in target.cluster_nodes],
            protocol=2, max_connections=UNCAPPED, **target.node_kwargs,
            **_timeouts(socket_timeout)))
    if not target.is_sentinel:
        return redis.Redis(connection_pool=redis.ConnectionPool.from_url(
            url, protocol=2, max_connections=UNCAPPED, **_timeouts(socket_timeout),
            connection_class=_single_node_class(url)))
    manager = redis.sentinel.Sentinel(
        list(target.sentinels), sentinel_kwargs={**target.sentinel_kwargs,
                                                 **_timeouts(CONNECT_TIMEOUT)})
    return manager.master_for(target.service, protocol=2, max_connections=UNCAPPED,
                              **target.node_kwargs, **_timeouts(socket_timeout))


class _BlockingSentinelPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """A sentinel-managed pool that waits for a free connection instead of refusing one."""


def connect_async(url: str, *, socket_timeout: float = 5.0,
                  max_connections: int | None = None) -> aioredis.Redis:
    """connect() for asyncio. With max_connections, at most that many connections are open and a
    caller past the cap waits for one (the gateway's pools; on a cluster, the cap is per node
    and a caller past it is refused); without, as many as the callers need at once."""
    target = parse(url)
    pool: dict[str, Any] = {"max_connections": UNCAPPED} if max_connections is None else {
        "max_connections": max_connections, "timeout": None}
    if target.is_cluster:
        return cast(aioredis.Redis, aiocluster.RedisCluster(
            startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in target.cluster_nodes],
            protocol=2, max_connections=max_connections or UNCAPPED, **target.node_kwargs,
            **_timeouts(socket_timeout)))
    if not target.is_sentinel:
        pool_type = aioredis.ConnectionPool if max_connections is None \
            else aioredis.BlockingConnectionPool
        return aioredis.Redis(connection_pool=pool_type.from_url(
            url, protocol=2, **pool, **_timeouts(socket_timeout),
            connection_class=_single_node_class_async(url)))
    manager = aiosentinel.Sentinel(
        list(target.sentinels), sentinel_kwargs={**target.sentinel_kwargs,
                                                 **_timeouts(CONNECT_TIMEOUT)})
    pool_class = aiosentinel.SentinelConnectionPool if max_connections is None \
        else _BlockingSentinelPool
    return manager.master_for(target.service, connection_pool_class=pool_class, protocol=2,
                              **pool, **target.node_kwargs, **_timeouts(socket_timeout))


# ------------------------------------------------------------------ a plain URL at a cluster

class ClusterNodeError(redis.exceptions.ResponseError):
    """A plain redis:// URL reached one node of a Redis Cluster (it answered MOVED or ASK)."""


def _cluster_refusal(exc: redis.exceptions.ResponseError, host: str, port: int) -> Exception:
    if not isinstance(exc, (redis.exceptions.MovedError, redis.exceptions.AskError)):
        return exc
    answer = f"{'MOVED' if isinstance(exc, redis.exceptions.MovedError) else 'ASK'} {exc}"
    return ClusterNodeError(
        f"{host}:{port} is a node of a Redis Cluster (it answered {answer[:40]!r}): connect "
        f"with redis+cluster://{host}:{port} (rediss+cluster:// for TLS) instead")


class _SingleNode:
    """Mixed into a connection class of a plain URL: a cluster's redirect says which URL to
    use instead of failing as an unknown error."""

    host: str
    port: int

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.exceptions.ResponseError as exc:
            raise _cluster_refusal(exc, self.host, self.port) from None


class _SingleNodeAsync:
    host: str
    port: int

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.exceptions.ResponseError as exc:
            raise _cluster_refusal(exc, self.host, self.port) from None


class _TCPNode(_SingleNode, redis.connection.Connection):
    pass


class _TLSNode(_SingleNode, redis.connection.SSLConnection):
    pass


class _TCPNodeAsync(_SingleNodeAsync, aioconnection.Connection):
    pass


class _TLSNodeAsync(_SingleNodeAsync, aioconnection.SSLConnection):
    pass


def _single_node_class(url: str) -> type[redis.connection.AbstractConnection]:
    if url.lower().startswith("unix:"):  # (a socket is never a cluster's address)
        return redis.connection.UnixDomainSocketConnection
    return _TLSNode if url.lower().startswith("rediss:") else _TCPNode


def _single_node_class_async(url: str) -> type[aioconnection.AbstractConnection]:
    if url.lower().startswith("unix:"):
        return aioconnection.UnixDomainSocketConnection
    return _TLSNodeAsync if url.lower().startswith("rediss:") else _TCPNodeAsync
