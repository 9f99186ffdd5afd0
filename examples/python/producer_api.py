#!/usr/bin/env python3
"""Enqueue order timeouts through orderdelay's HTTP API (standard library only).

    python3 producer_api.py SERIAL DEADLINE [SERIAL DEADLINE ...]

DEADLINE is the order's payment deadline as an RFC 3339 time with a zone,
for example 2026-12-01T10:00:00.123456Z: the expires_at your checkout
stored with the order. Settings come from the environment:

    ORDERDELAY_API_URL     default http://127.0.0.1:8080
    ORDERDELAY_API_TOKEN   sent as "Authorization: Bearer ..." when set

Exit status: 0 every order queued, 1 the API refused or failed, 2 bad arguments.
"""

import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime


def enqueue(api_url: str, token: str, serial: str, deadline: datetime) -> tuple[int, dict]:
    """PUT /v1/timeouts/{serial} {"at": deadline}: 201 queued, 200 already queued.

    Without "reschedule" the call is idempotent (a retry never moves the
    deadline), so retrying on a network error or a 503 is safe. Raises
    urllib.error.HTTPError on any other status (400 bad input, 401 token).
    """
    url = f"{api_url.rstrip('/')}/v1/timeouts/{urllib.parse.quote(serial, safe='')}"
    body = json.dumps({"at": deadline.isoformat()}).encode()
    req = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, json.load(resp)


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
    api_url = os.environ.get("ORDERDELAY_API_URL", "http://127.0.0.1:8080")
    token = os.environ.get("ORDERDELAY_API_TOKEN", "")
    for serial, deadline in orders:
        try:
            status, entry = enqueue(api_url, token, serial, deadline)
        except urllib.error.HTTPError as e:
            print(f"{serial}: PUT -> {e.code}: {e.read().decode(errors='replace').strip()}", file=sys.stderr)
            return 1
        except (urllib.error.URLError, OSError) as e:
            print(f"{serial}: PUT {api_url}: {e}", file=sys.stderr)
            return 1
        print(f"{serial}: PUT /v1/timeouts -> {status} {entry.get('result')}, "
              f"deadline {entry.get('deadline')} ({entry.get('deadline_ms')} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
