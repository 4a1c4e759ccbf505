"""``python -m foundationpose.evaluate``: accuracy of a set of weights on a recorded sequence and held-out synthetic views."""

from foundationpose.evaluate.runs import evaluate_sequence, evaluate_views

__all__ = ["evaluate_sequence", "evaluate_views"]
