"""The whole parallelism grid through the differential numeric check and/or
the symbolic verifier (--mode numeric | symbolic | both, default both).

mlp and llama3 with each of dp, tp, pp, nm in {1, 2, 4} (every combination of
at most 16 ranks), each with both pipeline schedules where pp > 1; moe with
ep in {1, 2, 4} combined with dp in {1, 2, 4} and tp in {1, 2} wherever the
expert group fits (ep divides dp, or ep = tp x a divisor of dp), plus two
moe plans with pp and nm; llama3 with Megatron sequence parallelism (tp in
{2, 4} with each dp, pp, nm in {1, 2, 4}, at most 16 ranks, and two plans
with a vocab-parallel embedding too); llama3 with context parallelism (cp in
{2, 4} with dp, tp, pp, nm in {1, 2}, at most 16 ranks, and one with
sequence parallelism too); the same context-parallel points with causal
load balancing (a sequence of 8, so 2 cp chunks fit), one with sequence
parallelism and one with an interleaved pipeline; llama3 with Ulysses (cp
in {2, 4} with dp, pp, nm in {1, 2}); mlp and llama3 with an interleaved pipeline (vpp 2, four
dp/tp/pp/nm settings, both schedules).;
ZeRO-1/2/3 for mlp and llama3 (dp2 nm2, dp4, dp2 tp2 pp2 nm2) and moe (dp4
ep2 nm2, dp2 tp2 ep4); and the optimizer step (mlp with SGD, llama3 with
AdamW, moe with Adam), with and without ZeRO. Prints one line per plan and
exits 1 if any plan fails a check. ``--match TEXT`` runs only the plans
whose line contains TEXT (``--match cpbal``: the load-balanced points).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import replace

from gen_model.config import ModelConfig, Parallelism
from gen_model.generate import make_plan
from gen_model.parallelize import Policy
from main import verify
from verdict.differential import compare

GBS = 16
MODELS = {
    "mlp": ModelConfig("mlp", layers=4, hidden=8),
    "llama3": ModelConfig("llama3", layers=4, hidden=16, heads=4, kv_heads=4, ffn=24,
                          vocab=12, seqlen=4),
    "moe": ModelConfig("moe", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, vocab=12,
                       seqlen=4, experts=4, topk=2, moe_ffn=8, first_dense=1),
}
MODELS.update({
    "llama3_s8": replace(MODELS["llama3"], seqlen=8),
    "mlp_sgd": replace(MODELS["mlp"], optimizer="sgd"),
    "llama3_adamw": replace(MODELS["llama3"], optimizer="adamw"),
    "moe_adam": replace(MODELS["moe"], optimizer="adam"),
})
DEGREES = (1, 2, 4)


def grid() -> list[tuple[str, Parallelism, Policy]]:
    cases = []
    for model in ("mlp", "llama3"):
        for dp, tp, pp, nm in itertools.product(DEGREES, repeat=4):
            if dp * tp * pp <= 16:
                par = Parallelism(dp=dp, tp=tp, pp=pp, nm=nm)
                for schedule in (("1f1b", "gpipe") if pp > 1 else ("1f1b",)):
                    cases.append((model, par, Policy(schedule=schedule)))
    for ep, dp, tp in itertools.product(DEGREES, DEGREES, (1, 2)):
        if dp % ep == 0 or (ep % tp == 0 and dp % (ep // tp) == 0):
            cases.append(("moe", Parallelism(dp=dp, tp=tp, ep=ep), Policy()))
    for par in (Parallelism(dp=2, ep=2, pp=2, nm=2), Parallelism(dp=2, tp=2, ep=4, pp=2, nm=2)):
        cases.append(("moe", par, Policy()))
    for tp, dp, pp, nm in itertools.product((2, 4), DEGREES, DEGREES, DEGREES):
        if dp * tp * pp <= 16:
            cases.append(("llama3", Parallelism(dp=dp, tp=tp, pp=pp, nm=nm),
                          Policy(sequence_parallel=True)))
    for par in (Parallelism(tp=2, nm=2), Parallelism(dp=2, tp=4, pp=2)):
        cases.append(("llama3", par, Policy(sequence_parallel=True, vocab_parallel=True)))
    for cp, dp, tp, pp, nm in itertools.product((2, 4), (1, 2), (1, 2), (1, 2), (1, 2)):
        if cp * dp * tp * pp <= 16:
            cases.append(("llama3", Parallelism(dp=dp, tp=tp, pp=pp, nm=nm, cp=cp), Policy()))
    cases.append(("llama3", Parallelism(cp=2, tp=2, nm=2), Policy(sequence_parallel=True)))
    for cp, dp, tp, pp, nm in itertools.product((2, 4), (1, 2), (1, 2), (1, 2), (1, 2)):
        if cp * dp * tp * pp <= 16:
            cases.append(("llama3_s8", Parallelism(dp=dp, tp=tp, pp=pp, nm=nm, cp=cp),
                          Policy(cp_balance=True)))
    cases.append(("llama3_s8", Parallelism(cp=2, tp=2, nm=2),
                  Policy(cp_balance=True, sequence_parallel=True)))
    cases.append(("llama3_s8", Parallelism(cp=2, pp=2, nm=2),
                  Policy(cp_balance=True, virtual_stages=2)))
    for cp, dp, pp, nm in itertools.product((2, 4), (1, 2), (1, 2), (1, 2)):
        cases.append(("llama3", Parallelism(dp=dp, pp=pp, nm=nm, cp=cp), Policy(ulysses=True)))
    for model, (dp, tp, pp, nm), schedule in itertools.product(
            ("mlp", "llama3"), ((1, 1, 2, 2), (2, 2, 2, 4), (1, 1, 2, 4), (1, 2, 2, 2)),
            ("1f1b", "gpipe")):
        cases.append((model, Parallelism(dp=dp, tp=tp, pp=pp, nm=nm),
                      Policy(schedule=schedule, virtual_stages=2)))
    zero_pars = (Parallelism(dp=2, nm=2), Parallelism(dp=4),
                 Parallelism(dp=2, tp=2, pp=2, nm=2))
    for model, zero, par in itertools.product(("mlp", "llama3"), (1, 2, 3), zero_pars):
        cases.append((model, par, Policy(zero=zero)))
    for zero, par in itertools.product((2, 3), (Parallelism(dp=4, ep=2, nm=2),
                                                Parallelism(dp=2, tp=2, ep=4))):
        cases.append(("moe", par, Policy(zero=zero)))
    for model, par, zero in (("mlp_sgd", Parallelism(dp=2, tp=2, pp=2, nm=2), 0),
                             ("mlp_sgd", Parallelism(dp=4, nm=2), 2),
                             ("llama3_adamw", Parallelism(dp=2, tp=2, pp=2, nm=2), 0),
                             ("llama3_adamw", Parallelism(dp=2, tp=2, nm=2), 1),
                             ("llama3_adamw", Parallelism(dp=4, pp=2), 3),
                             ("moe_adam", Parallelism(dp=4, ep=2, nm=2), 3)):
        cases.append((model, par, Policy(zero=zero)))
    return cases


def describe(policy: Policy) -> str:
    flags = [policy.schedule] + [name for name, on in (
        ("sp", policy.sequence_parallel), ("vocab", policy.vocab_parallel),
        ("ulysses", policy.ulysses), ("cpbal", policy.cp_balance),
        (f"vpp{policy.virtual_stages}",
                                      policy.virtual_stages > 1)) if on]
    flags += [f"zero{policy.zero}"] if policy.zero else []
    return " ".join(flags)


def label(model: str, par: Parallelism, policy: Policy) -> str:
    return (f"{model:6} dp{par.dp} tp{par.tp} pp{par.pp} ep{par.ep} cp{par.cp} nm{par.nm} "
            f"{describe(policy):14}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("numeric", "symbolic", "both"), default="both")
    parser.add_argument("--match", default="", help="only the plans whose line contains this")
    args = parser.parse_args()
    start = time.perf_counter()
    singles = {m: make_plan(cfg, Parallelism(), GBS) for m, cfg in MODELS.items()}
    memo: dict = {}
    failed = 0
    cases = [c for c in grid() if args.match in label(*c)]
    for model, par, policy in cases:
        t0 = time.perf_counter()
        plan = make_plan(MODELS[model], par, GBS, policy=policy)
        problems = []
        if args.mode in ("numeric", "both"):
            report = compare(singles[model], plan)
            problems += [d.describe() for d in report.differences[:3]] + report.uncovered[:3]
            if report.broken:
                problems.append(report.broken)
        if args.mode in ("symbolic", "both"):
            verdict = verify(singles[model], plan, memo=memo)
            if not verdict.success:
                problems.append(f"symbolic: {verdict.kind} {verdict.message}")
        failed += bool(problems)
        print(f"{'FAIL' if problems else 'ok  '} {label(model, par, policy)} "
              f"{len(plan.nodes):6} nodes {time.perf_counter() - t0:5.2f} s", flush=True)
        for line in problems:
            print(f"      {line}")
    took = time.perf_counter() - start
    print(f"{len(cases) - failed} passed, {failed} failed in {took:.0f} s ({args.mode})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
