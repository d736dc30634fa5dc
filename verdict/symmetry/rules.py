"""The uniformity rules: one home for each, shared by the two checks.

A parallel plan's replicas and microbatches run one program when these
rules hold (docs/soundness.md, "Folded plans", step 3, and "Materialized
plans"). Two checks apply them: :class:`verdict.symmetry.uniform.Uniformity`
node by node on a folded plan, and
:class:`verdict.symmetry.blocks.BlockCheck` on arrays over every block of a
materialized plan. Each rule's facts and the text of its finding live here,
and the rules themselves, over arrays both checks gather: (a)
:func:`whole_orbit` and :func:`own_index` (with :func:`index_kwarg`), (b)
:func:`accumulation_chains`, (c) :func:`block_offsets`, (d)
:func:`sum_of_ends`, (e) :func:`reads_outside`, (f) :func:`last_writes` and
:func:`ends_with_chains`. The table names where each check gathers the data
for each rule and applies it. docs/soundness.md, "Folded plans" (step 3 and
"Why a SUCCESS covers the real run") and "Materialized plans: the symmetry
found and checked" (step 1), holds each rule's argument.

=====================================================  ========================  =========================
rule                                                   node by node (uniform)    on arrays (blocks)
=====================================================  ========================  =========================
every block and step program equals its                ``run``, ``normal``       ``representatives``,
representative's (operator, kwargs, tensors up to                                ``check_kwargs``,
renaming)                                                                        ``check_entries``
every class runs a program in every block              ``check_blocks``          ``check_present``
(a) another replica's tensor only in a sum over the    ``tensor``,               ``compare``,
whole orbit (:func:`whole_orbit`), at the node's own   ``check_orbit``           ``check_glue``,
index (:func:`own_index`)                                                        ``whole_orbit``
(b) another microbatch's tensor only as the running    ``tensor``,               ``compare``,
buffer of an accumulation chain from zeros             ``check_chains``          ``check_chains``
(:func:`accumulation_chains`)
(c) the blocks start b rows apart and cover the batch  ``check_offsets``,        ``check_offsets``,
once (:func:`block_offsets`, :func:`block_starts`)     ``tensor``                ``input_views``
(d) only sums of chain ends (:data:`ORBIT_SUMS`)       ``normal``                ``check_glue``
cross replicas (:func:`sum_of_ends`)
(e) a block reads nothing computed outside             ``tensor``                ``compare``
microbatches but :data:`CONSTANTS`
(:func:`reads_outside`)
(f) a rank's last gradient buffer is its chain's end   ``check_final_buffers``   ``check_glue``
or a sum of chain ends (:func:`last_writes`,
:func:`ends_with_chains`)
=====================================================  ========================  =========================

Where the two checks read a rule differently, each keeps what it did: an
``index`` that is a bool is an int to the node-by-node check and no index
on arrays (:func:`index_kwarg`); on arrays ZeRO's gathers, keeps, updates
and scatters (verdict/symmetry/owned.py checks them) are exempt from (d),
their gathered outputs from (e) and the keeps from (f); (e) on arrays
applies to an accumulation's running buffer too (node by node it is left
to (b), which requires a zeros buffer there anyway); a chain end, for (d)
and (f), is on arrays any output of a chain's last accumulation, and node
by node the one recorded for the tensor's own rank and logical id.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: Replicas and microbatches a folded plan shows on an axis it folds.
SHOWN = 2
#: The op that adds a microbatch's gradient into the running buffer.
ACCUMULATE = "local_grad_accumulation"
#: Collectives that may cross replicas: sums of gradient buffers' chain ends.
ORBIT_SUMS = ("reducer", "all_reduce")
#: Input-less nodes whose outputs a block may read outside microbatches.
CONSTANTS = ("zeros", "ones")

#: (a) a collective across replicas spans the orbit, at the node's own position
NOT_WHOLE_ORBIT = "its group is not the whole orbit of replicas"
NOT_OWN_INDEX = "its index is not its own position in the group"
#: (b) the running gradient buffer
NOT_RUNNING_BUFFER = ("its gradient buffer is not the running one (zeros, then each "
                      "microbatch's accumulation)")
#: (d) what may cross replicas
NOT_A_SUM_OF_ENDS = "only a sum of gradient buffers, after every microbatch, may cross replicas"
#: (e) what a block may read outside microbatches
READS_OUTSIDE = ("it reads a value computed outside microbatches, which may depend on every "
                 "block")
#: (f) the gradient buffer a rank ends with
NOT_LAST_BUFFER = ("the gradient buffer a rank ends with must be its accumulation's last "
                   "output or a sum of those (a reducer)")


def inner_size(world: dict) -> int:
    """The ranks of one replica between its replica index and tp, as the
    symmetry counts them: the ep ranks of the block times the cp ranks.
    The mesh puts replica d = edp * ep + e, so a rank's (edp, e, c) is
    (replica, inner index) of a mesh with edp replicas and ep * cp inner
    ranks."""
    return int(world.get("ep", 1)) * int(world.get("cp", 1))


def block_starts(first: dict[tuple, int]) -> dict[tuple[int, int], int]:
    """(replica, microbatch) -> the first batch row any rank class loads in
    that block, from (class, replica, microbatch) -> the class's first row
    there (-1: it loads none)."""
    out: dict[tuple[int, int], int] = {}
    for (_, d, m), row in first.items():
        if row >= 0:
            out[(d, m)] = min(out.get((d, m), row), row)
    return out


def block_offsets(first: dict[tuple, int], rows: int,
                  blocks: int) -> tuple[dict[tuple, int], list[int] | None]:
    """(c): the blocks' first rows (:func:`block_starts`) are ``rows``
    apart from 0, ``blocks`` of them, so that they cover the batch once.
    ``first``: (class, replica, microbatch) -> the class's first row there
    (-1: it loads none). Returns each key of ``first`` mapped to its
    block's first row (-1 where the class loads none), which inputs are
    compared relative to, and None; or, when the rule breaks, an empty map
    and the first rows found, sorted."""
    starts = block_starts(first)
    found = sorted(starts.values())
    if found != [k * rows for k in range(blocks)]:
        return {}, found
    return {(cls, d, m): starts[(d, m)] if row >= 0 else -1
            for (cls, d, m), row in first.items()}, None


def accumulation_chains(node: np.ndarray, key: np.ndarray, buf: np.ndarray, out: np.ndarray,
                        from_zeros: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(b): per ``key`` (a rank and its gradient buffer), the accumulations
    of microbatches (nodes ``node``, reading the buffer ``buf`` and writing
    ``out``) form one chain in node order: the first reads a zeros buffer
    made outside microbatches (``from_zeros``), every other the output of
    the one before it. Returns the order that sorts the accumulations by
    key, then node, and, in that order, whether each keeps the rule and
    whether it is the first and the last of its chain."""
    if not len(node):
        empty = np.zeros(0, dtype=bool)
        return np.zeros(0, dtype=np.int64), empty, empty, empty
    order = np.lexsort((node, key))
    key, buf, out, from_zeros = key[order], buf[order], out[order], from_zeros[order]
    first = np.concatenate(([True], key[1:] != key[:-1]))
    linked = np.concatenate(([False], buf[1:] == out[:-1]))
    last = np.concatenate((key[1:] != key[:-1], [True]))
    return order, np.where(first, from_zeros, linked), first, last


def whole_orbit(cls: np.ndarray, d: np.ndarray, dp: int) -> bool:
    """(a): the members of a collective across replicas, by their class
    and replica, are the whole orbit: every one of the ``dp`` replicas the
    same number of times with the same classes, in replica-major or
    replica-minor order."""
    if len(d) % dp:
        return False
    per = len(d) // dp
    if np.array_equal(d, np.repeat(np.arange(dp), per)):
        grid = cls.reshape(dp, per)
    elif np.array_equal(d, np.tile(np.arange(dp), per)):
        grid = cls.reshape(per, dp).T
    else:
        return False
    return bool((grid == grid[0]).all())


def index_kwarg(kwargs: dict, bool_is_int: bool = False) -> int:
    """(a): a collective's ``index`` kwarg as an int, -1 when it is none.
    The node-by-node check has always read a bool as the int it equals
    (``True``: 1) and passes ``bool_is_int``; the check on arrays reads it
    as no index. Both checks keep what they did."""
    index = kwargs.get("index")
    if isinstance(index, bool) and not bool_is_int:
        return -1
    return int(index) if isinstance(index, int) else -1


def own_index(index: np.ndarray, size: np.ndarray,
              rank_at: Callable[[np.ndarray, np.ndarray], np.ndarray],
              rank: np.ndarray) -> np.ndarray:
    """(a), the own index: a collective across replicas names its own rank
    at ``index`` (:func:`index_kwarg`) among its ``size`` members, so that
    every replica's copy of it is one program (its group is then named
    without the replica). ``rank_at(valid, index)`` gives the rank of the
    member at ``index`` where ``valid`` holds (-1 for an absent member;
    anything elsewhere). Whether each collective keeps the rule."""
    valid = (index >= 0) & (index < size)
    return valid & (rank_at(valid, index) == rank)


def sum_of_ends(is_sum: np.ndarray, mb: np.ndarray, of_ends: np.ndarray) -> np.ndarray:
    """(d): a node that reads another replica's tensor is an orbit sum
    (``is_sum``, an op of :data:`ORBIT_SUMS`) outside microbatches (``mb``
    -1) whose inputs are all gradient buffers' chain ends (``of_ends``):
    the glue between the blocks is then a plain sum, which repeats to any
    number of replicas. Whether each node keeps the rule."""
    return is_sum & (mb == -1) & of_ends


def reads_outside(node_mb: np.ndarray, t_mb: np.ndarray, computed: np.ndarray,
                  constant: np.ndarray) -> np.ndarray:
    """(e): whether a node of a microbatch (``node_mb`` >= 0) reads a
    tensor of no microbatch (``t_mb`` < 0) that a node computed
    (``computed``) and that is not a constant's (``constant``, an op of
    :data:`CONSTANTS`): a value made outside the blocks, after the
    reducers say, could depend on every block, which breaks the rule."""
    return (node_mb >= 0) & (t_mb < 0) & computed & np.logical_not(constant)


def last_writes(key: np.ndarray, writer: np.ndarray) -> np.ndarray:
    """(f)'s subjects: of writes of gradient buffers, ``key`` naming the
    rank and buffer written and ``writer`` the writing node, the position
    of each key's last write (in node order; of one node's writes the last
    given), in the order of the keys."""
    if not len(key):
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((writer, key))
    key = key[order]
    return order[np.concatenate((key[1:] != key[:-1], [True]))]


def ends_with_chains(chain_end: np.ndarray, sum_of_chain_ends: np.ndarray) -> np.ndarray:
    """(f): the gradient buffer a rank ends with is written by the
    accumulation that ends its chain (``chain_end``) or by an orbit sum of
    chain ends (``sum_of_chain_ends``). Whether each last write keeps the
    rule."""
    return chain_end | sum_of_chain_ends
