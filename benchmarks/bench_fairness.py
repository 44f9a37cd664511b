"""Fair shares under a 10:1 skew, serving and training, fairness off vs on in one run: the same
benchmark as `clora bench fairness` (see `clora.infra.fairness_bench`).

    python benchmarks/bench_fairness.py [--seconds 40 --slots 8 --light-tokens 16 --skew 10 --learner-seconds 90]

Prints a table and writes bench-results/fairness.json.
"""

from __future__ import annotations

import argparse
import logging

from clora.infra.fairness_bench import FairnessBenchConfig, main as run_bench


def main() -> None:
    defaults = FairnessBenchConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=defaults.seconds, help="length of each serving phase")
    ap.add_argument("--slots", type=int, default=defaults.slots, help="the engine's sequence slots")
    ap.add_argument("--light-tokens", type=int, default=defaults.light_tokens, help="tokens per light request")
    ap.add_argument("--skew", type=int, default=defaults.skew, help="heavy's offered load / light's")
    ap.add_argument("--window-s", type=float, default=None, help="Jain window (default: a third of a phase)")
    ap.add_argument("--learner-minutes", type=float, default=defaults.learner_minutes,
                    help="simulated training time per step-cost-model phase")
    ap.add_argument("--learner-seconds", type=float, default=defaults.learner_seconds,
                    help="real training time per real-learner phase (0: skip)")
    ap.add_argument("--learner-model", default=defaults.learner_model, help="tiny, smollm2 or an HF folder")
    ap.add_argument("--shares-phase", action="store_true",
                    help="also a serving phase with per-tenant shares on, after fair order alone, in the same run")
    ap.add_argument("--out", default=defaults.out)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    run_bench(FairnessBenchConfig(seconds=args.seconds, slots=args.slots, light_tokens=args.light_tokens,
                                  skew=args.skew, window_s=args.window_s, learner_minutes=args.learner_minutes,
                                  learner_seconds=args.learner_seconds, learner_model=args.learner_model,
                                  shares_phase=args.shares_phase, out=args.out))


if __name__ == "__main__":
    main()
