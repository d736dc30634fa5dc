"""Checks of the checker: the paper's bug suite (``bugs``), bugs that shipped
in real frameworks (``real_bugs``, ``seq_bugs``), the mutation operators
(``mutations``) and the oracle that judges a mutant by running it
(``oracle``). The generator (gen_model) and the verifier (verdict) never
import this package; it imports them (docs/mutation.md)."""
