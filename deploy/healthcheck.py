#!/usr/bin/env python3
"""Health probes for clora's containers (stdlib only). The image installs this file as
`clora-healthcheck`; compose healthchecks and Kubernetes probes call it:

    clora-healthcheck http http://127.0.0.1:8400/healthz      # healthy: a 2xx within --timeout
    clora-healthcheck heartbeat /tmp/clora-heartbeat 60       # healthy: the file was touched <= 60 s ago

The HTTP services (webhook, gateway, console, training API) answer a health URL on their own
port. The ingest worker and the learner serve no HTTP of their own: they touch the file named by
`CLORA_HEARTBEAT_FILE` once per pass of their main loop (`clora.procs.Heartbeat`), so a loop
blocked in a call shows as a stale file. Exit status 0 is healthy, 1 is not; the reason goes to
stderr, where `docker inspect` and `kubectl describe` show it.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def http_healthy(url: str, timeout_s: float) -> str | None:
    """None when `url` answers a 2xx within `timeout_s`, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:   # noqa: S310 (our own URL)
            return None if 200 <= response.status < 300 else f"{url} answered {response.status}"
    except urllib.error.HTTPError as e:
        return f"{url} answered {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return f"{url} did not answer: {e}"


def heartbeat_healthy(path: Path, max_age_s: float, now: float | None = None) -> str | None:
    """None when `path` was modified at most `max_age_s` ago, else why not."""
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return f"{path} does not exist: the service has not beaten yet"
    return None if age <= max_age_s else f"{path} last beaten {age:.0f} s ago (limit {max_age_s:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clora-healthcheck", description=__doc__.split("\n\n")[0])
    probes = parser.add_subparsers(dest="probe", required=True)
    http = probes.add_parser("http", help="a health URL answers 2xx")
    http.add_argument("url")
    http.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    beat = probes.add_parser("heartbeat", help="a heartbeat file is fresh")
    beat.add_argument("path", type=Path)
    beat.add_argument("max_age_s", type=float)
    args = parser.parse_args(argv)
    problem = (http_healthy(args.url, args.timeout) if args.probe == "http"
               else heartbeat_healthy(args.path, args.max_age_s))
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
