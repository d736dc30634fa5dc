"""Plot the scalability sweep: each phase's time and peak memory per factor.

    .venv/bin/pip install -e '.[plots]'      # matplotlib
    .venv/bin/python scripts/draw.py [--csv data/stats/trends.csv] [--out data/figs]

Reads the rows scripts/run_trends.sh appended (the last row of each factor
and value wins) and writes one PNG per factor: on the left, wall seconds of
generation and verification (wall and CPU) and the verifier's phases (load and structure,
lineages and stages, reduction, proofs); on the right, peak resident memory
of generation and of verification.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMES = {"gen_s": "generate (wall)", "gen_cpu_s": "generate (CPU)", "verify_s": "verify (wall)",
         "verify_cpu_s": "verify (CPU)", "t_graph": "load + structure",
         "t_lineage": "lineages + stages", "t_schedule": "reduction", "t_vrf": "proofs"}
MEMORY = {"gen_mib": "generate", "verify_mib": "verify"}


def _num(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def load(path: Path) -> dict[str, dict[float, dict]]:
    """factor -> value -> the last row measured there."""
    points: dict[str, dict[float, dict]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            value = _num(row.get("factor") and row.get("value"))
            if value is not None:
                points.setdefault(row["factor"], {})[value] = row
    return points


def draw(factor: str, rows: dict[float, dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for key, label in TIMES.items():
        pts = [(x, _num(rows[x].get(key))) for x in xs]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            left.plot(*zip(*pts), marker="o", label=label, linewidth=1)
    for key, label in MEMORY.items():
        pts = [(x, _num(rows[x].get(key))) for x in xs]
        pts = [(x, y / 1024) for x, y in pts if y is not None]
        if pts:
            right.plot(*zip(*pts), marker="o", label=label, linewidth=1)
    for ax, ylabel in ((left, "seconds"), (right, "peak RSS, GiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(factor)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    failed = [x for x in xs if rows[x].get("fate") not in ("ok", None)]
    folded = any("--fold" in rows[x].get("par", "") for x in xs)
    shown = "folded plans" if folded else "materialized plans (every rank)"
    title = f"llama3 around 8B shapes, varying {factor}, {shown}"
    if failed:
        title += f" (no verdict at {', '.join(f'{x:g}' for x in failed)})"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = out / f"{factor}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", type=Path, default=ROOT / "data/stats/trends.csv")
    p.add_argument("--out", type=Path, default=ROOT / "data/figs")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for factor, rows in sorted(load(args.csv).items()):
        print(f"wrote {draw(factor, rows, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
