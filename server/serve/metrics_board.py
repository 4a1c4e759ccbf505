"""A named Ray actor where every pose replica publishes its metric families, for the ingress' ``/metrics``.

A Serve handle routes a call to *one* replica, so the ingress cannot ask each replica itself.
Instead each replica pushes a snapshot every ``metrics_interval_s``; ``/metrics`` renders the
fresh ones with a ``replica`` label. Snapshots older than ``max_age_s`` (a replica that died or
was replaced) are dropped. The board is created by whoever needs it first (``get_if_exists``) and
belongs to that process; if it dies, the next publish creates it again (snapshots are re-sent
every interval, so nothing lasting is lost).
"""

from __future__ import annotations

import logging
import time

import ray

from server.metrics import Family

__all__ = ["MetricsBoard", "board_handle", "labelled"]

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class MetricsBoard:
    """replica id -> (time received, families)."""

    def __init__(self) -> None:
        self._snapshots: dict[str, tuple[float, list[Family]]] = {}

    def publish(self, replica: str, families: list[Family]) -> None:
        self._snapshots[replica] = (time.monotonic(), families)

    def withdraw(self, replica: str) -> None:
        self._snapshots.pop(replica, None)

    def snapshots(self, max_age_s: float) -> dict[str, list[Family]]:
        now = time.monotonic()
        for replica in [r for r, (at, _) in self._snapshots.items() if now - at > max_age_s]:
            del self._snapshots[replica]
        return {replica: families for replica, (_, families) in self._snapshots.items()}


def board_handle(app_name: str) -> ray.actor.ActorHandle:
    """The application's board (created on first use)."""
    return MetricsBoard.options(name=f"{app_name}-metrics-board", get_if_exists=True).remote()


def labelled(snapshots: dict[str, list[Family]]) -> list[Family]:
    """One family per name, each sample labelled with its ``replica`` (families keep their first HELP/TYPE)."""
    merged: dict[str, Family] = {}
    for replica in sorted(snapshots):
        for fam in snapshots[replica]:
            out = merged.setdefault(fam.name, Family(fam.name, fam.type, fam.help))
            out.samples.extend((suffix, (("replica", replica),) + labels, value) for suffix, labels, value in fam.samples)
    return list(merged.values())
