"""The docs site (mkdocs.yml, docs/): it builds strictly, a broken link fails the build, and its
marked code blocks run:

    <!-- runs -->                      a Python block that needs no platform: executed
    <!-- schema: module:Model -->      a JSON block: validates against that pydantic model
    <!-- error-shape: clora|openai --> a JSON block: has exactly the keys that shape's errors have
    <!-- runs-on-platform[: start] --> a Python or bash block run against the real platform, in
                                       tests/e2e/test_docs_examples.py (which says what `start` asks)
    <!-- not-run: reason -->           a block no test machine can run (docker, a GPU, minutes)

Every fenced python, bash and json block in docs/ carries exactly one of them, so a new block
is checked or says why not. (docs/events.md's examples are also checked by
tests/ingest/test_schemas.py and tests/core/test_reward_spec.py; the README's quickstart runs in
tests/e2e/test_quickstart.py.)
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
MARKERS = ("runs", "runs-on-platform", "schema", "error-shape", "not-run")
CHECKED_LANGUAGES = {"python", "py", "bash", "sh", "shell", "console", "json"}
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
        for arg, code in re.findall(rf"<!-- {marker}(?::\s*([^>]*?))?\s*-->\n```\w*\n(.*?)```", page.read_text(),
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


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, language, the markers on the comment lines right above) of every fenced block."""
    lines, found, i = text.split("\n"), [], 0
    while i < len(lines):
        opening = re.match(r"\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not opening:
            i += 1
            continue
        above, j = [], i - 1
        while j >= 0 and lines[j].strip().startswith("<!--"):
            above += re.findall(r"<!-- ([\w-]+)", lines[j])
            j -= 1
        found.append((i + 1, opening.group(2), above))
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(opening.group(1)):
            i += 1
        i += 1
    return found


def test_every_python_bash_and_json_block_in_the_docs_carries_exactly_one_marker():
    unmarked = [f"{page.relative_to(ROOT)}:{line} ({lang}): {markers or 'no marker'}"
                for page in sorted(DOCS.rglob("*.md"))
                for line, lang, markers in fenced_blocks(page.read_text())
                if lang in CHECKED_LANGUAGES and (len(markers) != 1 or markers[0] not in MARKERS)]
    assert not unmarked, "mark each block with one of " + ", ".join(MARKERS) + ":\n" + "\n".join(unmarked)


def test_a_block_without_a_marker_or_with_two_is_found():
    text = ("```python\nx = 1\n```\n\n"
            "<!-- runs -->\n<!-- not-run: no -->\n```bash\nls\n```\n\n"
            "<!-- runs -->\n```json\n{}\n```\n")
    assert fenced_blocks(text) == [(1, "python", []), (7, "bash", ["not-run", "runs"]), (12, "json", ["runs"])]


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
