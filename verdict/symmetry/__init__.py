"""Symmetry: a parallel plan's replicas and microbatches shown to run one program.

The modules, each importing only those above it:

* ``rules``: the uniformity rules' shared facts and texts, one home per rule;
* ``fold``: folded plans (two replicas and microbatches shown), their side
  conditions and the single-device plan restricted to the shown rows;
* ``uniform``: the uniformity rules node by node, for a folded plan;
* ``arrays``: a plan's columns as the narrow arrays the block check reads;
* ``shards``: what the scan of ZeRO's owned shards finds (``Owned``), its
  refusal, and the readings of the arrays its parts share;
* ``owned_grads``: what becomes of an owned shard's gradient and of the
  shard: keeps, reduce-scatters and their chains, optimizer steps;
* ``owned``: ZeRO's owned shards, found and checked on the whole plan (the
  gathers here, the rest by ``owned_grads``);
* ``programs``: each node of a materialized plan matched with its
  representative's, and their kwargs compared, on arrays;
* ``glue``: the nodes that cross replicas, the accumulation chains and the
  glue rules, on arrays;
* ``blocks``: the uniformity rules on arrays, every block of a materialized
  plan against its class's representative (with ``programs`` and ``glue``);
* ``classes``: classes of replicas and microbatches that run another program;
* ``cut``: the representatives cut out of a checked plan as a folded plan;
* ``find``: :func:`find_symmetry`, the entry point: check, classes, cuts.

docs/soundness.md, "Folded plans" and "Materialized plans", holds the
arguments.
"""
