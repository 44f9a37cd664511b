"""`clora demo`: the whole platform teaching four tenants four different skills, live.

    clora demo [--minutes 10] [--eval-size 20] [--tenants calc,support,extract,greet[,shop]]

It brings up the embedded stack (broker, Redis, webhook, ingest, learner, vLLM serving,
console) on SmolLM2-135M-Instruct, creates the tenants and runs their agents
concurrently through the OpenAI gateway:

| tenant    | environment | what it learns                                          | from            |
|-----------|-------------|---------------------------------------------------------|-----------------|
| `calc`    | arithmetic  | call the calculator, then final_answer (tool use; one-operation problems) | corrections |
| `support` | support     | greet the customer by name, cite the order, sign off    | corrections     |
| `extract` | structured  | answer with exactly the JSON object asked for           | corrections     |
| `greet`   | support     | greet the customer by name                              | thumbs only     |
| `shop`    | retail      | serve a store's customers over many turns with its tools (only when named) | corrections |

The first three get every answer's reward as feedback (source `environment`; their `sft`
policy does not train on it) and a simulated operator corrects their wrong answers (source
`operator`). `greet` gets only a simulated user's thumbs up or down on each single reply
(source `user`, key `thumbs`, 10% flipped): no correction, no group, no environment reward.
All of it goes through the webhook, as production's would. The learner trains each tenant,
publishes versions, and serving hot-swaps them in. The terminal shows per-tenant progress; the console plots it. The demo ends with
each tenant's held-out scores of the base model vs its final adapter, side by side on two sets:
problems phrased as the traffic is (`same`) and the same tasks in phrasings the traffic never
uses (`unseen`). A final score high on `same` and low on `unseen` means the adapter learned the
traffic's templates rather than the skill.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from clora.agents.envs import ArithmeticEnv, RetailEnv, StructuredEnv, SupportEnv
from clora.agents.envs.base import TaskEnv
from clora.agents.envs.support import RULES as SUPPORT_RULES
from clora.agents.feedback import FeedbackClient
from clora.agents.runtime import Agent
from clora.agents.simulate import (HeldOutScores, OperatorSimulator, StepReport, TenantTraffic, ThumbsUser,
                                   evaluate_held_out)
from clora.ids import served_name

if TYPE_CHECKING:
    from clora.settings import PlatformSettings


@dataclass(frozen=True)
class DemoTenant:
    """One demo tenant. Example: `DemoTenant("greet", SupportEnv(rules=...), THUMBS_POLICY,
    feedback="thumbs", task="support greeting")` learns from a user's thumbs alone."""

    id: str
    env: TaskEnv
    policy: dict
    feedback: str = "corrections"
    """What teaches it: `corrections` (a simulated operator fixes wrong answers) or `thumbs`
    (a simulated user's noisy thumbs up/down on single replies, nothing else)."""
    task: str | None = None
    """The task's name in the tables (default: the environment's)."""
    max_turns: int = 3
    """Model calls per episode at most."""
    max_tokens: int = 48
    """max_tokens per model call."""


POLICY = {"algorithm": "sft", "learning_rate": 2e-3, "batch_size": 8, "min_new_examples": 2, "fresh_fraction": 1.0}
"""Every demo tenant learns from operator corrections (SFT), sized for SmolLM2-135M: the
support style and the JSON task need about ten steps at batch 8. The traffic makes corrections
faster than one training core consumes them, so every batch takes new corrections first
(`fresh_fraction` 1): replaying old ones while new ones wait halves the distinct examples a
step sees, and a step on new examples teaches more than one on half-replayed ones."""

CALC_POLICY = POLICY | {"batch_size": 4, "weight": 4.0, "eval_tolerance": 1.0}
"""The calculator task needs ~3x the steps (the tool-call format, then the right expression),
on sequences ~3x longer (the tool signatures sit in the prompt): half-size batches, and four
times the other tenants' share of learner time. Its problems are the one-operation ("easy")
kind: on 2 CPU cores ten minutes are not enough for two- and three-step ones.

Its publish gate is loose (a candidate may be up to 2x live's held-out loss): the skill has two
turns, and the second turn's data (final_answer after a right calculator result) only comes
from traffic once a version that gets the first turn right is served. A tight gate deadlocks
that: a candidate far better on the first turn can be worse on the few second-turn held-out
examples, so it never ships, so the traffic never produces the second-turn corrections that
would fix it."""

THUMBS_POLICY = {"algorithm": "auto", "unpaired": "kto", "kto_desirable_weight": 4.0, "learning_rate": 2e-3,
                 "batch_size": 8, "min_new_examples": 8, "eval_tolerance": 1.0,
                 "reward_spec": {"keys": {"thumbs": {"type": "bool", "sources": ["user"]}}}}
"""The thumbs tenant hears only a user's thumbs: the reward spec takes `thumbs` from users, and
`auto` trains each thumbed reply (nothing else reaches its buffer) with KTO: a thumbed-up reply
is desirable, a thumbed-down one undesirable. About 1 reply in 7 earns a thumbs up at first, so
a desirable reply weighs 4x an undesirable one (`kto_desirable_weight`; the KTO paper keeps
lambda_D * desirable / (lambda_U * undesirable) between 1 and 4/3).

Its publish gate is loose (up to 2x live's held-out loss), as calc's is: the held-out loss of a
thumbs-only tenant is the likelihood of its few held-out thumbed-up replies, a tenth of them
flipped, which says little about what users will like; with the default tolerance it refused
every candidate after the second in a run here. What protects it instead is what its versions
earn once served: the reward guard rolls back a version whose thumbs fall, the reward-hacking
guard one whose replies degenerate, and the forgetting guard refuses one that drifts from the
base."""

THUMBS_NOISE = 0.1
"""Share of the simulated user's thumbs that are flipped."""

TENANTS = (
    DemoTenant("calc", ArithmeticEnv(difficulties=("easy",)), CALC_POLICY),
    DemoTenant("support", SupportEnv(), POLICY),
    DemoTenant("extract", StructuredEnv(), POLICY),
    DemoTenant("greet", SupportEnv(rules=tuple(r for r in SUPPORT_RULES if r.name == "greets_by_name")),
               THUMBS_POLICY, feedback="thumbs", task="support: greet by name (thumbs only)"),
)
"""`greet`'s users like a reply that greets them by name ("Hi Maria,") and say so with a
thumbs up; nothing tells the model what they want but the thumbs. The base model greets by
name in about 1 reply in 10 at the traffic's temperature, which is what a policy gradient
needs to start from: it can raise what the model sometimes does, not invent what it never
does."""

SHOP_POLICY = CALC_POLICY
"""The retail tenant learns, like calc, a tool-call format and then a path of several turns
(identify the customer, look the order up, confirm, act, report), each turn's correction only
reachable once the turns before it are served right: the same small batches, large share and
loose gate."""

OPTIONAL_TENANTS = (
    DemoTenant("shop", RetailEnv(difficulties=("easy",)), SHOP_POLICY, task="retail: customer service (easy)",
               max_turns=RetailEnv.max_turns, max_tokens=64),
)
"""Tenants the demo runs only when `--tenants` names them: `shop`'s conversations take up to
10 model calls each on prompts that carry eight tool schemas, several times another tenant's
serving time on 2 cores."""

FINAL_EVAL_RESERVE = 1.8
"""Time left for the final evaluation, in units of the base evaluation's time, with a margin:
the adapters' evaluation takes longer than the base's (LoRA decoding on CPU is slower, and once
calc has learned to call its tools each problem takes two or three model calls). Both evaluations
score the same two held-out sets (same-template and unseen, `eval_size` problems each, at the
same concurrency), so the unseen set's pass is in the unit and the reserve covers it."""

PLATFORM_DEFAULTS = {
    "CLORA_LEARNER_EVAL_MAX_EXAMPLES": "12",     # the publish gate evaluates on 12 held-out examples, not 64
    "CLORA_LEARNER_PUBLISH_EVERY": "2",          # gate + publish after every 2nd step of a tenant
    "CLORA_LEARNER_IDLE_SLEEP_S": "0.2",
    "CLORA_GATEWAY_REGISTRY_POLL_S": "0.5",
    "CLORA_LEARNER_NUM_THREADS": "1",            # one core trains ...
    "CLORA_ENGINE_RESERVED_CPUS": "1",           # ... the other serves: no OpenMP threads fighting over a core
}
"""Learner, gateway and engine settings the demo uses unless the environment sets them: on 2
cores every second spent evaluating is a second not spent training."""

AHEAD = 2
"""Traffic steps a tenant may run ahead of its learner steps: rollouts compete with training
for the same CPU, and corrections the learner cannot consume yet teach nothing."""


@dataclass
class Progress:
    """What the live table shows for one tenant."""

    tenant: str
    task: str
    base: HeldOutScores | None = None
    """The base model's held-out scores (same-template and unseen)."""
    final: HeldOutScores | None = None
    """The final adapter's (version `score_version`)."""
    score_version: int | None = None
    steps: int = 0
    rollouts: int = 0
    corrections: int = 0
    thumbs: int = 0
    """Thumbs up/down the simulated user sent (a thumbs tenant)."""
    reward: float | None = None
    errors: int = 0
    live_version: int | None = None
    rollbacks: int = 0
    """Versions the reward guard rolled back."""
    learner_steps: int = 0
    freshness_p50: float | None = None
    """Median seconds from a feedback event's 202 to the first completion served by the version
    first trained on it (`/api/tenants/<id>/freshness`); None when no trained version served."""
    history: list = field(default_factory=list)


class Demo:
    def __init__(self, minutes: float, eval_size: int, console: Console, tenants: tuple[DemoTenant, ...] = TENANTS):
        self.minutes, self.eval_size, self.console, self.tenants = minutes, eval_size, console, tenants
        self.progress = {t.id: Progress(t.id, t.task or _task(t.env)) for t in tenants}
        self.stop = threading.Event()
        self.deadline = float("inf")
        """When the learning phase ends (monotonic clock)."""

    # --- wiring -------------------------------------------------------------------------

    def run(self) -> dict:
        """Start a fresh platform, measure the base model, learn until the budget leaves just
        enough time for the final evaluation, evaluate the final adapters, report."""
        from clora.infra.platform import Platform
        from clora.settings import PlatformSettings

        started = time.monotonic()
        settings = self._fresh_settings(PlatformSettings())
        self.console.print(f"[bold]clora demo[/]: starting the platform in {settings.data_dir} "
                           "(the first run converts the base model, ~1 min) ...")
        with Platform(settings) as platform:
            platform.print_summary(self.console)
            urls = platform.urls()
            admin = {"Authorization": f"Bearer {platform.admin_token()}"}
            keys = self._tenants(urls["console"], admin)
            agents = {t.id: self._agent(urls["gateway"], keys[t.id], t) for t in self.tenants}
            phases = {"startup_s": time.monotonic() - started}
            self.console.print(f"platform up in {phases['startup_s']:.0f} s; learning starts now, while the base "
                               f"model is measured on {self.eval_size} + {self.eval_size} held-out problems per "
                               "tenant (the traffic's phrasings + unseen ones) ...")
            # the base model's evaluation runs beside the first traffic steps (the learner has
            # nothing to train on yet). The final evaluation of the adapters takes longer than the
            # base's (LoRA decoding on CPU is slower, tool use takes more turns): learning stops
            # early enough to leave it FINAL_EVAL_RESERVE x the base evaluation's time (30% of the
            # budget until that is known)
            self.deadline = started + self.minutes * 60 * 0.7
            learn_started = time.monotonic()

            def base_eval() -> None:
                try:
                    for tid, scores in self._score_all(agents, base=True).items():
                        self.progress[tid].base = scores
                except Exception as e:  # noqa: BLE001 - the demo goes on; the table shows no base score
                    self.console.print(f"[red]the base model's evaluation failed[/] ({type(e).__name__}: {e}); "
                                       "its scores are left out")
                phases["base_eval_s"] = time.monotonic() - learn_started
                self.deadline = started + self.minutes * 60 - FINAL_EVAL_RESERVE * phases["base_eval_s"] - 10

            base = threading.Thread(target=base_eval, name="base-eval", daemon=True)
            base.start()
            self._learn(urls, keys, agents, admin, learn_started)
            base.join()
            phases["learning_s"] = time.monotonic() - learn_started
            # learning stops here: the learner's core goes to the evaluation, and the score belongs
            # to one version (the live one, pinned by name: a version the learner publishes after
            # this would otherwise be hot-swapped in halfway through the evaluation)
            for t in self.tenants:
                httpx.post(f"{urls['console']}/api/tenants/{t.id}/pause", headers=admin).raise_for_status()
            live = {t.id: self._live(urls["console"], admin, t.id) for t in self.tenants}
            self.console.print("learning phase over; evaluating every tenant's live adapter "
                               f"({', '.join(f'{k} ' + _version(v) for k, v in live.items())}) ...")
            eval_started = time.monotonic()
            for tid, scores in self._score_all(agents, pinned=live).items():
                p = self.progress[tid]
                p.final, p.score_version = scores, live[tid]
            phases["final_eval_s"] = time.monotonic() - eval_started
            for t in self.tenants:     # feedback -> served, over every version it served
                fresh = httpx.get(f"{urls['console']}/api/tenants/{t.id}/freshness", headers=admin).json()
                self.progress[t.id].freshness_p50 = fresh["p50_s"]
            phases["total_s"] = time.monotonic() - started
            result = self._report(phases)
        return result

    @staticmethod
    def _fresh_settings(base: PlatformSettings) -> PlatformSettings:
        """Every demo starts from nothing in its own data folder (`<data_dir>/demo/<time>`), so
        it shows learning from the base model; the converted base model is shared across runs."""
        import os

        for k, v in PLATFORM_DEFAULTS.items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("CLORA_LEARNER_MODELS_DIR", str((base.data_dir / "models").resolve()))
        run_dir = base.data_dir / "demo" / time.strftime("%Y%m%d-%H%M%S")
        return base.model_copy(update={"data_dir": run_dir})

    def _tenants(self, console_url: str, admin: dict) -> dict[str, str]:
        keys = {}
        for t in self.tenants:
            r = httpx.post(f"{console_url}/api/tenants", headers=admin, json={"id": t.id, "name": f"demo: {t.env.name}"})
            if r.status_code == 409:      # a previous demo run: issue a fresh key
                r = httpx.post(f"{console_url}/api/tenants/{t.id}/keys/rotate", headers=admin)
            r.raise_for_status()
            keys[t.id] = r.json()["api_key"]
            httpx.patch(f"{console_url}/api/tenants/{t.id}/policy", headers=admin, json=t.policy).raise_for_status()
        return keys

    @staticmethod
    def _agent(gateway: str, key: str, t: DemoTenant) -> Agent:
        from openai import OpenAI

        client = OpenAI(base_url=gateway + "/v1", api_key=key, max_retries=2, timeout=300)
        return Agent(client, t.id, tools=t.env.tools, max_turns=t.max_turns, temperature=0.7, max_tokens=t.max_tokens)

    def _score_all(self, agents: dict[str, Agent], base: bool = False,
                   pinned: dict[str, int | None] | None = None) -> dict[str, HeldOutScores]:
        """Held-out scores of every tenant at once, on both sets (their requests batch together in
        vLLM): the base model with `base`; else the version `pinned` names (`calc@v7`), else the
        live one."""
        import dataclasses

        def one(t: DemoTenant) -> HeldOutScores:
            version = (pinned or {}).get(t.id)
            model = "base" if base else t.id if version is None else served_name(t.id, version)
            probe = dataclasses.replace(agents[t.id], model=model)
            return evaluate_held_out(probe, t.env, self.eval_size, concurrency=10)

        with ThreadPoolExecutor(max_workers=len(self.tenants)) as pool:
            return dict(zip((t.id for t in self.tenants), pool.map(one, self.tenants)))

    @staticmethod
    def _live(console_url: str, admin: dict, tenant: str) -> int | None:
        return httpx.get(f"{console_url}/api/tenants/{tenant}/versions", headers=admin).json()["live"]

    # --- the learning phase -----------------------------------------------------------------

    def _learn(self, urls: dict, keys: dict, agents: dict, admin: dict, learn_started: float) -> None:
        """Drive every tenant's traffic until `self.deadline` (which may move while it runs).
        A tenant taught by corrections (SFT) needs no rollout groups: four different problems a
        step, one rollout each, so no two corrections are the same example. A thumbs tenant's
        step is one batch of single replies, each thumbed once."""
        thumbs = {t.id for t in self.tenants if t.feedback == "thumbs"}
        traffic = [TenantTraffic(t.id, agents[t.id], t.env, FeedbackClient(urls["webhook"], keys[t.id]),
                                 group_size=1, seed=i,
                                 **({"prompts_per_step": t.policy["batch_size"], "concurrency": 4,
                                     "user": ThumbsUser(noise=THUMBS_NOISE, seed=i)} if t.id in thumbs else
                                    {"prompts_per_step": 4, "concurrency": 4,
                                     "operator": OperatorSimulator(t.env, share=1.0, seed=i, follow=agents[t.id])}))
                   for i, t in enumerate(self.tenants)]

        def drive(tt: TenantTraffic) -> None:
            p, taught = self.progress[tt.tenant], 0
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                # paced: at most AHEAD teaching steps ahead of this tenant's learner (30 s cap)
                waited = time.monotonic()
                while (taught - p.learner_steps > AHEAD and time.monotonic() - waited < 30
                       and time.monotonic() < self.deadline):
                    time.sleep(0.25)
                report = tt.step()
                taught += (report.rewards_sent if tt.tenant in thumbs else report.corrections_sent) > 0
                self._record(report, thumbs=tt.tenant in thumbs)

        threads = [threading.Thread(target=drive, args=(tt,), daemon=True) for tt in traffic]
        for th in threads:
            th.start()
        last_line = 0.0
        # a terminal gets a live table; a log file gets a line per tenant every 30 s
        with Live(self._table(learn_started), console=self.console, refresh_per_second=1,
                  transient=False) if self.console.is_terminal else _NoLive() as live:
            while any(th.is_alive() for th in threads):
                for t in self.tenants:
                    p = self.progress[t.id]
                    info = httpx.get(f"{urls['console']}/api/tenants/{t.id}/metrics?n=2000", headers=admin).json()
                    p.learner_steps = sum(1 for pt in info["points"] if pt.get("loss") is not None)
                    versions = httpx.get(f"{urls['console']}/api/tenants/{t.id}/versions", headers=admin).json()
                    p.live_version = versions["live"]
                    p.rollbacks = sum(1 for v in versions["versions"] if v.get("rolled_back"))
                live.update(self._table(learn_started))
                if not self.console.is_terminal and time.monotonic() - last_line > 30:
                    last_line = time.monotonic()
                    for p in self.progress.values():
                        self.console.print(f"[{time.monotonic() - learn_started:4.0f} s] {p.tenant}: traffic step "
                                           f"{p.steps}, reward {_fmt(p.reward)}, corrections {p.corrections}, "
                                           f"learner steps {p.learner_steps}, live {_version(p.live_version)}"
                                           + (f", {p.rollbacks} rolled back" if p.rollbacks else ""))
                time.sleep(1.0)
        for th in threads:
            th.join()

    def _record(self, report: StepReport, thumbs: bool = False) -> None:
        p = self.progress[report.tenant]
        p.steps += 1
        p.rollouts += len(report.rollouts)
        p.corrections += report.corrections_sent
        p.thumbs += report.rewards_sent if thumbs else 0
        p.errors += len(report.errors)
        p.reward = report.mean_reward
        p.history.append((time.time(), report.mean_reward))

    def _table(self, since: float) -> Table:
        table = Table(title=f"clora demo — learning for {time.monotonic() - since:.0f} s ({self.minutes:.0f} min budget)")
        for col in ("tenant", "task", "base held-out (same / unseen)", "traffic steps", "rollouts",
                    "reward (last step)", "corrections", "thumbs", "learner steps", "live version", "rollbacks",
                    "errors"):
            table.add_column(col)
        for p in self.progress.values():
            table.add_row(p.tenant, p.task, _pair(p.base), str(p.steps), str(p.rollouts), _fmt(p.reward),
                          str(p.corrections), str(p.thumbs), str(p.learner_steps), _version(p.live_version),
                          str(p.rollbacks), str(p.errors))
        return table

    # --- the end ---------------------------------------------------------------------------

    def _report(self, phases: dict[str, float]) -> dict:
        table = Table(title="clora demo — held-out score, base model vs final adapter",
                      caption=f"same: {self.eval_size} problems phrased as the traffic is; unseen: {self.eval_size} "
                              "of the same tasks phrased as it never is")
        for col in ("tenant", "task", "base same", "base unseen", "final same", "final unseen", "version",
                    "learner steps", "corrections", "thumbs", "rollouts", "rollbacks", "feedback → served p50"):
            table.add_column(col)
        rows = []
        for p in self.progress.values():
            table.add_row(p.tenant, p.task, _fmt(_same(p.base)), _fmt(_unseen(p.base)), _fmt(_same(p.final)),
                          _fmt(_unseen(p.final)), _version(p.score_version), str(p.learner_steps),
                          str(p.corrections), str(p.thumbs), str(p.rollouts), str(p.rollbacks),
                          "—" if p.freshness_p50 is None else f"{p.freshness_p50:.0f} s")
            rows.append({"tenant": p.tenant, "task": p.task, "base_score": _same(p.base),
                         "base_unseen_score": _unseen(p.base), "score": _same(p.final),
                         "unseen_score": _unseen(p.final)}
                        | {k: getattr(p, k) for k in ("score_version", "learner_steps", "corrections", "thumbs",
                                                      "rollouts", "rollbacks", "errors", "freshness_p50")}
                        | {"reward_history": p.history})
        self.console.print(table)
        self.console.print(f"start-up {phases['startup_s']:.0f} s, base evaluation {phases['base_eval_s']:.0f} s, "
                           f"learning {phases['learning_s']:.0f} s, final evaluation {phases['final_eval_s']:.0f} s: "
                           f"whole demo {phases['total_s']:.0f} s (budget {self.minutes * 60:.0f} s)")
        result = {"tenants": rows, "phases": phases, "budget_s": self.minutes * 60, "eval_size": self.eval_size,
                  "time": time.time()}
        out = Path("bench-results/demo.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        self.console.print(f"wrote {out}")
        return result


class _NoLive:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, _table) -> None:
        pass


def _task(env: TaskEnv) -> str:
    """The environment's name, with its difficulties when it uses only some: "arithmetic (easy)"."""
    from clora.agents.envs.base import DIFFICULTIES

    return env.name if env.difficulties == DIFFICULTIES else f"{env.name} ({'/'.join(env.difficulties)})"


def _version(v: int | None) -> str:
    return "base" if v is None else f"v{v}"


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _same(s: HeldOutScores | None) -> float | None:
    return None if s is None else s.same


def _unseen(s: HeldOutScores | None) -> float | None:
    return None if s is None else s.unseen


def _pair(s: HeldOutScores | None) -> str:
    """"0.85 / 0.40" (same-template / unseen), "—" before the evaluation."""
    return "—" if s is None else f"{s.same:.2f} / {s.unseen:.2f}"


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def pick_tenants(names: str | None) -> tuple[DemoTenant, ...]:
    """The demo tenants named in a comma-separated list ("calc,greet", "calc,shop"); None or "":
    the four default ones (`TENANTS`; `OPTIONAL_TENANTS` only when named)."""
    if not names:
        return TENANTS
    by_id = {t.id: t for t in TENANTS + OPTIONAL_TENANTS}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if unknown := [n for n in wanted if n not in by_id]:
        raise ValueError(f"unknown demo tenant(s) {', '.join(unknown)}; choose from {', '.join(by_id)}")
    return tuple(by_id[n] for n in dict.fromkeys(wanted))


def main(minutes: float = 10.0, eval_size: int = 20, tenants: str | None = None) -> dict:
    import signal
    import sys

    signal.signal(signal.SIGTERM, _interrupt)     # SIGTERM stops the platform cleanly, as Ctrl-C does
    # a log file gets the tables whole (rich would fit them to 80 columns, cutting every cell)
    return Demo(minutes, eval_size, Console(width=None if sys.stdout.isatty() else 150), pick_tenants(tenants)).run()
