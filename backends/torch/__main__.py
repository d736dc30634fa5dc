"""Trace a PyTorch training step and write the plan pair to verify.

    python -m backends.torch --recipe backends.torch.recipes:tp_sp --dp 2 --tp 2 -o DIR

runs the step once on one device and once per rank of the (dp, tp) mesh
under a fake process group (one process per rank, ``backends.torch.ranks``),
lowers what each ran onto the rule table and writes ``DIR/STEM_single.pkl`` and
``DIR/STEM_parallel.pkl`` (with their JSON world specs; ``--format npz``:
columnar files, ``.npz``). Verify them with
``python main.py --sm ... --pm ...``. Exit 2 with one line on an op that is
not lowered or a recipe that does not run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from backends.planfile import save_plan
from backends.torch.errors import WrongStep
from backends.torch.lowering import (
    LoweringError,
    check_broadcasts,
    check_bucket_layouts,
    check_shards,
    lower_ranks,
    lower_trace,
)
from backends.torch.tracer.build import build_plans
from backends.torch.tracer.check import LoadedValueMismatch, check_loaded
from backends.torch.tracer.exchange import settle
from backends.torch.tracer.final_buffers import check_final_buffers
from backends.torch.tracer.mesh import DATA_NAMES, MeshSpec, parse_mesh
from backends.torch.tracer.rank import load, run
from backends.torch.tracer.ranks import trace_ranks
from backends.torch.tracer.routing import (
    check_every_expert_reached,
    check_lookups,
    check_skipped_add_nothing,
    describe,
    describe_added,
)
from backends.torch.tracer.seq_constants import order_sequence_constants
from backends.torch.tracer.seq_order import reorder_loaded, reorder_single, sequence_order_of
from backends.torch.tracer.token_rows import order_token_rows
from backends.userdirs import user_dir

#: short model names (``--model gpt2``); any other name is package.module:factory
MODELS = {
    "llama": "backends.torch.models:llama",
    "llama_mean": "backends.torch.models:llama_mean",
    "gpt2": "backends.torch.stock_models:gpt2",
    "gpt2_masked": "backends.torch.stock_models:gpt2_masked",
    "gpt2_mean": "backends.torch.stock_models:gpt2_mean",
    "mlp": "backends.torch.stock_models:mlp",
    "mlp_mean": "backends.torch.stock_models:mlp_mean",
    "llama_titan": "backends.torch.stock_models:llama_titan",
    "encoder": "backends.torch.stock_models:encoder",
    "encoder_prenorm": "backends.torch.stock_models:encoder_prenorm",
    **{name: f"backends.torch.stock_models:{name}" for name in (
        "gpt2_split", "gpt2_shifted", "gqa", "gqa_finfo", "gqa_additive", "gqa_pad", "gqa_pad_mean", "mlp_l1",
        "mlp_smooth_l1", "swiglu_regression", "swiglu_regression_mean")},
    **{f"gpt2_{name}": f"backends.torch.loss_models:{name}" for name in (
        "smooth", "smooth_mean", "smooth_pad", "smooth_pad_mean", "window", "padded", "padded_fill",
        "token_weighted")},
}
#: the module a recipe named without one (``--recipe tp_sp``) is taken from
RECIPES = "backends.torch.recipes"
#: where a recipe named without a module is looked for, in order
RECIPE_MODULES = (RECIPES, "backends.torch.stock_recipes", "backends.torch.scaling_recipes",
                  "backends.torch.loss_recipes")


#: the default model and recipe (``--hf`` replaces them)
MODEL, RECIPE = "backends.torch.models:llama", "backends.torch.recipes:tp_sp"


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Short model and recipe names to ``package.module:name`` references; a
    ``--hf`` family to its model, and its recipe unless one is given (a
    recipe named without a module is then one of ``backends.torch.hf``)."""
    hf = getattr(args, "hf", None)
    if hf is not None:
        hf = args.hf = text_of_composite(hf)
        refuse_hf(hf, args.tp)
        model = f"backends.torch.hf:{hf}"
        if args.model not in (MODEL, model):
            raise LoweringError("--hf and --model name two models: give one")
        args.model = model
        args.layers = layers_of(args)
        ep = getattr(args, "ep", 1)
        if ep > 1 and ep != args.dp * args.tp:
            raise LoweringError(f"--ep {ep}: transformers' expert-parallel plan is traced with "
                                f"ep = dp x tp ({args.dp * args.tp}: every rank holds its own "
                                f"experts)")
        if args.recipe == RECIPE:
            args.recipe = "ep_fsdp" if ep > 1 else "tp_fsdp"
        if ":" not in args.recipe:
            args.recipe = f"backends.torch.hf:{args.recipe}"
        args.name = args.name or (f"hf_{hf}_{args.recipe.rsplit(':', 1)[-1]}_dp{args.dp}"
                                  f"_tp{args.tp}{_layers_tag(args)}_b{args.batch}")
    elif getattr(args, "ep", 1) > 1:
        raise LoweringError("--ep is for --hf families (torchtitan's expert-parallel recipes set "
                            "ep = dp themselves: titan:parallelize_deepseekv3_ep)")
    args.model = _short_module(MODELS.get(args.model, args.model))
    args.recipe = _short_module(args.recipe)
    args.layers = layers_of(args)
    if getattr(args, "clipper", None):
        args.clipper = _short_module(args.clipper)
    if ":" not in args.recipe:
        args.recipe = f"{recipe_module(args.recipe)}:{args.recipe}"
    return args


def layers_of(args: argparse.Namespace) -> int | None:
    """``--layers``, else 1, or None for a torchtitan model (its flavor's
    blocks)."""
    if args.layers is not None or _short_module(args.model).startswith(
            f"{SHORT_MODULES['titan']}:"):
        return args.layers
    return 1


def model_kwargs(args: argparse.Namespace) -> dict:
    """The size keywords the model factory is called with (``layers`` left
    out where a torchtitan model keeps its flavor's blocks)."""
    layers = layers_of(args)
    return {**({"layers": layers} if layers is not None else {}), "hidden": args.hidden,
            "heads": args.heads, "ffn": args.ffn, "vocab": args.vocab, "seqlen": args.seqlen}


def _layers_tag(args: argparse.Namespace) -> str:
    """``_lyN`` of a plan file's name (nothing for a flavor's own blocks)."""
    return "" if args.layers is None else f"_ly{args.layers}"


#: module shorthands of ``--model``, ``--recipe`` and ``--clipper`` (``titan:qwen3``)
SHORT_MODULES = {"titan": "backends.torch.titan", "hf": "backends.torch.hf"}


def _short_module(ref: str) -> str:
    """``titan:NAME`` as ``backends.torch.titan:NAME`` (and the others of
    ``SHORT_MODULES``); any other reference as given."""
    module, sep, name = ref.partition(":")
    return f"{SHORT_MODULES[module]}:{name}" if sep and module in SHORT_MODULES else ref


def _last_line(e: Exception) -> str:
    """The last non-empty line of an error's text: where transformers'
    validation errors say the cause (their first line names the validator)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _single_failed(args: argparse.Namespace, e: Exception) -> str:
    """The line for a single-device step that did not run: for a ``--hf``
    family whose model transformers cannot build from the family's own
    default configuration either (a defect of the family, not of the small
    sizes), that."""
    what = f"{type(e).__name__}: {_last_line(e)}"
    family = getattr(args, "hf", None)
    if family is not None:
        from backends.torch.zoo import hf
        own = hf.default_build_error(family)
        if own is not None and own.startswith(type(e).__name__):
            return (f"--hf {family}: transformers cannot build the family's model from its own "
                    f"default configuration either ({own}): not the small sizes")
    return f"the single-device step did not run: {what}"


def _rank_failed(args: argparse.Namespace, line: str) -> str:
    """The line for a rank that did not run (its step raised) while the
    single-device step ran: for a ``--hf`` family, that it ran under
    transformers' own plans (the family's tensor-parallel plan at tp > 1),
    so the failure is the plan's (docs/soundness.md, "Plans traced from
    PyTorch", 110 (c))."""
    head, sep, rest = line.partition(" did not run: ")
    family = getattr(args, "hf", None)
    if not sep or family is None or not head.startswith("rank "):
        return line
    recipe = args.recipe.rsplit(":", 1)[-1]
    plan = (f"transformers' own tensor-parallel plan for '{family}' (tp {args.tp}, recipe "
            f"{recipe})" if args.tp > 1 else f"the recipe {recipe} of '{family}'")
    return f"{head} did not run under {plan}: {rest}"


def text_of_composite(family: str) -> str:
    """A composite family's text model's family, with its one-line note on
    stderr (``zoo/hf_composite.py``); any other family as it is."""
    from backends.torch.zoo import hf
    from backends.torch.zoo.hf_composite import text_family
    try:
        cfg_cls, model_cls = hf.classes(family)
        found = text_family(family, hf._default(cfg_cls), model_cls, hf.families())
    except Exception:  # noqa: BLE001 - not a family, or no default: refuse_hf says why
        return family
    if found is None:
        return family
    print(found[1], file=sys.stderr)
    return found[0]


def refuse_hf(family: str, tp: int) -> None:
    """A ``--hf`` family the backend cannot build or parallelize at ``tp``:
    one line (``backends.torch.hf.refusal``)."""
    from backends.torch.zoo import hf
    try:
        why = hf.refusal(family, tp)
    except ImportError as e:
        raise LoweringError(f"--hf needs transformers (pip install '.[hf]'): {e}") from None
    except Exception as e:  # a configuration transformers itself cannot build: bad input
        raise LoweringError(f"--hf {family}: transformers cannot build its default configuration: "
                            f"{type(e).__name__}: {_last_line(e)}") from None
    if why is not None:
        raise LoweringError(why)


def recipe_module(name: str) -> str:
    """The first of ``RECIPE_MODULES`` that defines ``name`` (the first
    module when none does: loading it then says so)."""
    for module in RECIPE_MODULES:
        if hasattr(importlib.import_module(module), name):
            return module
    return RECIPES


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m backends.torch", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=MODEL,
                   help="model factory, package.module:function or a short name: "
                        + ", ".join(MODELS) + " (default: %(default)s)")
    p.add_argument("--recipe", default=RECIPE,
                   help="parallelization recipe, package.module:function, or a function "
                        f"of {', '.join(RECIPE_MODULES)} by name (default: %(default)s)")
    p.add_argument("--hf", metavar="FAMILY", default=None,
                   help="a Hugging Face transformers causal-LM model type (llama, gemma2, gpt2, "
                        "phi3, ...: any of transformers' auto mapping) built from a small "
                        "random config and parallelized by transformers itself; the "
                        "recipe defaults to backends.torch.hf:tp_fsdp (docs/torch-backend.md)")
    p.add_argument("--layers", type=int, default=None,
                   help="transformer blocks (default: 1; torchtitan's models: the flavor's)")
    p.add_argument("--hidden", type=int, default=16, help="hidden size (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    p.add_argument("--ffn", type=int, default=32, help="feed-forward size (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=16, help="vocabulary size (default: %(default)s)")
    p.add_argument("--seqlen", type=int, default=4, help="sequence length (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4,
                   help="global batch size of the step (default: %(default)s)")
    p.add_argument("--dp", type=int, default=2,
                   help="data-parallel degree of the mesh (default: %(default)s)")
    p.add_argument("--tp", type=int, default=2,
                   help="tensor-parallel degree of the mesh (default: %(default)s)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree of a --hf mixture of experts: its own "
                        "expert-parallel plan (base_model_ep_plan) through "
                        "DistributedConfig(ep_size=EP), EP = dp x tp; the recipe defaults to "
                        "backends.torch.hf:ep_fsdp (default: %(default)s)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages, for a pipelining recipe (default: %(default)s)")
    p.add_argument("--mesh", default=None, metavar="NAME=SIZE,...",
                   help="the recipe's mesh, dims named and sized in your order (e.g. "
                        "dp_replicate=2,dp_shard=2,cp=1,tp=2); replaces --pp/--dp/--tp "
                        "(default: pp=PP,dp=DP,tp=TP; backends/torch/mesh.py)")
    p.add_argument("--data-dims", dest="data_dims", default=None, metavar="NAME,...",
                   help="the --mesh dims that split the batch, outer first (default: those "
                        "named " + ", ".join(DATA_NAMES) + ")")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the model's weights and inputs (default: %(default)s)")
    p.add_argument("--optimizer", choices=("none", "sgd", "adamw"), default="none",
                   help="end the step with torch.optim's SGD or AdamW (default: %(default)s)")
    p.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                   help="clip the gradients by their total norm before the optimizer")
    p.add_argument("--clipper", default=None,
                   help="how a rank clips, package.module:function called as "
                        "clipper(model, mesh, max_norm) (default: "
                        "backends.torch.recipes:clip_grad_norm)")
    p.add_argument("-o", "--out", default=str(user_dir("plans") / "torch"),
                   help="output directory (default: %(default)s)")
    p.add_argument("--format", choices=("pkl", "npz"), default="pkl",
                   help="plan file form: pickled rows or columnar (docs/plan-format.md; "
                        "default: %(default)s)")
    p.add_argument("--name", default=None, help="plan stem (default: from the recipe and sizes)")
    return p


def user_mesh(args: argparse.Namespace) -> MeshSpec | None:
    """``--mesh`` (None without it), its layout set as ``args``' pp, dp, tp
    and cp (the context-parallel size; 1 without ``--mesh``)."""
    text = getattr(args, "mesh", None)
    if text is None:
        if getattr(args, "data_dims", None):
            raise LoweringError("--data-dims names dims of --mesh: give --mesh too")
        return None
    mesh = text if isinstance(text, MeshSpec) else parse_mesh(text, getattr(args, "data_dims", None))
    args.pp, args.dp, args.tp = mesh.layout()
    args.cp = mesh.size("cp")
    return mesh


def _check_run_on_none(spec: dict, size: int, single: dict, traces: list[dict],
                       world: dict) -> None:
    """Every expert the single-device step runs is reached on every rank;
    where a rank's loop was given one to run on no token, the ranks traced
    again as their code runs end with the same values, and the world spec
    names the experts so run (docs/soundness.md, "Plans traced from
    PyTorch", 88)."""
    check_every_expert_reached(single, traces)
    if not any(t.get("routing_added") for t in traces):
        return
    own = settle(lambda sent: trace_ranks({**spec, "exchanges": sent, "ends": True}, size,
                                          single.get("imports", ())))
    check_skipped_add_nothing(traces, own)
    world["routing"] += "; " + describe_added(traces)


def trace_and_build(args: argparse.Namespace, single: dict | None = None):
    """Trace the step on one device (unless ``single`` is given) and on every
    rank; the two plans."""
    args = resolve(args)
    mesh = user_mesh(args)
    cp = getattr(args, "cp", 1) if mesh is not None else 1
    kw = model_kwargs(args)
    spec = {"model": args.model, "model_kwargs": kw, "recipe": args.recipe, "dp": args.dp,
            "tp": args.tp, "pp": args.pp, "cp": cp, "batch": args.batch, "seqlen": args.seqlen,
            "vocab": args.vocab, "seed": args.seed, "optimizer": args.optimizer,
            "clip": args.clip, "clipper": args.clipper,
            **({"mesh": mesh.as_spec()} if mesh else {})}
    world = {"model": args.model, "variant": "torch", "gbs": args.batch, "dp": args.dp,
             "tp": args.tp, "pp": args.pp, "cp": cp, "ep": 1, "nm": 1,
             "recipe": args.recipe,
             **{k: v for k, v in kw.items()}, **({"mesh": mesh.label()} if mesh else {})}
    for ref in (args.model, args.recipe, *([args.clipper] if args.clipper else [])):
        try:
            load(ref)
        except (ValueError, ImportError, AttributeError) as e:
            raise LoweringError(f"cannot load '{ref}': {e}") from None
    if single is None:
        try:
            single = run({**spec, "parallel": False}, 0)
        except Exception as e:  # the user's model failing on one device: bad input, one line
            raise LoweringError(_single_failed(args, e)) from None
    routing = single.get("routing") or None  # replayed on every rank (routing.py)
    if routing is not None:
        world["routing"] = describe(single["routing_summary"])
    # without expert parallelism a rank's experts loop is given the experts
    # the single-device step runs and its rows route no token to (routing.
    # hits); with it an expert's rank runs it on the rows every rank sends
    fill = bool(single.get("skips_unrouted_experts")) and getattr(args, "ep", 1) <= 1
    try:
        traces = settle(lambda sent: trace_ranks(
            {**spec, "parallel": True, "routing": routing, "exchanges": sent, "fill_skipped": fill},
            args.pp * args.dp * cp * args.tp, single.get("imports", ())))
    except LoweringError as e:
        raise LoweringError(_rank_failed(args, str(e))) from None
    world["nm"] = traces[0]["microbatches"]
    check_lookups(traces)  # a hash router's choice, by value (item 128 b)
    if fill:
        _check_run_on_none({**spec, "parallel": True, "routing": routing},
                           args.pp * args.dp * cp * args.tp, single, traces, world)
    check_shards(traces)
    check_broadcasts(traces)
    buffers = check_final_buffers(single, traces)  # item 105
    if buffers is not None:
        world["final_buffers"] = buffers
    low_s = lower_trace(single, args.vocab)
    lows = lower_ranks(traces, args.vocab)
    check_bucket_layouts(lows)
    order_token_rows(single, low_s, lows, args.dp, args.tp, cp)  # items 89, 115
    order = sequence_order_of(traces)
    for low in lows:
        low.reordered = order is not None
    carried = order_sequence_constants(low_s, order) if order is not None else None  # item 127
    plan_s, plan_p = build_plans(low_s, lows, world)
    loaded = single
    if order is not None:  # a load balancer's: the single-device step in its order
        plan_s = reorder_single(plan_s, order, carried)
        loaded = reorder_loaded(single, order)
    check_loaded(loaded, traces, plan_p)
    return (plan_s, plan_p), single


def write_plans(args: argparse.Namespace, say: bool = True) -> tuple[Path, Path]:
    """Trace, build and write the pair into ``args.out``; the two paths
    (printed unless not ``say``). Raises LoweringError (exit 2) and
    LoadedValueMismatch (exit 1)."""
    (plan_s, plan_p), _ = trace_and_build(args)  # resolves args' short names in place
    pp = f"_pp{args.pp}" if args.pp > 1 else ""
    pp += f"_cp{args.cp}" if getattr(args, "cp", 1) > 1 else ""
    stem = args.name or (f"{args.recipe.rsplit(':', 1)[-1]}_dp{args.dp}_tp{args.tp}{pp}"
                         f"{_layers_tag(args)}_b{args.batch}")
    out = Path(args.out)
    sm, _ = save_plan(plan_s, out / f"{stem}_single.{args.format}")
    pm, _ = save_plan(plan_p, out / f"{stem}_parallel.{args.format}")
    for path, plan in ((sm, plan_s), (pm, plan_p)) if say else ():
        print(f"wrote {path} ({len(plan.nodes)} nodes, {len(plan.tensors)} tensors) "
              f"and its world spec {path.with_suffix('.json')}")
    if say and "routing" in plan_s.world:
        print("the routing recorded on one device, replayed on every rank (a hash router's "
              "table lookups computed by each rank and compared with it; what a SUCCESS "
              "covers): " + plan_s.world["routing"])
    return sm, pm


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        sm, pm = write_plans(args)
    except WrongStep as e:  # a finding before any proof (a LoweringError's subclass)
        print(f"FAIL: {e}")
        return 1
    except LoweringError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except LoadedValueMismatch as e:
        print(f"FAIL: {e}")
        return 1
    except Exception as e:  # an internal error is no verdict: never exit 0 or 1
        print(f"internal error (no verdict): {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    print(f"verify them: python main.py --sm {sm} --pm {pm}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
