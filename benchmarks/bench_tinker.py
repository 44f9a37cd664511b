"""The Tinker-compatible API's cost: one RL step through the SDK vs the native learner step, and
1, 2, 4 concurrent SDK clients (one tenant each) vs the same clients one after another.

    python benchmarks/bench_tinker.py [--model tiny|smollm2 --steps 8 --clients 1,2,4 --batch 8 --seq-len 128]

The same as `clora bench tinker` (the logic lives in `clora.infra.tinker_bench`, so the installed
CLI has it too). Prints two tables and writes bench-results/tinker.json.
"""

import sys

from clora.infra.tinker_bench import main

if __name__ == "__main__":
    main(sys.argv[1:])
