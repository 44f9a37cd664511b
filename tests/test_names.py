"""Every name the code uses is defined: pyflakes over every source folder, failing on an
undefined name (a missing import, a typo) before the code path that runs it does. A learner
start once failed on a missing import that no test's code path reached."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import messages  # noqa: E402
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FATAL = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class Collect(Reporter):
    def __init__(self):
        self.found: list[str] = []

    def flake(self, message) -> None:
        if isinstance(message, FATAL):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:  # noqa: N802 - pyflakes' name
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg) -> None:  # noqa: N802
        self.found.append(f"{filename}: {msg}")


def sources() -> list[Path]:
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    return sorted(p for f in set(folders) for p in (ROOT / f).rglob("*.py")) + \
        sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))


def test_no_source_file_uses_an_undefined_name():
    report = Collect()
    for path in sources():
        pyflakes_api.check(path.read_text(), str(path.relative_to(ROOT)), report)
    assert not report.found, "\n".join(report.found)


def test_the_check_catches_a_missing_import():
    report = Collect()
    pyflakes_api.check("def make():\n    return StorageSettings()\n", "example.py", report)
    assert report.found and "StorageSettings" in report.found[0]
