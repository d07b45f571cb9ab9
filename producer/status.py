"""`genq status`: each queue (a model's lanes and shards) and each live worker, as a table or
JSON."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import redis

from producer.flags import DefaultsHelpFormatter, add_redis_args
from producer.lanes import split_lane
from producer.protocol import Keys, as_str, waiting_entries
from producer.registry import heartbeats


def status_main(argv: list[str]) -> int:
    from producer.client import connect

    parser = argparse.ArgumentParser(prog="genq status", description="queues and workers",
                                     formatter_class=DefaultsHelpFormatter)
    add_redis_args(parser)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    keys = Keys(args.prefix)
    conn = connect(args.redis)
    report = {"queues": queue_rows(conn, keys), "workers": worker_rows(conn, keys)}
    if args.json:
        print(json.dumps(report))
        return 0
    print(format_table(report["queues"], ["model", "shard", "lane", "length", "lag",
                                          "pending", "dead", "consumers"]))
    print()
    print(format_table(report["workers"], ["name", "model", "device", "heartbeat_age_s",
                                           "running", "waiting", "capacity", "kv_usage",
                                           "prefix_hits"]))
    return 0


def live_consumers(conn: Any, keys: Keys, model: str) -> int:
    """Consumers of the model's group whose worker heartbeat is alive (a dead worker stays a
    consumer until a reclaim pass deletes it)."""
    try:
        names = [c["name"] for c in conn.xinfo_consumers(keys.jobs(model), keys.group)]
    except redis.ResponseError:  # no such stream or group yet
        return 0
    return int(conn.exists(*(keys.worker(model, as_str(n)) for n in names))) if names else 0


def queue_rows(conn: Any, keys: Keys) -> list[dict[str, Any]]:
    """One row per job stream (a model's priority lane, producer/lanes.py), also of models no
    worker serves (a SCAN: on a cluster, the client's SCAN walks every primary; an operator's
    look, not a hot path). `dead` is the shard's (its lanes share one dead-letter stream)."""
    rows = []
    head = keys.jobs("m")[:-len("{m}")]
    for raw in sorted(conn.scan_iter(match=f"{head}{{*}}*", count=1000, _type="stream")):
        key = as_str(raw)
        lane = split_lane(key, keys)
        if lane is None:
            continue
        model, shard, lane_name = lane
        groups = {as_str(g["name"]): g for g in conn.xinfo_groups(key)}
        group = groups.get(keys.group, {})
        length = conn.xlen(key)
        pending = int(group.get("pending", 0))
        rows.append({"model": model, "shard": shard, "lane": lane_name, "length": length,
                     # (no group yet: no reader yet, all of it waits)
                     "lag": waiting_entries(group.get("lag"), pending, length) if group
                     else length,
                     "pending": pending, "dead": conn.xlen(keys.dead(model, shard)),
                     "consumers": live_consumers(conn, keys, model) if group else 0})
    return sorted(rows, key=lambda r: (r["model"], r["shard"], r["lane"]))


def worker_rows(conn: Any, keys: Keys) -> list[dict[str, Any]]:
    rows = []
    now = time.time()
    for model, name, info in heartbeats(conn, keys):
        total = info.get("num_total_blocks") or 0
        used = total - (info.get("num_free_blocks") or 0)
        rows.append({"name": name, "model": model,
                     "device": info.get("device"),
                     "heartbeat_age_s": round(now - float(info.get("ts", now)), 1),
                     "running": info.get("running"), "waiting": info.get("waiting"),
                     "capacity": info.get("capacity"),
                     "kv_usage": f"{100 * used / total:.0f}%" if total else "-",
                     # of prompt tokens, from the prefix cache (--enable-prefix-caching)
                     "prefix_hits": f"{100 * float(info.get('prefix_cache_hit_rate') or 0):.0f}%"
                     if info.get("prefix_caching") else "off"})
    return rows


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[str(c) for c in columns]] + [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    if not rows:
        lines.append("(none)")
    return "\n".join(lines)
