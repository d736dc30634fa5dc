"""python -m gen_model: write a plan file and its world spec.

Example:
    python -m gen_model --model mlp --layers 2 --hidden 128 --gbs 128 \
        --dp 2 --pp 2 --tp 2 --nm 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from backends.planfile import PlanError, save_columns_plan, save_plan
from gen_model.config import MODELS, ConfigError, ModelConfig, Parallelism, check_run, plan_stem
from gen_model.generate import make_columns, make_plan
from gen_model.parallelize import Policy
from gen_model.spill import Spill
from harness.bugs import inject
from verdict.columns import Columns
from verdict.plan import Plan

DEFAULT_DIR = Path(__file__).resolve().parent / "mgeners"
#: Sizes of llama3 and moe left out (docs/workflow.md, "Generate plans").
DEFAULT_HEADS = 4
DEFAULT_SEQLEN = 128
EPILOG = """Writes {model}_{variant}_dp{D}_pp{P}_tp{T}_nm{M}_gbs{G}_ly{L}_h{H}_hi{I}_sq{S}.pkl
(.npz with --format npz) and its JSON world spec under -o. Exit 0: written; 2: bad flags or sizes (one
line on stderr, nothing written)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"gen_model: error: {message}\n")
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m gen_model", description=__doc__.split("\n\n")[0],
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=MODELS, help="the model to generate")
    p.add_argument("--variant", default="default",
                   help="'default', or br1 to br14: a plan of the bug suite (docs/bugs.md); "
                        "also a part of the file name (default: %(default)s)")
    size = p.add_argument_group("model sizes (mlp uses --layers and --hidden only)")
    size.add_argument("--layers", type=int, default=2,
                      help="layers (transformer blocks) (default: %(default)s)")
    size.add_argument("--hidden", type=int, default=128, help="hidden size (default: %(default)s)")
    size.add_argument("--heads", type=int, default=DEFAULT_HEADS,
                      help="attention heads (default: %(default)s)")
    size.add_argument("--kv_heads", type=int, default=0,
                      help="grouped KV heads (default: heads/4 when that divides, else heads)")
    size.add_argument("--ffn", type=int, default=0, help="feed-forward size (default: 3.5*hidden)")
    size.add_argument("--vocab", type=int, default=128256,
                      help="vocabulary size (default: %(default)s, Llama 3's)")
    size.add_argument("--seqlen", type=int, default=DEFAULT_SEQLEN,
                      help="sequence length in tokens (default: %(default)s)")
    size.add_argument("--gbs", type=int, required=True,
                      help="global batch size: samples per training step, over all replicas "
                           "and microbatches")
    moe = p.add_argument_group("mixture of experts (--model moe)")
    moe.add_argument("--experts", type=int, default=8, help="routed experts (default: %(default)s)")
    moe.add_argument("--topk", type=int, default=2,
                     help="activated experts per token (default: %(default)s)")
    moe.add_argument("--capacity_factor", type=float, default=1.0,
                     help="slots per expert: ceil(seqlen x topk / experts x this) "
                          "(default: %(default)s)")
    moe.add_argument("--first_dense", type=int, default=1,
                     help="leading dense layers (default: %(default)s)")
    moe.add_argument("--moe_ffn", type=int, default=0, help="expert size (default: hidden)")
    par = p.add_argument_group("parallelism (all 1: the single-device plan)")
    par.add_argument("--dp", type=int, default=1,
                     help="data parallel: replicas, each on a share of the batch "
                          "(default: %(default)s)")
    par.add_argument("--tp", type=int, default=1,
                     help="tensor parallel: weights split across ranks (Megatron) "
                          "(default: %(default)s)")
    par.add_argument("--pp", type=int, default=1,
                     help="pipeline parallel: stages, the layers split across them "
                          "(default: %(default)s)")
    par.add_argument("--ep", type=int, default=1,
                     help="expert parallel: the experts split across ranks (moe) "
                          "(default: %(default)s)")
    par.add_argument("--nm", type=int, default=1,
                     help="microbatches per replica and step, run in the pipeline schedule "
                          "with the gradients accumulated (default: %(default)s)")
    par.add_argument("--cp", type=int, default=1,
                     help="context parallel: the sequence split across ranks (llama3) "
                          "(default: %(default)s)")
    par.add_argument("--cp_balance", action="store_true",
                     help="with --cp C: causal load balancing, the sequence cut into 2C chunks "
                          "and rank i holding chunks i and 2C-1-i")
    par.add_argument("--vocab_parallel", action="store_true",
                     help="split the embedding along the vocabulary across TP ranks")
    par.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                     help="pipeline schedule (default: %(default)s)")
    par.add_argument("--sequence_parallel", action="store_true",
                     help="Megatron sequence parallelism: activations outside TP regions "
                          "split along the sequence across TP ranks (llama3)")
    par.add_argument("--vpp", type=int, default=1,
                     help="interleaved pipeline: model chunks per pipeline stage "
                          "(default: %(default)s)")
    par.add_argument("--ulysses", action="store_true",
                     help="with --cp: Ulysses attention (all-to-all from sequence to head "
                          "shards) instead of gathering keys and values")
    par.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                     help="ZeRO stage: 1 optimizer state, 2 and gradients, 3 and parameters "
                          "sharded over data-parallel ranks (3 is FSDP) (default: %(default)s, "
                          "none)")
    p.add_argument("--fold", action="store_true",
                   help="write the folded plan: 2 replicas and 2 microbatches shown, the others "
                        "by symmetry (docs/soundness.md); generation cost does not grow with "
                        "--dp or --nm")
    p.add_argument("--optimizer", choices=("none", "sgd", "adam", "adamw"), default="none",
                   help="end the step with this optimizer's update (default: gradients only)")
    p.add_argument("-o", "--out", type=Path, default=DEFAULT_DIR,
                   help="output directory (default: gen_model/mgeners/)")
    p.add_argument("--format", choices=("pkl", "npz"), default="pkl",
                   help="plan file form: pickled rows, or columnar (.npz; a plan of more than "
                        "3 replicas is then generated by array arithmetic, docs/plan-format.md; "
                        "default: %(default)s)")
    return p


def check_defaults(args: argparse.Namespace, cfg: ModelConfig) -> None:
    """KV heads left to their default that --tp does not divide: say which value
    to pass. The default is not changed with --tp, because the single-device
    plan of the same model is generated without --tp and must get the same
    value. (The default ffn, 3.5 x hidden, is always divisible: --tp divides
    heads and head_dim is even, so --tp divides hidden / 2.)"""
    if cfg.model == "mlp" or args.tp <= 1:
        return
    if not args.kv_heads and cfg.kv_heads % args.tp and cfg.heads % args.tp == 0:
        fits = [k for k in range(args.tp, cfg.heads + 1, args.tp) if cfg.heads % k == 0]
        raise ConfigError(f"--kv_heads defaults to {cfg.kv_heads} (heads/4), which --tp {args.tp} "
                          f"does not divide: pass --kv_heads {fits[0]} (to the single-device plan "
                          f"too)")


def config_from(args: argparse.Namespace) -> tuple[ModelConfig, Parallelism]:
    if args.model == "mlp":
        cfg = ModelConfig("mlp", layers=args.layers, hidden=args.hidden,
                          optimizer=args.optimizer)
    else:
        heads = args.heads
        kv = args.kv_heads or (heads // 4 if heads >= 4 and heads % 4 == 0 else heads)
        common = dict(
            layers=args.layers, hidden=args.hidden, heads=heads, kv_heads=kv,
            ffn=args.ffn or int(3.5 * args.hidden), vocab=args.vocab, seqlen=args.seqlen,
            optimizer=args.optimizer,
        )
        if args.model == "moe":
            common.update(
                experts=args.experts, topk=args.topk, capacity_factor=args.capacity_factor,
                first_dense=min(args.first_dense, args.layers), moe_ffn=args.moe_ffn or args.hidden,
            )
        cfg = ModelConfig(args.model, **common)
    par = Parallelism(dp=args.dp, tp=args.tp, pp=args.pp, ep=args.ep, nm=args.nm, cp=args.cp)
    cfg.check()
    check_defaults(args, cfg)
    check_run(args.gbs, args.variant)
    return cfg, par


def build(args: argparse.Namespace, cfg: ModelConfig, par: Parallelism,
          policy: Policy, spill: Spill) -> Plan | Columns:
    """The plan to write: columns for --format npz (by array arithmetic where
    gen_model/replicate.py expresses it, its columns spilled to disk), else
    rows; a bug variant is injected into rows (docs/bugs.md)."""
    if args.format == "npz" and not args.variant.startswith("br"):
        return make_columns(cfg, par, args.gbs, args.variant, policy, fold=args.fold,
                            spill=spill)
    plan = make_plan(cfg, par, args.gbs, args.variant, policy, fold=args.fold)
    if args.variant.startswith("br") and not par.is_single():  # docs/bugs.md
        plan = inject(plan, int(args.variant[2:]))
    return plan


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg, par = config_from(args)
        if args.cp_balance and par.cp < 2:  # a single-device plan has no policy to check
            raise ConfigError("--cp_balance needs --cp > 1")
        start = time.perf_counter()
        policy = Policy(vocab_parallel=args.vocab_parallel, schedule=args.schedule,
                        sequence_parallel=args.sequence_parallel, ulysses=args.ulysses,
                        cp_balance=args.cp_balance,
                        virtual_stages=args.vpp, zero=args.zero)
        plan = build(args, cfg, par, policy, Spill(args.out))
        pkl, spec = save(args, cfg, par, plan)
    except (ConfigError, PlanError) as e:
        sys.stderr.write(f"gen_model: error: {e}\n")
        return 2
    took = time.perf_counter() - start
    print(f"wrote {pkl} ({len(plan.nodes)} nodes, {len(plan.tensors)} tensors, {took:.1f} s)")
    print(f"wrote {spec}")
    return 0


def save(args: argparse.Namespace, cfg: ModelConfig, par: Parallelism,
         plan: Plan | Columns) -> tuple[Path, Path]:
    """Write the plan under its stem in --out; the plan file's and the world
    spec's paths."""
    stem = plan_stem(cfg, par, args.gbs, args.variant) + (
        "_sp" if args.sequence_parallel else "") + ("_ulysses" if args.ulysses else "") + (
        "_cpbal" if args.cp_balance else "") + (f"_vpp{args.vpp}" if args.vpp > 1 else "") + (
        f"_zero{args.zero}" if args.zero else "") + (
        f"_{args.optimizer}" if args.optimizer != "none" else "") + (
        "_fold" if args.fold else "")
    target = args.out / f"{stem}.{args.format}"
    if isinstance(plan, Columns):
        # make_columns validated these columns (the array path needs that
        # verdict to fall back to rows); they are immutable (a frozen
        # dataclass over arrays, the spilled ones read-only maps) and nothing
        # ran since, so validating them again while writing (1-2 minutes at
        # 405B) would check the same arrays twice.
        return save_columns_plan(plan, target, validated=True)
    return save_plan(plan, target)


if __name__ == "__main__":
    sys.exit(main())
