"""N independent RL experiments: one after another on fresh platforms vs all at once on one.

    python benchmarks/bench_experiments.py [--n 1,2,4,8 --steps 5 --algorithm rl --model smollm2]
                                           [--init-adapter ./my-lora]   # every tenant starts from it (v1)
    python benchmarks/bench_experiments.py --preset learn --init-adapter .clora/calc-sft6-adapter

The same as `clora bench experiments` (the logic lives in `clora.infra.experiments`, so
the installed CLI has it too). Prints a table (speedup, step growth beside the growth mode B's
measured core-seconds allow, time to the reward threshold) and the reward curves, writes
bench-results/experiments.json and bench-results/experiments.png (mean reward vs step per mode).
"""

import sys

from clora.infra.cli import app

if __name__ == "__main__":
    app(["bench", "experiments", *sys.argv[1:]], prog_name="clora")
