"""The test suite writes only to temporary directories, never into the
checkout: the files under the repository root (outside version control,
the venv and tool caches) are listed when the run starts and compared when
it ends; a file added, changed or removed fails the run, named."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: what the tools write by default (backends/userdirs.py: caches, Stats rows,
#: logs, traced plans) goes to a temporary directory of this run, inherited
#: by the commands the tests start
os.environ["VERDICT_CACHE_DIR"] = tempfile.mkdtemp(prefix="verdict-tests-")
atexit.register(shutil.rmtree, os.environ["VERDICT_CACHE_DIR"], ignore_errors=True)
#: Directories a test run may write to: version control, the venv, Python's
#: and the tools' own caches.
NOT_WATCHED = (".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache")
_SNAPSHOT = pytest.StashKey[dict]()
#: The longest test files, longest first (docs/workflow.md, "Set up and the
#: test suite"). ``--dist loadfile`` runs each file on one worker and hands
#: the next file in order to the first worker free: started first, the long
#: files run beside the many short ones instead of after them (pytest-xdist's
#: own order, the files with most tests first, started the longest last).
LONGEST_FIRST = (
    "test_bugs.py", "test_symmetry_zero_ep.py", "test_soundness.py", "test_attention_merge.py",
    "test_cp_balance.py", "test_real_bugs.py", "test_oracle.py", "test_cp_mutations.py",
    "test_torch_moe_ep.py", "test_megatron_backend.py", "test_docs_commands.py",
    "test_torch_hf_families.py", "test_parallel.py",
)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every watched file under ``root``: relative path -> (mtime, size)."""
    files = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in NOT_WATCHED and not d.endswith(".egg-info")]
        for name in names:
            path = Path(folder) / name
            stat = path.lstat()
            files[str(path.relative_to(root))] = (stat.st_mtime_ns, stat.st_size)
    return files


def changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """What a run did to the watched files, one line each."""
    return ([f"written: {p}" for p in sorted(after.keys() - before.keys())]
            + [f"changed: {p}" for p in sorted(before.keys() & after.keys())
               if before[p] != after[p]]
            + [f"removed: {p}" for p in sorted(before.keys() - after.keys())])


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # pytest-xdist: the controller checks


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def runs_suite_cases(item: pytest.Item) -> bool:
    """Does the test call ``tests/cli_pair.suite_cases``, i.e. run cases of
    scripts/torch_suite.py as they are there? The suite runs them before
    each merge; ``make test`` leaves them out (marker ``suite``)."""
    function = getattr(item, "function", None)
    return function is not None and "suite_cases" in function.__code__.co_names


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that run suite cases get the marker ``suite``. The files of
    ``LONGEST_FIRST`` first, in its order; the rest after them in their own
    order (a stable sort: a file's tests keep theirs)."""
    for item in items:
        if runs_suite_cases(item):
            item.add_marker(pytest.mark.suite)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_worker(session.config):
        session.config.stash[_SNAPSHOT] = snapshot(ROOT)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _is_worker(session.config) or _SNAPSHOT not in session.config.stash:
        return
    found = changes(session.config.stash[_SNAPSHOT], snapshot(ROOT))
    if not found:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = ["the test run wrote into the checkout (tests write to temporary directories "
             "only):", *(f"  {line}" for line in found[:20])]
    if len(found) > 20:
        lines.append(f"  ... and {len(found) - 20} more")
    if reporter is not None:
        reporter.ensure_newline()
        for line in lines:
            reporter.write_line(line, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
