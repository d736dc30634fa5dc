"""Run every transformers causal-LM family and every torchtitan model the
backend builds, at tiny sizes under their default recipes, and write the
table of what happened into docs/torch-backend.md.

    .venv/bin/python scripts/probe_families.py [--family NAME ...] [--no-write]

A transformers family runs as ``--hf FAMILY`` at dp 2 tp 2 when it has a
tensor-parallel plan, else at dp 2 tp 1 (FSDP2 through transformers); a
torchtitan model as ``--model titan:FAMILY --recipe titan:parallelize``
at dp 1 tp 2. A family runs at one layer, or, when its configuration
refuses one (a hybrid built with each of its kinds of layer), at the
fewest it builds with (``hf.fewest_layers``). Each row: verified, FAIL (a finding: its first line),
refused (exit 2: its one-line reason) or no verdict. The table replaces
what lies between the markers ``<!-- families:begin -->`` and
``<!-- families:end -->`` of docs/torch-backend.md (``--no-write``: print
it only). Re-run it whenever the lowering changes. With ``--family``, only
those rows are run and replaced; the others are kept.
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from torch_suite import run_case  # noqa: E402

DOC = ROOT / "docs" / "torch-backend.md"
BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"


def cases(only: list[str]) -> list[tuple[str, str]]:
    """(row name, arguments of ``python -m backends.torch``) per model."""
    from backends.torch.zoo import hf, titan
    from backends.torch.zoo.hf_composite import text_family
    out = []
    for family in hf.families():
        try:
            cfg_cls, model_cls = hf.classes(family)
            text = text_family(family, hf._default(cfg_cls), model_cls, hf.families())
            # a composite family is built as its text model: that model's plan
            plan = bool((hf.classes(text[0])[0] if text else cfg_cls)().base_model_tp_plan)
        except Exception:  # noqa: BLE001 - a configuration transformers cannot build: its row says so
            plan = False
        mesh = "--dp 2 --tp 2" if plan else "--dp 2 --tp 1"
        try:
            layers = hf.fewest_layers(family)
        except Exception:  # noqa: BLE001 - its row says why it does not build
            layers = 1
        mesh += f" --layers {layers}" if layers > 1 else ""
        out.append((f"hf {family}", f"--hf {family} {mesh}"))
    out += [(f"titan {f}", f"--model titan:{f} --recipe titan:parallelize --dp 1 --tp 2 "
                           f"--vocab 2048 --batch 2") for f in titan.FAMILIES]
    return [c for c in out if not only or c[0].split()[1] in only]


def row(name: str, argv: str) -> str:
    try:
        code, why = run_case(argv, {})
    except Exception as e:  # noqa: BLE001 - any failure is reported as no verdict
        code, why = 3, f"{type(e).__name__}: {e}"
    what = {0: "verified", 1: "FAIL", 2: "refused", 3: "no verdict"}[code]
    why = re.sub(r"\s+", " ", why.splitlines()[0] if why else "").replace("|", "/")[:160]
    return f"| {name} | `{argv}` | {what} | {why} |"


def write(rows: dict[str, str]) -> None:
    text = DOC.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        old, tail = rest.split(END, 1)
        kept = {line.split("|")[1].strip(): line for line in old.splitlines()
                if line.startswith("| ") and not line.startswith("| model")}
    else:
        head, tail, kept = text.rstrip("\n") + "\n\n## Families probed\n\n", "\n", {}
    kept.update(rows)
    table = ["| model | arguments | result | first line |", "|---|---|---|---|",
             *[kept[k] for k in sorted(kept)]]
    DOC.write_text(head + BEGIN + "\n" + "\n".join(table) + "\n" + END + tail)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", action="append", default=[], help="run only this family")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    opts = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    rows = {}
    for name, args in cases(opts.family):
        rows[name] = row(name, args)
        print(rows[name], flush=True)
        if not opts.no_write:  # row by row: an interrupted run keeps what it found
            write({name: rows[name]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
