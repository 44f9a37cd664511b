"""Scale-out on one machine: ingest and serving throughput with 1 vs 2 instances, learner failover.

    python benchmarks/bench_scale.py [--events 10000 --requests 128 --concurrency 8 --lease-ttl 6]

The same as `clora bench scale` (the logic lives in `clora.infra.scale_bench`, so the installed
CLI has it too). On a 2-core machine the instances share the same cores: the numbers show that
scale-out is correct more than how it speeds up. Prints a table and writes bench-results/scale.json.
"""

import sys

from clora.infra.cli import app

if __name__ == "__main__":
    app(["bench", "scale", *sys.argv[1:]], prog_name="clora")
