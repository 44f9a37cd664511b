"""Many tenants on one engine replica: throughput, latency and time to first token when the
adapters in use are 1x, 2x and 4x the replica's adapter slots, against the in-cache case.

    python benchmarks/bench_tenants.py [--base tiny|smollm2] [--tenants 16,64,256] [--mix zipf,uniform]
                                       [--working-sets 1,2,4] [--slots 8] [--requests 64]

The same as `clora bench tenants` (the logic lives in `clora.infra.tenants_bench`, so the installed
CLI has it too). Prints a table and writes bench-results/tenants.json.
"""

import sys

from clora.infra.cli import app

if __name__ == "__main__":
    app(["bench", "tenants", *sys.argv[1:]], prog_name="clora")
