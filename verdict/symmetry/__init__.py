"""Symmetry: a parallel plan's replicas and microbatches shown to run one program.

The modules, each importing only those above it:

* ``rules``: the uniformity rules' shared facts and texts, one home per rule;
* ``fold``: folded plans (two replicas and microbatches shown), their side
  conditions and the single-device plan restricted to the shown rows;
* ``uniform``: the uniformity rules node by node, for a folded plan;
* ``arrays``: a plan's columns as the narrow arrays the block check reads;
* ``owned``: ZeRO's owned shards, found and checked on the whole plan;
* ``blocks``: the uniformity rules on arrays, every block of a materialized
  plan against its class's representative;
* ``classes``: classes of replicas and microbatches that run another program;
* ``cut``: the representatives cut out of a checked plan as a folded plan;
* ``find``: :func:`find_symmetry`, the entry point: check, classes, cuts.

docs/soundness.md, "Folded plans" and "Materialized plans", holds the
arguments.
"""
