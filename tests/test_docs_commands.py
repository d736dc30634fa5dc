"""Every shell command shown in README.md and docs/*.md runs as written.

A command is a line of a code block (indented by four spaces, or fenced as
``` / ```sh / ```bash / ```console) whose first word is one of COMMANDS;
lines ending in a backslash, or inside an open quote, continue it. The
commands of a file run in order, from the root of a copy of the repository
in a temporary directory (so what they write, plans, caches, Stats rows,
logs, never lands in the checkout), with .venv/bin first on PATH (as if the
venv were activated), and must exit 0. Files run README.md first, then
docs/ by name, in the same copy, so a docs command may use the plans the
README's commands generate.

To keep a block out of this test, put this line right before it:

    <!-- docs-test: skip (why: a long benchmark, the test suite itself, ...) -->

and for a block whose commands are meant to exit with another code:

    <!-- docs-test: exit 1 -->

Use skip for long commands only (over a minute or so): every command of the
README's getting-started sections runs here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"
COMMANDS = ("make", "python", "python3", "bash", "ray", "pip")
SHELL_FENCES = ("", "sh", "bash", "console", "shell")
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|exit\s+(\d+))\b.*-->")
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: What the copy leaves out: version control, the venv (linked instead), and
#: what commands write (plans, caches, Stats rows, logs).
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache",
                                    ".ruff_cache", "*.egg-info", "mgeners", "cache", "logs",
                                    "stats.csv", "plans")


@dataclass
class Command:
    file: str
    line: int
    text: str
    skip: bool
    exit: int


def is_command(text: str) -> bool:
    words = [w for w in text.split() if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]  # VAR=value first
    first = words[0] if words else ""
    return first in COMMANDS or first.startswith(".venv/bin/")


def complete(text: str) -> bool:
    if text.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on
        return False
    return True


def blocks(text: str) -> list[tuple[int, list[str], str]]:
    """(first line number, lines, the non-blank line before) of each shell block."""
    lines = text.splitlines()
    found, i, before = [], 0, ""
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")),
                       len(lines))
            if fence.group(1) in SHELL_FENCES:
                found.append((i + 2, lines[i + 1:end], before))
            before, i = "", end + 1
            continue
        if line.startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            found.append((i + 1, [x[4:] for x in lines[i:j]], before))
            before, i = "", j
            continue
        if line.strip():
            before = line
        i += 1
    return found


def commands(path: Path) -> list[Command]:
    out = []
    for start, lines, before in blocks(path.read_text()):
        marker = MARKER.search(before)
        skip = bool(marker and marker.group(1) == "skip")
        code = int(marker.group(2)) if marker and marker.group(2) else 0
        k = 0
        while k < len(lines):
            text = lines[k].strip()
            if not is_command(text):
                k += 1
                continue
            first = k
            while not complete(text) and k + 1 < len(lines):
                k += 1
                text += "\n" + lines[k]
            out.append(Command(path.name, start + first, text, skip, code))
            k += 1
    return out


def test_the_readme_shows_commands_and_runs_them():
    found = commands(ROOT / "README.md")
    assert any(c.text.startswith("make demo") and not c.skip for c in found)
    assert any("gen_model" in c.text and not c.skip for c in found)
    assert any("main.py" in c.text and not c.skip for c in found)


def test_marker_and_continuations(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Text.\n\n    python -m a \\\n        --b 1\n    12 passed\n\n"
                   "<!-- docs-test: skip (long) -->\n```bash\nmake slow\n```\n\n"
                   "<!-- docs-test: exit 1 -->\n\n    .venv/bin/python -c \"x\n    y\"\n"
                   "Text.\n\n    A=1 make it\n")
    found = commands(doc)
    assert [(c.text, c.skip, c.exit) for c in found] == [
        ("python -m a \\\n    --b 1", False, 0), ("make slow", True, 0),
        ('.venv/bin/python -c "x\ny"', False, 1), ("A=1 make it", False, 0)]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the repository, its .venv linked to the checkout's."""
    copy = tmp_path_factory.mktemp("checkout") / "repo"
    shutil.copytree(ROOT, copy, ignore=NOT_COPIED, symlinks=True)
    if (ROOT / ".venv").exists():
        (copy / ".venv").symlink_to(ROOT / ".venv")
    return copy


def test_the_copy_holds_the_code_but_no_output(checkout):
    assert (checkout / "main.py").exists() and (checkout / "verdict" / "cache.py").exists()
    assert (checkout / "data" / "stats" / ".gitkeep").exists()
    assert not (checkout / "gen_model" / "mgeners").exists()
    assert not (checkout / "data" / "cache").exists()


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_documented_commands_run_as_written(path, checkout):
    if not (VENV_BIN / "python").exists():
        pytest.skip("no .venv: make test creates it")
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(ROOT / ".venv")}
    for c in commands(path):
        if c.skip:
            continue
        done = subprocess.run(["bash", "-c", c.text], cwd=checkout, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == c.exit, (
            f"{c.file}:{c.line}: `{c.text}` exited {done.returncode}, expected {c.exit}\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
