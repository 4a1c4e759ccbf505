"""Serve request router of the pose deployment: a session's frames go back to the replica of its last frame.

Serve's router lives in the caller (the ingress). For each call it asks :meth:`choose_replicas` for
ranked candidate lists and takes the first replica with room (``max_ongoing_requests``), probing
queue lengths as Serve's own power-of-two router does:

1. the call's ``prefer_replica`` (the replica that served the session's last frame), while it is
   alive and not full: its batches and warm caches stay effective;
2. otherwise (a register, a stateless track, a dead or full preferred replica) two random other
   replicas, the less loaded one winning: Serve's power-of-two choices.

Whatever replica serves a frame, the answer is the same: the call carries the session's state.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

__all__ = ["SessionAffinityRouter", "preferred_replica"]


def preferred_replica(pending_request: PendingRequest | None) -> str | None:
    """The ``prefer_replica`` of the request's call argument (a :class:`~server.serve.calls.TrackCall`'s start), if
    any."""
    if pending_request is None or not pending_request.args:
        return None
    return getattr(getattr(pending_request.args[0], "start", None), "prefer_replica", None)


class SessionAffinityRouter(RequestRouter):
    """See the module docstring."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        prefer = preferred_replica(pending_request)
        ranks: list[list[RunningReplica]] = []
        others = []
        for replica in candidate_replicas:
            if prefer is not None and replica.replica_id.unique_id == prefer:
                ranks.append([replica])
            else:
                others.append(replica)
        if others:
            ranks.append(random.sample(others, min(2, len(others))))
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off when every candidate is full
        return ranks
