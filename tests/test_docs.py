"""The docs site (mkdocs.yml, docs/): it builds strictly, a broken link fails the build, and its
marked code blocks run:

    <!-- runs -->                      a Python block that needs no platform: executed
    <!-- schema: module:Model -->      a JSON block: validates against that pydantic model
    <!-- error-shape: clora|openai --> a JSON block: has exactly the keys that shape's errors have

(docs/events.md's examples are checked by tests/ingest/test_schemas.py and
tests/core/test_reward_spec.py; the README's quickstart runs in tests/e2e/test_quickstart.py.)
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clora.infra import docgen

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MKDOCS = [sys.executable, "-m", "mkdocs", "build", "--strict"]  # not --quiet: it hides the warnings strict counts


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MKDOCS, "-f", str(config), "-d", str(site)], capture_output=True, text=True,
                          timeout=600, env={"NO_MKDOCS_2_WARNING": "1", **_env()})


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def marked_blocks(marker: str) -> list[tuple[str, str, str]]:
    """(page, marker argument, code) of every fenced block right under `<!-- MARKER[: arg] -->`."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        for arg, code in re.findall(rf"<!-- {marker}:?\s*([^>]*?)\s*-->\n```\w*\n(.*?)```", page.read_text(),
                                    flags=re.S):
            found.append((str(page.relative_to(ROOT)), arg, code))
    return found


def test_the_site_builds_strictly_with_every_generated_reference(tmp_path):
    out = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stderr[-4000:]
    settings = (tmp_path / "site" / "reference" / "settings" / "index.html").read_text()
    assert "CLORA_LEARNER_RANK" in settings and "generated:" not in settings
    assert "clora_learner_steps_total" in (tmp_path / "site" / "reference" / "metrics" / "index.html").read_text()
    control = (tmp_path / "site" / "reference" / "control" / "index.html").read_text()
    assert "/api/tenants/{tenant_id}/policy" in control
    assert not (tmp_path / "site" / "hooks.py").exists()


def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    config = (ROOT / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(config)
    page = tmp_path / "docs" / "concepts" / "tenants.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    out = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0
    assert "no-such-page.md" in out.stderr


def test_a_broken_anchor_fails_the_build(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    (tmp_path / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text())
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [lineage](concepts/tenants.md#no-such-section).\n")
    out = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0 and "no-such-section" in out.stderr


def test_no_page_links_outside_the_repository():
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            resolved = (page.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{page.relative_to(ROOT)}: {target}"


@pytest.mark.parametrize("page, _, code", marked_blocks("runs"), ids=lambda v: v if isinstance(v, str) and
                         v.endswith(".md") else "")
def test_a_runnable_python_block_runs(page, _, code, monkeypatch):
    for var in [v for v in __import__("os").environ if v.startswith("CLORA_")]:
        monkeypatch.delenv(var)
    exec(compile(code, page, "exec"), {"__name__": "__docs__"})


def test_there_are_runnable_and_schema_blocks_to_check():
    assert len(marked_blocks("runs")) >= 2
    assert len(marked_blocks("schema")) >= 2
    assert {arg for _, arg, _ in marked_blocks("error-shape")} == {"clora", "openai"}


@pytest.mark.parametrize("page, model, code", marked_blocks("schema"))
def test_a_json_example_validates_against_its_schema(page, model, code):
    docgen.load(model).model_validate(json.loads(code))


@pytest.mark.parametrize("page, shape, code", marked_blocks("error-shape"))
def test_a_documented_error_has_the_shape_its_door_answers(page, shape, code):
    from clora.web import HttpError

    answered = HttpError(422, "invalid_request", "score: not a number", "score").body(shape)
    documented = json.loads(code)
    assert documented.keys() == answered.keys() == {"error"}
    assert documented["error"].keys() == answered["error"].keys()
