"""Example builders, fakes and comparisons shared by learner tests."""

from __future__ import annotations

from pathlib import Path

import torch

from clora.registry import LearningPolicy, Tenant
from clora.ingest.schemas import Message, PreferencePair, RLSample, SFTExample
from clora.learner.adapter_store import GRAD, AdapterStore
from clora.learner.base_model import load_base_model
from clora.learner.batches import ChatEncoder
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.optim import AdamConfig
from clora.learner.settings import LearnerSettings
from clora.learner.trainer import Trainer, TrainerConfig, TrainingPolicy


def _base(tenant: str, i: int) -> dict:
    return dict(example_id=f"{tenant}-{i}", tenant=tenant, interaction_id=f"i-{i}",
                feedback_event_id=f"fb-{i}", time=1000.0 + i)


def sft(tenant: str, i: int, question: str, answer: str) -> SFTExample:
    return SFTExample(**_base(tenant, i), messages=[Message(role="user", content=question)],
                      target=Message(role="assistant", content=answer))


def pref(tenant: str, i: int, question: str, chosen: str, rejected: str) -> PreferencePair:
    return PreferencePair(**_base(tenant, i), messages=[Message(role="user", content=question)],
                          chosen=Message(role="assistant", content=chosen),
                          rejected=Message(role="assistant", content=rejected))


def rl(tenant: str, i: int, question: str, answer: str, reward: float, group: str, **kw) -> RLSample:
    return RLSample(**_base(tenant, i), messages=[Message(role="user", content=question)],
                    response=Message(role="assistant", content=answer), reward=reward, group_id=group, **kw)


def sft_set(tenant: str, answer: str, n: int = 4) -> list[SFTExample]:
    return [sft(tenant, i, f"q{i}?", answer) for i in range(n)]


class FakeRegistry:
    """In-memory stand-in for clora.registry.Registry (the parts the learner uses)."""

    def __init__(self, tenants=()):
        self.tenants = {t.id: t for t in tenants}
        self.versions: dict[str, dict[int, object]] = {}
        self.live: dict[str, int | None] = {}
        self.history: dict[str, list[dict]] = {}
        self.alerts_by_tenant: dict[str, list] = {}
        self.lineages: dict[str, dict[int, object]] = {}
        self.floors: dict[str, int] = {}

    def list_tenants(self):
        return list(self.tenants.values())

    def get_tenant(self, tenant_id):
        from clora.registry import TenantNotFound

        if tenant_id not in self.tenants:
            raise TenantNotFound(f"no tenant {tenant_id!r}")
        return self.tenants[tenant_id]

    def update_policy(self, tenant_id, /, **changes):
        t = self.tenants[tenant_id]
        t.policy = LearningPolicy.model_validate({**t.policy.model_dump(), **changes})
        return t.policy

    def record_alert(self, tenant_id, alert):
        self.alerts_by_tenant.setdefault(tenant_id, []).insert(0, alert)

    def alerts(self, tenant_id, n=20):
        return self.alerts_by_tenant.get(tenant_id, [])[:n]

    def claim_version(self, tenant_id, at_least, *, fence=None):
        self.floors[tenant_id] = n = max(self.floors.get(tenant_id, 0) + 1, at_least)
        return n

    def record_adapter_version(self, tenant_id, version, *, fence=None):
        self.versions.setdefault(tenant_id, {})[version.version] = version

    def mark_rolled_back(self, tenant_id, version, note):
        self.versions[tenant_id][version] = self.versions[tenant_id][version].model_copy(update={"rolled_back": note})
        return self.versions[tenant_id][version]

    def adapter_versions(self, tenant_id):
        return [self.versions[tenant_id][v] for v in sorted(self.versions.get(tenant_id, {}))]

    def append_metrics(self, tenant_id, point):
        self.history.setdefault(tenant_id, []).append(point)

    def delete_adapter_versions(self, tenant_id, versions):
        for v in versions:
            self.versions.get(tenant_id, {}).pop(v, None)

    def set_live_version(self, tenant_id, version, *, fence=None):
        self.live[tenant_id] = version

    def live_version(self, tenant_id):
        return self.live.get(tenant_id)

    def record_lineage(self, tenant_id, version, lineage, *, fence=None):
        self.lineages.setdefault(tenant_id, {})[version] = lineage

    def lineage(self, tenant_id, version):
        from clora.freshness import VersionLineage

        return self.lineages.get(tenant_id, {}).get(version, VersionLineage())


class FakeBuffer:
    """In-memory stand-in for clora.ingest.buffers.ReplayBuffer's learner-facing reads."""

    def __init__(self):
        self.data: dict[tuple[str, str], list] = {}
        self.held: dict[tuple[str, str], list] = {}
        self.replies: dict[str, list] = {}
        """Per tenant, the `ReplyTraits` of every reply served (`serve`)."""

    def serve(self, tenant, traits):
        self.replies.setdefault(tenant, []).append(traits)

    def served_signals(self, tenant):
        from clora.ingest.signals import DIVERSITY_WINDOW, ServedSignals

        by_version: dict = {}
        for t in self.replies.get(tenant, []):
            by_version.setdefault(t.version, []).append(t)
        return {v: ServedSignals(n=len(ts), empty=sum(t.empty for t in ts), tool_calls=sum(t.tool_call for t in ts),
                                 bad_tool_calls=sum(t.bad_tool_call for t in ts), chars=sum(t.length for t in ts),
                                 chars_sq=sum(t.length ** 2 for t in ts),
                                 distinct=len({t.fingerprint for t in ts[:DIVERSITY_WINDOW]}))
                for v, ts in by_version.items()}

    def add(self, example, held_out: bool = False):
        (self.held if held_out else self.data).setdefault((example.tenant, example.kind), []).append(example)

    def newer_than(self, tenant, kind, cursor):
        return max(0, len(self.data.get((tenant, kind), [])) - cursor)

    def heldout(self, tenant, kind, n=None):
        return self.held.get((tenant, kind), [])[:n]

    def version_rewards(self, tenant):
        from clora.ingest.buffers import RewardTally

        by_version: dict = {}
        for store in (self.data, self.held):
            for e in store.get((tenant, "rl"), []):
                by_version.setdefault(e.adapter_version, []).append(e.reward)
        return {v: RewardTally(len(rs), sum(rs), sum(r * r for r in rs)) for v, rs in by_version.items()}

    def sample(self, tenant, kind, n, *, cursor=0, fresh_fraction=0.5, seed=None, fill=True):
        import random
        from types import SimpleNamespace

        items = self.data.get((tenant, kind), [])  # seq of items[i] is i + 1
        fresh = items[cursor:cursor + n]
        rng = random.Random(seed)
        old = [rng.choice(items[:cursor]) for _ in range(n - len(fresh))] if cursor and fill else []
        return SimpleNamespace(examples=fresh + old, cursor=cursor + len(fresh), fresh=len(fresh))


def mixed_work() -> dict[str, tuple[list, TrainingPolicy]]:
    """Tenants with different algorithms, batch sizes, sequence lengths and learning rates."""
    sft_p = TrainingPolicy(algorithm="sft", learning_rate=1e-2, batch_size=4)
    return {
        # answers of different lengths: the serial loss is a token mean per micro-batch, which
        # neither a per-sequence mean nor one token mean over the tenant's whole batch equals
        "acme": ([sft("acme", i, f"q{i}?", "yes" + " really" * (3 * i % 5)) for i in range(4)], sft_p),
        "beta": ([sft("beta", i, f"a much longer question {i}?", "no no no no") for i in range(3)],
                 sft_p.model_copy(update={"learning_rate": 3e-2})),
        "gamma": ([pref("gamma", i, f"pick {i}?", "good answer", "bad") for i in range(3)],
                  TrainingPolicy(algorithm="dpo", learning_rate=1e-2, batch_size=3)),
        "delta": ([rl("delta", i, f"2+{i}?", f"{2 + i}" if i % 2 else "five", float(i % 2), f"g{i // 2}")
                   for i in range(4)], TrainingPolicy(algorithm="rl", learning_rate=2e-2, batch_size=4)),
        "eps": ([rl("eps", i, "1+1?", "2", 1.0 - i, "g", prompt_token_ids=[1, 2, 3, 4], completion_token_ids=[5, 6, 7],
                    behaviour_logprobs=[-1.0, -2.0, -0.5]) for i in range(2)],
                TrainingPolicy(algorithm="rl", learning_rate=1e-2, batch_size=2)),
        # an agent's episodes: turn 1's prompt is turn 0's tokens + a tool result, so they pack
        # into one row (out of order here; 3 rows, 2 a micro-batch, for 5 samples)
        "zeta": (multi_turn_rl("zeta"), TrainingPolicy(algorithm="rl", learning_rate=1e-2, batch_size=5)),
        # a group where one sample was served through the gateway (tokens and logprobs) and one
        # came without (the chat template renders it; the current policy is its behaviour)
        "eta": (mixed_logprob_rl("eta"), TrainingPolicy(algorithm="rl", learning_rate=1e-2, batch_size=2)),
    }


def mixed_logprob_rl(tenant: str) -> list[RLSample]:
    return [rl(tenant, 0, "3+4?", "7", 1.0, "g", prompt_token_ids=[1, 2, 3, 4, 5], completion_token_ids=[6, 7],
               behaviour_logprobs=[-0.3, -4.0]),
            rl(tenant, 1, "3+4?", "eight", 0.0, "g")]


def multi_turn_rl(tenant: str) -> list[RLSample]:
    """Two two-turn episodes and a one-turn one in one group, with served tokens and logprobs."""
    p0 = [40, 41, 42, 43]
    turns = [  # (episode, prompt, completion, reward)
        (0, p0 + [44, 45, 46, 47, 48], [49, 50], 1.0),
        (1, p0, [51, 45, 52], 0.0),
        (2, p0, [53, 54], 0.5),
        (0, p0, [44, 45, 46], 1.0),
        (1, p0 + [51, 45, 52, 47, 55], [56, 57, 58], 0.0),
    ]
    return [rl(tenant, i, "2+2?", "x", reward, "g", prompt_token_ids=prompt, completion_token_ids=completion,
               behaviour_logprobs=[-0.4 - 0.1 * k for k in range(len(completion))])
            for i, (_, prompt, completion, reward) in enumerate(turns)]


def checkpointed(settings: LearnerSettings, tenant: str, numel: int):
    """`tenant`'s newest checkpoint under `settings.checkpoints_dir` (None: it has none)."""
    from clora.checkpoint_storage import LocalCheckpoints
    from clora.learner.checkpoint import Checkpoints, tenant_checkpoint

    return Checkpoints(LocalCheckpoints(settings.checkpoints_dir), numel).load(tenant_checkpoint(tenant))


def checkpointed_tenants(settings: LearnerSettings) -> list[str]:
    """The tenants with a checkpoint under `settings.checkpoints_dir`."""
    folder = Path(settings.checkpoints_dir) / "tenants"
    return sorted(p.name for p in folder.iterdir() if any(folder.glob(f"{p.name}/t*"))) if folder.is_dir() else []


def learner_world(root: Path) -> tuple[LearnerSettings, "FakeRegistry", "FakeBuffer"]:
    """A learner's surroundings: tenants `acme` (SFT) and `beta` (DPO) with 12 examples and one
    held-out example each, `idle` paused; adapters and checkpoints under `root`."""
    reg = FakeRegistry([
        Tenant(id="acme", policy=LearningPolicy(algorithm="sft", learning_rate=1e-2, batch_size=4, min_new_examples=4)),
        Tenant(id="beta", policy=LearningPolicy(algorithm="dpo", learning_rate=1e-2, batch_size=4, min_new_examples=4)),
        Tenant(id="idle", policy=LearningPolicy(paused=True)),
    ])
    buf = FakeBuffer()
    for i in range(12):
        buf.add(sft("acme", i, f"q{i}?", "blue"))
        buf.add(pref("beta", i, f"q{i}?", "yes", "no"))
    buf.add(sft("acme", 99, "q99?", "blue"), held_out=True)
    buf.add(pref("beta", 99, "q99?", "yes", "no"), held_out=True)
    settings = LearnerSettings(rank=4, alpha=8, adapters_dir=root / "adapters", max_seq_len=64,
                               checkpoints_dir=root / "ckpt", metrics_port=0, idle_sleep_s=0.01)
    return settings, reg, buf


COMPARISON_ADAM = AdamConfig(eps=1e-4)
"""Adam for tests that compare two runs: eps above the gradients' fp32 noise floor (~1e-8). With
the default 1e-8 an element whose exact gradient cancels to ~0 moves by up to lr in a direction
set by rounding noise (seen: 1.8e-8 solo vs 3.6e-8 fused -> 2e-3 apart after 3 steps; on an
H200, 1 of 512 elements 6.7e-5 apart from CPU after one step at lr 1e-2). Real gradients here
are 1e-3..1, far above 1e-4, so the update is still Adam's normalised step."""


def comparison_trainer(model_dir, spec: LoraSpec, *, device: str = "cpu", prefetch: bool = False,
                       micro_batch_size: int = 2) -> Trainer:
    """A trainer on the tiny model with `COMPARISON_ADAM`, for runs compared with each other."""
    model, tok = load_base_model(model_dir, device=device)
    lm = LoraModel(model, spec)
    return Trainer(lm, ChatEncoder(tok, 64), AdapterStore(lm, device=device, prefetch=prefetch),
                   TrainerConfig(micro_batch_size=micro_batch_size, adam=COMPARISON_ADAM))


def assert_states_close(want: Trainer, got: Trainer, tenants, rel_tol: float) -> None:
    """Each tenant's state in `got` equals `want`'s: step, examples seen and RNG state exactly;
    master weights and both Adam moments to `rel_tol` of each row's largest magnitude (which
    must not be 0: nothing trained); grad rows zeroed in both."""
    for t in tenants:
        a, b = want.store.state(t), got.store.state(t)
        assert b.step == a.step and b.examples_seen == a.examples_seen, t
        assert torch.equal(b.rng_state, a.rng_state), f"{t}: RNG state differs"
        for row, name in enumerate(("master", "exp_avg", "exp_avg_sq")):
            scale = float(a.buffer[row].abs().max())
            assert scale > 0, f"{t} {name} is all zeros: nothing was trained"
            torch.testing.assert_close(b.buffer[row].cpu(), a.buffer[row].cpu(), rtol=0, atol=rel_tol * scale,
                                       msg=lambda m: f"{t} {name}: {m}")
        assert b.buffer[GRAD].abs().sum() == 0 and a.buffer[GRAD].abs().sum() == 0
