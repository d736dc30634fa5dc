"""The alignment and claims of one rank's lowered trace, in parts that the
builder's rank (``align/aligned.py`` ``AlignedRank``) is made of: which piece of its
single-device value each value of the rank is (``claim``), how inputs and
constants are matched (``inputs``), compute nodes (``nodes``), collectives
and splits (``collectives``), slices and joins of rows (``rows``), sums
deferred and regrouped (``sums``), exact zeros (``zeros``), how a claim is
carried through an operator (``dims``), a ring's attention (``ring``),
values that are pieces of no single-device value (``loose``), and a
constant's cut chosen among its true ones where it meets another value
(``recut``)."""
