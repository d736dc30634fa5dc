"""Prove a refactor of the PyTorch backend changes nothing: build the plans of
suite cases with two checkouts and compare the files byte for byte.

    .venv/bin/python scripts/compare_plans.py --before ../main --after . -k llama -k moe

``--before`` and ``--after`` are two checkouts of the repository (git
worktrees). For the cases of ``scripts/torch_suite.py`` selected by ``-k``
(by name, as the suite selects them; every case without ``-k``), each
checkout traces and builds the plan pair in a process of its own, with that
checkout first on ``PYTHONPATH`` and in the working directory, and writes
it as ``python -m backends.torch`` would (``save_plan``: the pickled plans
and their JSON world specs). A case the backend refuses or finds wrong
before any plan is written leaves its exit code and message instead. Each
checkout also lists its lowering's handler chains (``scripts/dump_handlers.py``).
The two sets of files must be equal byte for byte; the script prints one line
per case that differs and a count, and exits 0 when nothing differs, 1 when
something does, 2 on bad arguments.

Plans are only built, never verified (the verifier reads the files; equal
files get equal verdicts). The case list is the ``--after`` checkout's;
a case the ``--before`` checkout does not have is reported as missing.
Both sides run with one ``PYTHONHASHSEED``, so a difference is the code's,
not the order a set of strings happened to have in one process.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

PYTHON = Path(sys.executable)


def slug(name: str) -> str:
    """A file name for a case's name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[:120]


def write_cases(root: Path, names: list[str], out: Path) -> None:
    """In a process whose code is ``root``'s: trace and build each named case
    into ``out/<slug>/`` (the plan files, or ``status.txt`` with the exit code
    and message of a case refused before any plan)."""
    sys.path.insert(0, str(root))
    sys.path.insert(0, str(root / "scripts"))
    import warnings

    import torch_suite  # the checkout's suite and backend

    from backends.planfile import save_plan
    from backends.torch.__main__ import parser, resolve, trace_and_build
    from backends.torch.errors import WrongStep
    from backends.torch.lowering import LoweringError
    from backends.torch.tracer.check import LoadedValueMismatch

    warnings.filterwarnings("ignore")
    cases = {name: argv for name, argv, _ in torch_suite.CASES}
    singles: dict = {}
    for name in names:
        where = out / slug(name)
        where.mkdir(parents=True, exist_ok=True)
        if name not in cases:
            (where / "status.txt").write_text("missing: no such case in this checkout\n")
            continue
        try:
            args = resolve(parser().parse_args(shlex.split(cases[name])))
            key = torch_suite.single_key(args)
            (plan_s, plan_p), singles[key] = trace_and_build(args, singles.get(key))
        except (WrongStep, LoadedValueMismatch) as e:
            (where / "status.txt").write_text(f"1 {type(e).__name__}: {e}\n")
            continue
        except LoweringError as e:
            (where / "status.txt").write_text(f"2 {type(e).__name__}: {e}\n")
            continue
        except Exception as e:  # noqa: BLE001 - recorded, compared like any outcome
            (where / "status.txt").write_text(f"3 {type(e).__name__}: {e}\n")
            continue
        save_plan(plan_s, where / "single.pkl")
        save_plan(plan_p, where / "parallel.pkl")
        print(f"built {name}", flush=True)


def run_side(root: Path, names: list[str], out: Path, seed: str) -> None:
    """``write_cases`` for ``root`` in a subprocess, and its handler chains."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": seed}
    listing = out / "cases.txt"
    listing.write_text("\n".join(names) + "\n")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            f"import compare_plans as c; from pathlib import Path; "
            f"c.write_cases(Path({str(root)!r}), Path({str(listing)!r}).read_text().splitlines(), "
            f"Path({str(out)!r}))")
    subprocess.run([str(PYTHON), "-c", code], cwd=root, env=env, check=True)
    handlers = subprocess.run([str(PYTHON), str(root / "scripts" / "dump_handlers.py")], cwd=root,
                              env=env, check=True, capture_output=True)
    (out / "handlers.txt").write_bytes(handlers.stdout)


def differences(before: Path, after: Path) -> list[str]:
    """The files under either directory that are missing from the other or
    differ in a byte, relative to it."""
    names = {p.relative_to(before) for p in before.rglob("*") if p.is_file()}
    names |= {p.relative_to(after) for p in after.rglob("*") if p.is_file()}
    out = []
    for name in sorted(names):
        a, b = before / name, after / name
        if not (a.is_file() and b.is_file()) or not filecmp.cmp(a, b, shallow=False):
            out.append(str(name))
    return out


def selected(root: Path, keys: list[str]) -> list[str]:
    """The names of ``root``'s suite cases that ``keys`` select."""
    listing = subprocess.run(
        [str(PYTHON), "-c", "import sys; sys.path.insert(0, 'scripts'); import torch_suite; "
         "print('\\n'.join(c[0] for c in torch_suite.CASES))"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, check=True, capture_output=True,
        text=True)
    names = listing.stdout.splitlines()
    return [n for n in names if not keys or any(k in n for k in keys)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="the checkout to compare against")
    ap.add_argument("--after", required=True, help="the checkout under test")
    ap.add_argument("-k", action="append", default=[], help="the cases whose name contains this")
    ap.add_argument("--every", type=int, default=1, metavar="N",
                    help="of the cases selected, take the first and every N-th after it")
    ap.add_argument("--out", default=None, help="keep the files here (default: a temporary directory)")
    ap.add_argument("--seed", default="0", help="PYTHONHASHSEED of both sides (default: %(default)s)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep a side already written into --out for the same cases")
    opts = ap.parse_args(argv)
    if opts.reuse and opts.out is None:
        print("error: --reuse reads the files of --out: give --out", file=sys.stderr)
        return 2
    before, after = Path(opts.before).resolve(), Path(opts.after).resolve()
    for root in (before, after):
        if not (root / "scripts" / "torch_suite.py").is_file():
            print(f"error: {root} is not a checkout of this repository", file=sys.stderr)
            return 2
    if opts.every < 1:
        print("error: --every takes a count of at least 1", file=sys.stderr)
        return 2
    names = selected(after, opts.k)[::opts.every]
    if not names:
        print("error: no suite case matches the -k given", file=sys.stderr)
        return 2
    if len({slug(n) for n in names}) != len(names):
        print("error: two selected cases have one file name (slug): rename one", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(opts.out or tmp).resolve()
        for side, root in (("before", before), ("after", after)):
            if opts.reuse and (out / side / "handlers.txt").is_file() \
                    and (out / side / "cases.txt").read_text().splitlines() == names:
                continue
            run_side(root, names, out / side, opts.seed)
        diff = differences(out / "before", out / "after")
        refused = sum((out / "after" / slug(n) / "status.txt").exists() for n in names)
    cases = {name.split("/", 1)[0] for name in diff if "/" in name}
    for name in diff:
        print(f"differs: {name}")
    print(f"compare plans: {len(names) - len(cases)} of {len(names)} cases byte-identical "
          f"({refused} of them end before any plan, their exit code and message compared); "
          + ("handler chains differ" if "handlers.txt" in diff else "handler chains identical"))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
