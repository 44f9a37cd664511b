"""The docs' examples that need a running platform, run as written against the real one
(tests/e2e/conftest.py `platform`: broker, Redis, vLLM, learner, gateway, webhook, console).

A fenced block right under `<!-- runs-on-platform -->` runs here: Python with this interpreter,
bash with `bash -euo pipefail`, each page's blocks in page order, in a working folder of the
page's own. What changes between the page and the run is what tests/e2e/docs_blocks.py says
(the platform's ports, `python3 dev.py clora`), and the tenant:

- Every page's `acme` is a tenant of the page's own (`acme` becomes `docs-<page>`, say
  `docs-sdk`), since the end-to-end tests share one platform. Before the page's first block
  the test creates it and puts its API key in the environment as `KEY`, and the platform's
  admin token as `ADMIN_TOKEN`: what a reader has after the README's quickstart.
- The marker's argument asks for another start:

      <!-- runs-on-platform: creates-tenant -->  the block creates `acme` itself; a `./my-lora`
                                                 it names is a PEFT LoRA folder of the learner's
                                                 layout, made in the working folder
      <!-- runs-on-platform: signed -->          `acme` (`docs-<page>-signed`) was created with
                                                 a signing secret, in the environment as `SECRET`
      <!-- runs-on-platform: two-versions -->    `acme` started from an imported adapter (v1) and
                                                 learned v2 (and maybe v3) from corrections, the
                                                 newest live

After the page's last block the test deletes the page's tenants (`clora tenant delete`), so
the platform the later tests share is left as it was. A block's failure names its page and line. Blocks that cannot run on a test machine say why
with `<!-- not-run: reason -->`; tests/test_docs.py checks that every fenced python, bash and
json block in docs/ carries exactly one marker.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .docs_blocks import Block, as_on_this_platform, marked_blocks, platform_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCKS = marked_blocks("runs-on-platform")
STARTS = {"", "creates-tenant", "signed", "two-versions"}
RUNNERS = {"python": [sys.executable, "-c"], "bash": ["bash", "-euo", "pipefail", "-c"]}


def page_tenant(page: str, start: str) -> str:
    """The tenant id a page's `acme` becomes: docs/guides/sdk.md + "signed" -> docs-sdk-signed."""
    return "-".join(["docs", Path(page).stem, *([start] if start and start != "creates-tenant" else [])])


def test_the_platform_blocks_are_marked_with_starts_this_module_knows():
    assert len({b.page for b in BLOCKS}) >= 6, [b.name for b in BLOCKS]
    assert {b.arg for b in BLOCKS} <= STARTS, [(b.name, b.arg) for b in BLOCKS if b.arg not in STARTS]
    assert {b.lang for b in BLOCKS} <= set(RUNNERS), [(b.name, b.lang) for b in BLOCKS]
    assert all(re.search(r"\bacme\b", b.code) for b in BLOCKS if b.arg), "a start prepares `acme`: name it"


class PageRun:
    """One page's blocks on the platform: its working folder, its tenants (made on first use),
    and the environment each block gets."""

    def __init__(self, platform: dict, workdir: Path, wait_for):
        self.platform, self.workdir, self.wait_for = platform, workdir, wait_for
        self.env = platform_env(platform, ADMIN_TOKEN=platform["token"])
        self.tenants: dict[str, dict[str, str]] = {}

    def cli(self, *args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "clora.infra.cli", *args, "--json"], env=self.env,
                             capture_output=True, text=True, timeout=120, cwd=self.workdir)
        assert out.returncode == 0, f"clora {' '.join(args)} exited {out.returncode}: {out.stderr[-2000:]}"
        return json.loads(out.stdout)

    def start(self, block: Block) -> dict[str, str]:
        """The environment `block` runs in, after its start (see the module docstring)."""
        tenant = page_tenant(block.page, block.arg)
        if block.arg == "creates-tenant":
            if "./my-lora" in block.code and not (self.workdir / "my-lora").exists():
                self.lora_folder(self.workdir / "my-lora")
            self.tenants.setdefault(tenant, {})
            return {}
        if tenant not in self.tenants:
            self.tenants[tenant] = self.create(tenant, block.arg)
        return self.tenants[tenant]

    def create(self, tenant: str, start: str) -> dict[str, str]:
        args = ["tenant", "create", tenant]
        if start == "signed":
            args.append("--signing-secret")
        if start == "two-versions":
            args += ["--adapter", str(self.lora_folder(self.workdir / f"{tenant}-lora"))]
        made = self.cli(*args)
        env = {"KEY": made["api_key"], **({"SECRET": made["signing_secret"]} if start == "signed" else {})}
        if start == "two-versions":
            self.learn_a_second_version(tenant, env["KEY"])
        return env

    def lora_folder(self, folder: Path) -> Path:
        """A PEFT LoRA folder that fits the platform learner's layout (rank, alpha, targets)."""
        import torch

        from clora.learner.base_model import load_base_model
        from clora.learner.lora import LoraModel, LoraSpec
        from clora.learner.peft_io import write_adapter

        env = self.platform["env"]
        model, _ = load_base_model(self.platform["model"])
        layout = LoraModel(model, LoraSpec(rank=int(env["CLORA_LEARNER_RANK"]),
                                           alpha=float(env["CLORA_LEARNER_ALPHA"]))).layout
        folder.mkdir(parents=True)
        flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(7)) * 0.01  # (P,)
        write_adapter(folder, layout, flat, str(self.platform["model"]))
        return folder

    def learn_a_second_version(self, tenant: str, key: str) -> None:
        """v1 is the import; corrections on served answers train v2, which goes live. Eight
        corrections for a step of four: some are held out for the gate, which is told to take
        any v2 (`eval_tolerance` 1): this start wants a second version, not a better one."""
        import httpx
        from clora_client import FeedbackClient

        self.wait_for(lambda: self.cli("tenant", "versions", tenant)["live"] == 1, 120, interval=0.5,
                      what=f"{tenant}'s imported adapter to be published as v1")
        self.cli("policy", "set", tenant, "algorithm=sft", "batch_size=4", "min_new_examples=4",
                 "learning_rate=0.02", "eval_tolerance=1")
        with FeedbackClient(self.platform["webhook"], key) as feedback:
            for colour in ["red", "green", "blue", "teal", "amber", "olive", "navy", "coral"]:
                r = httpx.post(f"{self.platform['gateway']}/v1/chat/completions", timeout=120,
                               headers={"Authorization": f"Bearer {key}"},
                               json={"model": tenant, "max_tokens": 8, "messages": [
                                   {"role": "user", "content": f"Greet a customer who likes {colour}."}]})
                assert r.status_code == 200, r.text
                feedback.correction(r.json()["id"], f"Hello! {colour.title()} it is.")
        try:
            # >= 2: its 8 corrections usually make two steps, and v3 may replace v2 between polls
            self.wait_for(lambda: (self.cli("tenant", "versions", tenant)["live"] or 0) >= 2, 300, interval=0.5,
                          what=f"{tenant} to learn and publish v2 from its corrections")
        except pytest.fail.Exception as e:
            pytest.fail(f"{e}\n{self.diagnosis(tenant)}")

    def diagnosis(self, tenant: str) -> str:
        """What a timed-out wait on `tenant` reports: its versions, and what the learner and the
        ingest workers logged of it (and the learner's last lines)."""
        logs = Path(self.platform["root"]) / "data" / "logs"
        parts = [f"--- clora tenant versions {tenant}\n{json.dumps(self.cli('tenant', 'versions', tenant))[-2000:]}"]
        for name in ("learner.log", "ingest-0.log"):
            lines = (logs / name).read_text(errors="replace").splitlines() if (logs / name).exists() else []
            parts.append(f"--- {name}, lines naming {tenant}\n" + "\n".join([ln for ln in lines if tenant in ln][-30:]))
            parts.append(f"--- {name}, last lines\n" + "\n".join(lines[-20:]))
        return "\n".join(parts)

    def delete_tenants(self) -> None:
        for tenant in self.tenants:
            assert self.cli("tenant", "delete", tenant, "--yes")
            assert tenant not in {t["id"] for t in self.cli("tenant", "list")["tenants"]}, f"{tenant} outlived its delete"

    def run(self, block: Block) -> subprocess.CompletedProcess:
        env = {**self.env, **self.start(block)}
        code = re.sub(r"\bacme\b", page_tenant(block.page, block.arg), as_on_this_platform(block.code, self.platform))
        return subprocess.run([*RUNNERS[block.lang], code], env=env, cwd=self.workdir, capture_output=True,
                              text=True, timeout=300)


@pytest.mark.parametrize("page", sorted({b.page for b in BLOCKS}))
def test_a_pages_platform_blocks_run_as_written(page, platform, tmp_path, wait_for):
    run = PageRun(platform, tmp_path, wait_for)
    for block in [b for b in BLOCKS if b.page == page]:
        out = run.run(block)
        assert out.returncode == 0, (f"{block.name} exited {out.returncode}\n--- stdout\n{out.stdout[-3000:]}"
                                     f"\n--- stderr\n{out.stderr[-3000:]}")
    run.delete_tenants()
