"""Feedback -> served latency under a steady stream of completions and corrections.

    python benchmarks/bench_freshness.py [--tenants 3 --minutes 5 --requests-per-s 0.5 --feedback-per-s 0.1]

The same as `clora bench freshness` (the logic lives in `clora.infra.freshness_bench`, so the
installed CLI has it too). Prints a table (p50 / p99 per tenant against publish -> served, the
baseline measured in the same run) and writes bench-results/freshness.json.
"""

import sys

from clora.infra.cli import app

if __name__ == "__main__":
    app(["bench", "freshness", *sys.argv[1:]], prog_name="clora")
