"""The ``verdict`` command: one entry point for the project's three tools.

    verdict check --sm S --pm P [main.py's flags]   prove a plan pair (main.py)
    verdict torch [backends.torch's flags]          trace a PyTorch step and prove it
    verdict gen [gen_model's flags]                 write generated plans

Exit codes are main.py's: 0 equivalent, 1 not equivalent (with the
evidence), 2 bad input (one line), 3 no verdict. ``verdict torch`` writes
its plans to a temporary directory that is removed after the proof, unless
``-o DIR`` keeps them there; a FAIL prints the diagnosis and writes the
full counterexample to a file (``--details`` prints it).

A ``module:name`` reference (``--model``, ``--recipe``, ``--clipper``) is
imported as ``python -m`` would import it: from the current directory first,
then the installed packages.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

USAGE = __doc__.split("\n\n")[1]

# Each command imports its tool when it runs, so that `verdict check` does not
# load torch and the tracer.


def check(argv: list[str]) -> int:
    import main

    return main.main(argv)


def gen(argv: list[str]) -> int:
    from gen_model.__main__ import main as gen_main

    return gen_main(argv) or 0


def torch(argv: list[str]) -> int:
    """Trace with the torch backend, then prove the pair it wrote. A FAIL
    prints its diagnosis; the full counterexample goes to a file (main.py's
    --brief) unless --details prints it too."""
    import main
    from backends.torch.__main__ import parser, write_plans
    from backends.torch.errors import WrongStep
    from backends.torch.lowering import LoweringError
    from backends.torch.tracer.check import LoadedValueMismatch

    details = "--details" in argv
    argv = [a for a in argv if a != "--details"]
    keep = any(a in ("-o", "--out") or a.startswith("--out=") for a in argv)
    p = parser()
    p.prog = "verdict torch"
    p.add_argument("--details", action="store_true",
                   help="on a FAIL, print the full counterexample (nodes, tensors, values) too")
    with tempfile.TemporaryDirectory(prefix="verdict-torch-") as tmp:
        try:
            args = p.parse_args(argv if keep else [*argv, "-o", tmp])
        except SystemExit as e:  # --help, or a bad flag (argparse printed why)
            return main.EXIT_EQUAL if e.code == 0 else main.EXIT_BAD_INPUT
        try:
            sm, pm = write_plans(args, say=keep)
        except WrongStep as e:  # a finding before any proof (a LoweringError's subclass)
            print(f"❌ FAIL: {e}")
            return main.EXIT_DIFFERENT
        except LoweringError as e:
            print(f"error: {e}", file=sys.stderr)
            return main.EXIT_BAD_INPUT
        except LoadedValueMismatch as e:
            print(f"❌ FAIL: {e}")
            return main.EXIT_DIFFERENT
        return main.main(["--sm", str(sm), "--pm", str(pm), *([] if details else ["--brief"])])


COMMANDS: dict[str, Callable[[list[str]], int]] = {"check": check, "torch": torch, "gen": gen}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: verdict {{{','.join(COMMANDS)}}} ...\n\n{USAGE}\n\n"
              f"'verdict COMMAND --help' lists a command's flags.")
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if os.getcwd() not in sys.path:  # a console script's path starts at its bin folder
        sys.path.insert(0, os.getcwd())
    if command is None:
        print(f"error: unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)})",
              file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
