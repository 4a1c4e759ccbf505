"""The demo's console summary: titled tables of the run, its accuracy, the trust in its answers and the timing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from foundationpose.demo.tables import format_table

if TYPE_CHECKING:
    from foundationpose.demo.cli import DemoSummary

__all__ = ["summary_tables"]


def summary_tables(summary: DemoSummary) -> str:
    """The run, its accuracy against ground truth, the trust in its answers and the per-stage timing, as
    titled tables."""
    out = [format_table(
        "Run", ["frames", "mode", "device", "network", "wall s", "fps", "register ms", "track ms/frame"],
        [[summary.frames, summary.mode, summary.device, f"{summary.backend}/{summary.precision}", summary.wall_s,
          summary.fps, summary.register_ms, summary.track_ms_mean]])]
    if summary.metrics is not None:
        m = summary.metrics
        symmetric = summary.trust is not None and summary.trust.get("symmetry") is not None
        metrics = [("ADD (cm)", "add_m", 100.0), ("ADD-S (cm)", "adds_m", 100.0),
                   *([("ADD under symmetries (cm)", "add_sym_m", 100.0)] if symmetric else []),
                   ("rotation error (deg)", "rot_deg", 1.0), ("translation error (cm)", "trans_m", 100.0)]
        rows = [[name, *(scale * m[key][s] for s in ("mean", "median", "max"))] for name, key, scale in metrics]
        note = (f"success rate {100 * m['success_rate']:.1f}% (ADD{' under symmetries' if symmetric else ''} < "
                f"{100 * m['success_threshold_m']:.2f} cm = 0.1 diameter); ADD on 2000 uniform surface samples")
        if summary.random_weights:
            note += "\nRANDOM WEIGHTS: poses meaningless, so are these errors"
        out.append(format_table("Accuracy against ground truth", ["metric", "mean", "median", "max"], rows, note))
    if summary.trust is not None:
        t = summary.trust
        rows = [[state, count, f"{100 * count / max(t['frames'], 1):.1f}%"] for state, count in t["states"].items()]
        note = (f"poses reported valid: {t['pose_valid_frames']} of {t['frames']}; confidence mean "
                f"{t['confidence_mean']:.2f}, min {t['confidence_min']:.2f}" if t["frames"] else None)
        out.append(format_table("Trust: session state per frame", ["state", "frames", "share"], rows, note))
    out.append("Timing per stage (ms)\n=====================\n" + summary.timing_table)
    return "\n\n".join(out)
