"""``python -m foundationpose.evaluate``: accuracy of a set of weights on a recorded sequence and held-out synthetic
views; ``scenarios``: tracking robustness (validity, session states, recovery); ``calibrate``: validity thresholds."""

from foundationpose.evaluate.runs import evaluate_sequence, evaluate_views

__all__ = ["evaluate_sequence", "evaluate_views"]
