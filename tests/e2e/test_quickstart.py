"""The README's quickstart, run as written against the real platform (`clora up` on a tiny model):
its blocks are read out of README.md, not copied here, so the test fails when the README drifts.

What changes between the README and the test is only what the test platform changes: the
platform's ports (free ports instead of 8000 and 8400) and `python3 dev.py clora`, which runs
the CLI in the project's environment (here: this interpreter's `-m clora.infra.cli`, with the
platform's settings in the environment): tests/e2e/docs_blocks.py, shared with the docs' examples.
And the tenant is `readme`, not `acme`, because the end-to-end tests share one platform.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .docs_blocks import as_on_this_platform as on_platform
from .docs_blocks import platform_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

README = Path(__file__).resolve().parents[2] / "README.md"
TENANT = "readme"


def quickstart_blocks(text: str) -> dict[str, tuple[str, str]]:
    """`<!-- quickstart: NAME -->` -> (language, code) of the fenced block right under it."""
    return {name: (lang, code) for name, lang, code in
            re.findall(r"<!-- quickstart: (\w+) -->\n```(\w+)\n(.*?)```", text, flags=re.S)}


def test_the_readme_quickstart_has_its_four_steps_in_order():
    text = README.read_text()
    blocks = quickstart_blocks(text)
    assert list(blocks) == ["up", "tenant", "chat", "versions"]
    assert blocks["up"] == ("bash", "python3 dev.py up\n")
    assert [lang for lang, _ in blocks.values()] == ["bash", "bash", "python", "bash"]


def test_the_readme_quickstart_runs_as_written_and_a_version_appears(platform, wait_for):
    blocks = quickstart_blocks(README.read_text())
    env = platform_env(platform)

    def as_on_this_platform(code: str) -> str:
        # the e2e tests share one platform, where tests/e2e/test_loop.py already made `acme`
        return re.sub(r"\bacme\b", TENANT, on_platform(code, platform))

    # create the tenant: the block exports KEY; the test reads it back from the same shell
    _, tenant = blocks["tenant"]
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", as_on_this_platform(tenant) + 'printf %s "$KEY"'],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()
    assert key, "the tenant block left KEY empty"

    # chat and correct: the Python block as a script, with KEY in its environment
    _, chat = blocks["chat"]
    out = subprocess.run([sys.executable, "-c", as_on_this_platform(chat)], env={**env, "KEY": key},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    event_ids = re.findall(r"^fb-[0-9a-f]+$", out.stdout, flags=re.M)   # each correction's, from the SDK
    assert len(set(event_ids)) == 8, out.stdout

    # watch a version appear: the versions block, until it lists a live version
    _, versions = blocks["versions"]
    command = as_on_this_platform(versions).strip()

    def live_version() -> str | None:
        shown = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        listed = subprocess.run(["bash", "-c", command + " --json"], env=env, capture_output=True, text=True,
                                timeout=60)
        live = json.loads(listed.stdout)["live"]
        return shown.stdout if live is not None and f"live: v{live}" in shown.stdout else None

    shown = wait_for(live_version, 300, interval=1.0, what="the README's tenant to get a live version")
    assert "live: v" in shown
