"""Prove a refactor of the verifier changes no verdict: run ``main.py`` over a
directory of plan pairs with two checkouts and compare what each prints.

    .venv/bin/python scripts/compare_verdicts.py --before ../main --after . --plans DIR

``--before`` and ``--after`` are two checkouts of the repository (git
worktrees). ``DIR`` holds one folder per case with a ``single`` and a
``parallel`` plan file (``.pkl`` or ``.npz`` each; a case without both
is left out, and the count says how many cases ran). For every case each
checkout runs ``main.py --sm single --pm parallel --json FILE`` in a process
of its own, with that checkout first on ``PYTHONPATH`` and in the working
directory, one ``PYTHONHASHSEED``, and caches, logs and the Stats file in a
temporary directory of its own (no cached proof or plan is reused; its name
is blanked out of the output). The exit
code, standard output, standard error and JSON summary of the two sides must
be equal once what differs between runs by nature is blanked out: wall-clock
timings (``t_graph=0.041`` and the like, in the Stats row and the JSON
summary) and the process id. The script prints one line per case that
differs and a count, and exits 0 when nothing differs, 1 when something
does, 2 on bad arguments.

Plans are never built here (the verifier reads the files; scripts such as
``python -m gen_model ... -o`` or ``python -m backends.torch ... --out``
write them, and ``scripts/compare_plans.py`` compares what two checkouts
build).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PYTHON = Path(sys.executable)
#: Plan files (a pickled plan's JSON world spec beside it is not one).
PLAN_SUFFIXES = (".pkl", ".npz")
#: Timings the Stats row prints (``t_total=0.089``) and the process id line.
VOLATILE = (re.compile(r"\bt_(\w+)=[0-9.]+"), re.compile(r"\bPID: \d+"))


def cases(plans: Path, keys: list[str]) -> dict[str, tuple[Path, Path]]:
    """Each case folder's name -> its (single, parallel) plan files."""
    out = {}
    for folder in sorted(p for p in plans.iterdir() if p.is_dir()):
        if keys and not any(k in folder.name for k in keys):
            continue
        single = [p for p in sorted(folder.glob("single.*")) if p.suffix in PLAN_SUFFIXES]
        parallel = [p for p in sorted(folder.glob("parallel.*")) if p.suffix in PLAN_SUFFIXES]
        if len(single) == 1 and len(parallel) == 1:
            out[folder.name] = (single[0], parallel[0])
    return out


def blank(text: str) -> str:
    """``text`` with its timings and process id blanked out."""
    text = VOLATILE[0].sub(lambda m: f"t_{m.group(1)}=_", text)
    return VOLATILE[1].sub("PID: _", text)


def summary(path: Path) -> str:
    """The JSON summary with its timings blanked out ("" when none was written)."""
    if not path.is_file():
        return ""
    data = json.loads(path.read_text())
    stats = data.get("stats")
    if isinstance(stats, dict):
        data["stats"] = {k: "_" if k.startswith("t_") else v for k, v in stats.items()}
    return json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True)


def run_case(root: Path, single: Path, parallel: Path, out: Path, seed: str,
             timeout: float) -> None:
    """One verdict of ``root``'s ``main.py``, written as ``out/{code,stdout,stderr,json}``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONHASHSEED": seed}
    with tempfile.TemporaryDirectory() as scratch:
        argv = [str(PYTHON), str(root / "main.py"), "--sm", str(single), "--pm", str(parallel),
                "--json", str(out / "raw.json"), "--no_cache_stages", "--no_cache_nodes",
                "--cache_dir", scratch, "--log_dir", scratch, "--stats_dir", scratch]
        try:
            run = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True,
                                 timeout=timeout)
            code, stdout, stderr = str(run.returncode), run.stdout, run.stderr
        except subprocess.TimeoutExpired:
            code, stdout, stderr = "timeout", "", ""
        stdout, stderr = stdout.replace(scratch, "SCRATCH"), stderr.replace(scratch, "SCRATCH")
    (out / "code").write_text(code + "\n")
    (out / "stdout").write_text(blank(stdout))
    (out / "stderr").write_text(blank(stderr))
    (out / "json").write_text(summary(out / "raw.json"))


def run_side(root: Path, found: dict[str, tuple[Path, Path]], out: Path, seed: str,
             timeout: float, reuse: bool) -> None:
    for name, (single, parallel) in found.items():
        if reuse and (out / name / "json").is_file():
            continue
        run_case(root, single, parallel, out / name, seed, timeout)
        code = (out / name / "code").read_text().strip()
        print(f"{root.name}: {name}: exit {code}", flush=True)


def differences(before: Path, after: Path, names: list[str]) -> list[str]:
    """The cases whose exit code, output or summary differ, with what differs."""
    out = []
    for name in names:
        what = [part for part in ("code", "stdout", "stderr", "json")
                if (before / name / part).read_text() != (after / name / part).read_text()]
        if what:
            out.append(f"{name} ({', '.join(what)})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="the checkout to compare against")
    ap.add_argument("--after", required=True, help="the checkout under test")
    ap.add_argument("--plans", required=True, help="a folder of case folders of plan pairs")
    ap.add_argument("-k", action="append", default=[], help="the cases whose name contains this")
    ap.add_argument("--out", default=None,
                    help="keep the outputs here (default: a temporary directory)")
    ap.add_argument("--seed", default="0", help="PYTHONHASHSEED of both sides (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds one verdict may take (default: %(default)s)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the outputs of a case already written into --out")
    ap.add_argument("--only", choices=("before", "after"),
                    help="run one side only (into --out), compare nothing")
    opts = ap.parse_args(argv)
    if (opts.reuse or opts.only) and opts.out is None:
        print("error: --reuse and --only read or write the files of --out: give --out",
              file=sys.stderr)
        return 2
    before, after = Path(opts.before).resolve(), Path(opts.after).resolve()
    for root in (before, after):
        if not (root / "main.py").is_file():
            print(f"error: {root} is not a checkout of this repository", file=sys.stderr)
            return 2
    plans = Path(opts.plans).resolve()
    found = cases(plans, opts.k) if plans.is_dir() else {}
    if not found:
        print(f"error: no case folder with a single and a parallel plan in {plans}",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(opts.out or tmp).resolve()
        for side, root in (("before", before), ("after", after)):
            if opts.only in (None, side):
                run_side(root, found, out / side, opts.seed, opts.timeout, opts.reuse)
        if opts.only:
            return 0
        diff = differences(out / "before", out / "after", list(found))
        codes: dict[str, int] = {}
        for name in found:
            code = (out / "after" / name / "code").read_text().strip()
            codes[code] = codes.get(code, 0) + 1
    for line in diff:
        print(f"differs: {line}")
    tally = ", ".join(f"{n} exit {c}" for c, n in sorted(codes.items()))
    print(f"compare verdicts: {len(found) - len(diff)} of {len(found)} cases identical "
          f"(exit code, output, JSON summary; {tally})")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
