"""Code blocks of the README and the docs, as they run on the end-to-end test platform
(tests/e2e/conftest.py `platform`): read out of the pages, never copied into tests, so a test
fails when a page drifts.

What changes between a page and its run is only what the test platform changes:

- the ports: the docs' defaults (127.0.0.1:8000 gateway, :8400 webhook, :8500 console, :8600
  Tinker API) become the platform's free ports;
- `python3 dev.py clora`, which runs the CLI in the project's environment, becomes this
  interpreter's `-m clora.infra.cli`, with the platform's settings in the environment.

Used by tests/e2e/test_quickstart.py (the README) and tests/e2e/test_docs_examples.py (docs/).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# the docs' default port of each service -> the `platform` fixture's key for its URL
DOCUMENTED_PORTS = {"8000": "gateway", "8400": "webhook", "8500": "console", "8600": "trainapi"}


@dataclass(frozen=True)
class Block:
    """One fenced code block right under a `<!-- MARKER[: arg] -->` comment.

    For `<!-- runs-on-platform: signed -->` above a ```python fence on line 41 of
    docs/guides/sdk.md: page "docs/guides/sdk.md", line 41, lang "python", arg "signed".
    """

    page: str
    line: int
    lang: str
    arg: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line} ({self.lang} block)"


def marked_blocks(marker: str, pages: list[Path] | None = None) -> list[Block]:
    """Every fenced block right under `<!-- MARKER -->` or `<!-- MARKER: arg -->`, in page order."""
    pattern = re.compile(rf"<!-- {re.escape(marker)}(?::\s*([^>]*?))?\s*-->\n```(\w*)\n(.*?)```", flags=re.S)
    found = []
    for page in pages if pages is not None else sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start(2)) + 1  # the fence's line
            found.append(Block(str(page.relative_to(ROOT)), line, m.group(2), m.group(1) or "", m.group(3)))
    return found


def as_on_this_platform(code: str, platform: dict) -> str:
    """A block's code with the documented ports and `python3 dev.py clora` replaced by the
    test platform's."""
    code = code.replace("python3 dev.py clora", f"{sys.executable} -m clora.infra.cli")
    for port, service in DOCUMENTED_PORTS.items():
        if service in platform:
            actual = platform[service].rsplit(":", 1)[1]
            code = re.sub(rf"(127\.0\.0\.1|localhost):{port}\b", rf"\g<1>:{actual}", code)
    return code


def platform_env(platform: dict, **extra: str) -> dict[str, str]:
    """The environment a block runs in: the platform's settings, this interpreter's bin/ first
    on PATH (so `python3` and `clora` are the project's), unbuffered output, and `extra`."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**platform["env"], "PATH": path, "PYTHONUNBUFFERED": "1", **extra}
