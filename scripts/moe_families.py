"""Every transformers causal-LM family that routes tokens to its top-k
experts, traced at dp2 (FSDP2 through transformers, its routing recorded)
and verified: one line per family, ``verified``, ``FAIL`` or ``refused``
with the one-line reason; with ``--ep``, also at dp2 ep2 through the
family's own expert-parallel plan (``--hf FAMILY --ep 2``) where it has
one (``base_model_ep_plan``).

    .venv/bin/python scripts/moe_families.py [--ep | --ep-only] [FAMILY ...]

Ends with the counts; prints a Markdown table with ``--markdown``
(docs/torch-backend.md, "Top-k mixtures of experts").
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.torch.__main__ import parser as backend_parser  # noqa: E402
from backends.torch.__main__ import trace_and_build  # noqa: E402
from backends.torch.errors import LoweringError  # noqa: E402
from backends.torch.tracer.check import LoadedValueMismatch  # noqa: E402
from backends.torch.zoo import hf  # noqa: E402
from main import verify  # noqa: E402


def routed_families() -> list[str]:
    """The causal-LM families whose default configuration routes to top-k experts."""
    out = []
    for family in hf.families():
        try:
            cfg_cls, _ = hf.classes(family)
            default = hf._default(cfg_cls)
        except Exception:  # a family without a default configuration
            continue
        if hf.routes(default):
            out.append(family)
    return out


def has_ep_plan(family: str) -> bool:
    """Whether the family's default configuration has an expert-parallel plan."""
    cfg_cls, _ = hf.classes(family)
    return bool(getattr(cfg_cls(), "base_model_ep_plan", None))


def judge(family: str, ep: int = 1) -> tuple[str, str]:
    """(verdict, reason) of ``--hf FAMILY --dp 2 --tp 1 [--ep EP]``."""
    try:
        (plan_s, plan_p), _ = trace_and_build(backend_parser().parse_args(
            ["--hf", family, "--dp", "2", "--tp", "1", "--ep", str(ep)]))
    except LoweringError as e:
        return "refused", str(e).splitlines()[0]
    except LoadedValueMismatch as e:
        return "FAIL", str(e).splitlines()[0]
    verdict = verify(plan_s, plan_p)
    if verdict.success:
        return "verified", ""
    return ("no verdict" if verdict.kind == "internal" else "FAIL"), verdict.message.splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("families", nargs="*", help="families to run (default: every routed one)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table at the end")
    p.add_argument("--ep", action="store_true",
                   help="also trace dp2 ep2 through the family's expert-parallel plan")
    p.add_argument("--ep-only", action="store_true",
                   help="trace only dp2 ep2 (the families' dp2 rows already known)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    families = args.families or routed_families()
    rows = []
    for family in families:
        if not args.ep_only:
            verdict, reason = judge(family)
            rows.append((family, verdict, reason))
            print(f"{family:28s} {verdict:10s} {reason[:160]}", flush=True)
        if (args.ep or args.ep_only) and has_ep_plan(family):
            verdict, reason = judge(family, ep=2)
            rows.append((f"{family} ep2", verdict, reason))
            print(f"{family + ' ep2':28s} {verdict:10s} {reason[:160]}", flush=True)
    counts = {v: sum(r[1] == v for r in rows) for v in ("verified", "FAIL", "refused", "no verdict")}
    print("moe families: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + f" of {len(rows)}")
    if args.markdown:
        print("\n| family | dp2 | reason |\n|---|---|---|")
        for family, verdict, reason in rows:
            print(f"| {family} | {verdict} | {reason.replace('|', '/')[:200]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
