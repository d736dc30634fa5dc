"""The oracle's evaluator (harness/evaluator.py) knows every operator of the
rule table: a new rule without its independent definition would make the
oracle refuse every plan that uses it, and the mutation harness blind there."""

from harness.evaluator import known_ops
from verdict.ops import OPS


def test_every_rule_has_an_independent_definition() -> None:
    missing = sorted(set(OPS) - known_ops())
    assert not missing, f"harness/evaluator.py has no definition of {missing}"
