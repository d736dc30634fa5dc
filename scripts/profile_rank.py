"""Where one traced rank's CPU time goes, phase by phase, in a fresh process.

    .venv/bin/python scripts/profile_rank.py [--rank R] ARGUMENTS OF python -m backends.torch

Prints CPU seconds of: importing torch's parallel APIs (what the fork
server imports once), the model's and recipe's modules and the libraries
the first model build imports (transformers, torchtitan: what the zygote
imports once per trace, docs/torch-backend.md), building the model, applying
the recipe, the step (forward, backward, ``after_backward``) unrecorded on
cold DTensor caches, the same step again unrecorded (warm caches), the step
recorded (warm caches; the difference is the recorder's own cost), and
pickling the rank's trace. CPU time, not wall time, so the figures hold
under load.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu() -> float:
    return time.process_time()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=0)
    opts, backend = ap.parse_known_args(argv)
    warnings.filterwarnings("ignore")
    phases: dict[str, float] = {}
    t = cpu()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from backends.torch.__main__ import model_kwargs, parser, resolve
    from backends.torch.tracer.rank import in_float64, load
    from backends.torch.tracer.ranks import PRELOAD
    from backends.torch.tracer.record import Recorder, Tracker, local_of
    for name in PRELOAD:
        __import__(name)
    phases["import torch, parallel APIs"] = cpu() - t

    args = resolve(parser().parse_args(backend))
    sizes = model_kwargs(args)
    world = args.pp * args.dp * args.tp
    torch.set_num_threads(1)  # as a rank runs (rank.one_thread)
    dist.init_process_group("fake", rank=opts.rank, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    t = cpu()
    factory, recipe = load(args.model), load(args.recipe)
    factory(**sizes)
    first = cpu() - t

    def model_and_recipe():
        t = cpu()
        torch.manual_seed(args.seed)
        model = factory(**sizes)._apply(in_float64)
        if hasattr(model, "global_tokens"):
            model.global_tokens = args.batch * args.seqlen
        built = cpu() - t
        t = cpu()
        after = recipe(model, mesh)
        return model, after, built, cpu() - t

    rows = args.batch // args.dp
    d = mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seqlen), generator=gen)[d * rows:(d + 1) * rows]
    labels = torch.randint(0, args.vocab, (args.batch, args.seqlen), generator=gen)[d * rows:(d + 1) * rows]

    def step(model, after, rec=None) -> float:
        t = cpu()
        if rec is None:
            model(tokens, labels).backward()
            if after is not None:
                after(model, mesh)
        else:
            with rec.tracker, rec:
                model(tokens, labels).backward()
                if after is not None:
                    after(model, mesh)
        return cpu() - t

    model, after, built, applied = model_and_recipe()
    phases["import model library (first build minus a build)"] = first - built
    phases["build the model"] = built
    phases["apply the recipe"] = applied
    phases["step, cold DTensor caches"] = step(model, after)
    model, after, _, _ = model_and_recipe()
    phases["step, warm caches"] = warm = step(model, after)
    model, after, _, _ = model_and_recipe()
    rec = Recorder(Tracker())
    for p in model.parameters():
        rec.new_value(local_of(p))
    phases["step recorded, warm caches"] = step(model, after, rec)
    phases["  of which the recorder"] = phases["step recorded, warm caches"] - warm
    t = cpu()
    pickle.dumps({"events": rec.events, "shapes": rec.shapes, "constvals": rec.constvals})
    phases["pickle the trace"] = cpu() - t
    print(f"rank {opts.rank} of {world}: {' '.join(backend)} ({len(rec.events)} events)")
    for name, seconds in phases.items():
        print(f"  {name:52s} {seconds:6.2f} s CPU")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
