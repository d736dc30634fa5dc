"""The lowering's pending values of the batch's ids (the protocol and the
other kinds: ``ir``, which imports these).

- ``Ids``: made by walk (the batch), layout, onehot, vocab_parallel; read by
  ids, masks, tokens, slices, layout, onehot, arithmetic, vocab_parallel,
  label_masks, scan; not Pending: one-hot inputs (``onehot.one_hot``).
- ``IdRows``: made by ids, layout, onehot, tokens, label_masks; read by ids,
  masks, tokens, slices, layout, label_masks, scan; not Pending: its one-hot
  rows ``x``.
- ``IdsTest``: made by tokens (``ids < c``); read by tokens, arithmetic,
  vocab_parallel; not Pending.
- ``VocabMask``: made by tokens (``lt | ge``); read by tokens, arithmetic,
  vocab_parallel; not Pending.
- ``Shifted``: made by tokens (``ids - lo``); read by tokens, arithmetic,
  vocab_parallel; not Pending.
- ``MaskedLookup``: made by tokens (vocab-parallel emb); read by tokens (its
  ``index_put_``); refused until the rows are zeroed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from backends.torch.errors import LoweringError
from backends.torch.lowering.pending import Pending

if TYPE_CHECKING:
    from backends.torch.lowering.context import Lowerer


@dataclass(frozen=True)
class Ids:
    """Row block ``index`` of ``parts`` of the batch's integer ``source``
    ids (``tokens`` or ``labels``; a pipeline schedule's microbatch, the
    whole batch is (0, 1)), seen with ``shape`` (None: as loaded). In the
    plan, ids are one-hot inputs ``[..., vocab]``."""
    source: str = "tokens"
    index: int = 0
    parts: int = 1
    shape: tuple[int, ...] | None = None

    def cut(self, index: int, parts: int) -> Ids:
        return Ids(self.source, self.index * parts + index, self.parts * parts)


@dataclass(frozen=True, eq=False)
class IdRows:
    """Integer ids the model cut or padded (``labels[:, 1:]``, ``F.pad(...,
    value=-100)``): their one-hot rows ``x`` (lowered, ``[*ids.shape,
    vocab]``; an id outside the vocabulary, a pad, is a zero row) and the
    recorded ids themselves (for the count a mean divides by)."""
    x: int
    ids: np.ndarray


@dataclass(frozen=True)
class IdsTest:
    """``ids < value`` (op "lt") or ``ids >= value`` (op "ge")."""
    ids: Ids
    op: str
    value: int


@dataclass(frozen=True)
class VocabMask:
    """``(ids < lo) | (ids >= hi)``: the ids outside the rows [lo, hi) of a
    vocabulary-parallel embedding table."""
    ids: Ids
    lo: int
    hi: int


@dataclass(frozen=True)
class MaskedLookup(Pending):
    """A vocabulary-parallel lookup (its lowered value ``out``: the one-hot
    slice times the local table, already zero outside the rows) before the
    recorded run zeroes the rows of ids outside the shard. Until that
    ``index_put_`` only it may read the lookup: the recorded tensor still
    holds table row 0 there, which the lowered value does not."""
    out: int
    mask: VocabMask

    def materialize(self, lw: Lowerer) -> int:
        raise LoweringError(f"{lw.name}: a vocabulary-parallel lookup is read before the rows "
                            f"of ids outside its shard are zeroed")


@dataclass(frozen=True)
class Shifted:
    """``ids - lo``, then (``mask`` set) 0 where the mask holds: the local
    row of each id in the shard [lo, hi)."""
    ids: Ids
    lo: int
    mask: VocabMask | None = None
