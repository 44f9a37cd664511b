"""What the learner reports: Prometheus metrics (`LearnerMetrics`: scheduler decisions, step
times, swaps, publishes) and each tenant's metrics history in the registry (`append_history`,
the console's charts).

Metrics live in an injected `CollectorRegistry` (the process passes the default one and
serves it over HTTP; tests pass a fresh one), so several learners can coexist in one test.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger(__name__)


class LearnerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.decisions = Counter("clora_learner_decisions", "Scheduler decisions", ["tenant", "reason"], registry=r)
        self.waiting = Gauge("clora_learner_waiting_examples", "New examples waiting per tenant", ["tenant"], registry=r)
        self.steps = Counter("clora_learner_steps", "Optimizer steps", ["tenant", "algorithm"], registry=r)
        self.step_seconds = Histogram("clora_learner_step_seconds", "Wall time of one optimizer step", ["tenant"],
                                      buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64), registry=r)
        self.tokens = Counter("clora_learner_tokens", "Target tokens trained on", ["tenant"], registry=r)
        self.loss = Gauge("clora_learner_loss", "Training loss of the last step", ["tenant"], registry=r)
        self.swap_exposed = Counter("clora_learner_swap_exposed_seconds", "Swap time not hidden by prefetch", registry=r)
        self.publishes = Counter("clora_learner_publishes", "Evaluation gate outcomes: published, rejected (held-out "
                                 "loss), drift (the forgetting guard), paused (by a guard)", ["tenant", "outcome"],
                                 registry=r)
        self.flat_batches = Counter("clora_learner_flat_batches", "RL batches consumed without a step: no group "
                                    "had a reward spread", ["tenant"], registry=r)
        self.gate_cache_hits = Counter("clora_learner_gate_cache_hits", "Publish gates that reused the live "
                                       "version's held-out loss instead of measuring it again", ["tenant"], registry=r)
        self.gate_live_examples = Counter("clora_learner_gate_live_examples", "Held-out examples a publish gate "
                                          "measured under the live version (the others came from its cache)",
                                          ["tenant"], registry=r)
        self.eval_loss = Gauge("clora_learner_eval_loss", "Held-out loss of the last candidate", ["tenant"], registry=r)
        self.failures = Counter("clora_learner_failures", "Steps that failed (the tenant waits, then tries again; "
                                "the others train on)", ["tenant"], registry=r)
        self.reward_rollbacks = Counter("clora_learner_reward_rollbacks", "Live versions the reward guard rolled "
                                        "back", ["tenant"], registry=r)
        self.drift = Gauge("clora_learner_drift", "KL divergence from the base (nats per token) of the last "
                           "candidate the forgetting guard measured", ["tenant"], registry=r)
        self.reward_hacking = Counter("clora_learner_reward_hacking", "Times the reward-hacking guard paused a "
                                      "tenant and rolled its live version back", ["tenant"], registry=r)


def append_history(registry, tenant: str, point: dict) -> None:
    """Append `point` to the tenant's metrics history (the console plots it), when the
    registry keeps one. Never fails a step: an error is logged."""
    append = getattr(registry, "append_metrics", None)
    if append is None:
        return
    try:
        append(tenant, point)
    except Exception:  # noqa: BLE001 - a console metric must not stop training; logged
        log.exception("could not record metrics for %s", tenant)
