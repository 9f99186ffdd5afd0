#!/usr/bin/env python3
"""Enqueue order timeouts for orderdelay with a raw ZADD (redis-py).

    python3 producer_zadd.py SERIAL DEADLINE [SERIAL DEADLINE ...]

DEADLINE is the order's payment deadline as an RFC 3339 time with a zone,
for example 2026-12-01T10:00:00.123456Z: the expires_at your checkout
stored with the order. Settings come from the environment:

    ORDERDELAY_REDIS_URL   default redis://127.0.0.1:6379/0
    ORDERDELAY_QUEUE_KEY   default orderdelay-demo:order (the demo's queue)

Exit status: 0 every order queued, 1 Redis failed, 2 bad arguments.
"""

import os
import sys
from datetime import datetime, timedelta, timezone

import redis

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def deadline_millis(deadline: datetime) -> int:
    """The ZADD score: the deadline in integer Unix milliseconds, rounded up.

    Rounding down would make the order due before its deadline; a score in
    seconds or a fractional one is dead-lettered by orderdelay, never closed.
    """
    if deadline.tzinfo is None:
        raise ValueError("deadline has no time zone")
    micros = (deadline - EPOCH) // timedelta(microseconds=1)
    return -(-micros // 1000)  # ceiling division


def enqueue(r: redis.Redis, queue_key: str, serial: str, deadline: datetime) -> bool:
    """Queue the order's timeout. NX: a retry never moves the deadline.

    Call it after the order row has committed. Returns True if the entry is
    new, False if the order was already queued (its deadline is kept).
    """
    return r.zadd(queue_key, {serial: deadline_millis(deadline)}, nx=True) == 1


def parse_deadline(text: str) -> datetime:
    d = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if d.tzinfo is None:
        raise ValueError("no time zone (add Z or an offset such as +01:00)")
    return d


def main(args: list[str]) -> int:
    if not args or len(args) % 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    orders = []
    for serial, text in zip(args[::2], args[1::2]):
        try:
            orders.append((serial, parse_deadline(text)))
        except ValueError as e:
            print(f"{serial}: deadline {text!r}: {e}", file=sys.stderr)
            return 2
    queue_key = os.environ.get("ORDERDELAY_QUEUE_KEY", "orderdelay-demo:order")
    r = redis.Redis.from_url(os.environ.get("ORDERDELAY_REDIS_URL", "redis://127.0.0.1:6379/0"))
    try:
        for serial, deadline in orders:
            added = enqueue(r, queue_key, serial, deadline)
            print(f"{serial}: ZADD {queue_key} NX {deadline_millis(deadline)} -> "
                  + ("queued" if added else "already queued, deadline kept"))
    except redis.RedisError as e:
        print(f"redis: {e}", file=sys.stderr)
        return 1
    finally:
        r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
