""""No host synchronisation in the hot path", as a tested property of every stage function of both lanes.

A dispatch-mode probe records the ATen ops of one steady-state call (after a warm-up call that fills the
constant caches) and refuses the ops that force a host sync on a GPU: ``.item()``/``int()``/``bool()`` of a
tensor (``_local_scalar_dense``), linalg error checks, ``nonzero``/``masked_select`` (data-dependent shapes)
boolean-mask indexing (``index[bool]``, a ``nonzero`` on CUDA) and tensor literals (``lift_fresh``: a blocking
host-to-device copy on CUDA). The renderer is probed on its
own (tests/foundationpose/test_render_cpu.py): the CPU rasteriser's draw loop is not a GPU hot path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from foundationpose.object_group import ObjectGroup
from foundationpose.observation import filter_and_backproject, filter_and_backproject_stacked
from foundationpose.pose_update import apply_refiner_output
from foundationpose.refine import (
    PairInputs,
    build_refiner_inputs,
    build_refiner_inputs_per_frame,
    run_refiner,
)
from foundationpose.render._cache import GeometryConstants
from foundationpose.sampling.translation import guess_translation
from foundationpose.score import build_scorer_inputs, run_scorer
from foundationpose.track_graph import TrackBuffers, _refiner_forward, track_step
from foundationpose.validity import ValidityModels, config_of

FORBIDDEN = {"_local_scalar_dense", "_linalg_check_errors", "nonzero", "masked_select", "lift_fresh", "index[bool]"}


class Probe(TorchDispatchMode):
    """Counts dispatched ops, except while ``paused`` (inside the renderer)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if not self.paused:
            name = func.overloadpacket.__name__
            if name in ("index", "index_put", "index_put_") and any(
                    isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None):
                name = "index[bool]"
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class ProbedRenderer:
    """The estimator's renderer with the probe paused while it renders."""

    def __init__(self, base: Any) -> None:
        self.base, self.name, self.device, self.config = base, base.name, base.device, base.config
        self.probe: Probe | None = None

    def render(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.probe is not None:
            self.probe.paused = True
        try:
            return self.base.render(*args, **kwargs)
        finally:
            if self.probe is not None:
                self.probe.paused = False


def _stage_calls(scene, est, c: GeometryConstants) -> dict[str, Callable[[], Any]]:  # noqa: ANN001
    """One call per stage function of the register and track lanes, on the test scene (CPU). ``c``: the memo
    the estimator owns and the lanes pass in (a fresh one here, as test_crop's probe does: the estimator
    fixture is shared by the suite and its memo may be full of other tests' cameras)."""
    renderer = ProbedRenderer(est.renderer)
    rgb, depth = torch.as_tensor(scene.rgb), torch.as_tensor(scene.depth)
    mask = torch.as_tensor(scene.mask)
    frame = filter_and_backproject(rgb, depth, scene.K, xyz_float64=True, constants=c)
    batch = filter_and_backproject_stacked(torch.stack([rgb, rgb]), torch.stack([depth, depth]), [scene.K, scene.K],
                                           constants=c)
    poses = est.hypotheses(frame, mask)
    n, s = len(poses), est.config.crop_size
    inputs = build_refiner_inputs(poses, frame, scene.obj, renderer, crop_size=s, constants=c)
    trans, rot = run_refiner(est.networks.refiner, inputs)
    out = torch.empty(n, s, s, 6), torch.empty(n, s, s, 6)
    track_poses = poses[:2].clone()
    track_out = torch.empty(2, s, s, 6), torch.empty(2, s, s, 6)
    step_buffers = TrackBuffers(2, tuple(scene.depth.shape), torch.device("cpu"))
    step_buffers.rgb.copy_(torch.stack([rgb, rgb]))
    step_buffers.depth.copy_(torch.stack([depth, depth]))
    step_buffers.K.copy_(torch.as_tensor(np.stack([scene.K, scene.K])))
    step_buffers.cam_from_centred.copy_(track_poses)
    step_forward, _ = _refiner_forward(est.networks.track_refiner)
    step_group = ObjectGroup([scene.obj], "cpu")  # the step over a group of one, validity included, as the runner runs it
    step_validity = step_group.validity(ValidityModels("cpu").of, config_of)
    track_inputs = PairInputs(render_input=track_out[0], transf_input=track_out[1], crop_from_img=None)  # type: ignore[arg-type]
    calls = {
        "register/upload": lambda: filter_and_backproject(rgb, depth, scene.K, xyz_float64=True, constants=c),
        "register/hypotheses": lambda: est.hypotheses(frame, mask),
        "register/guess_translation": lambda: guess_translation(frame.depth, mask, frame.K, constants=c),
        "register/valid_count": lambda: ((frame.depth >= 0.001) & mask).sum(),
        "register/render": lambda: build_refiner_inputs(poses, frame, scene.obj, renderer, crop_size=s, constants=c,
                                                        out_render=out[0], out_transf=out[1]),
        "register/refine": lambda: run_refiner(est.networks.refiner, inputs),
        "register/pose_update": lambda: apply_refiner_output(poses, trans, rot, scene.obj.diameter),
        "register/score_render": lambda: build_scorer_inputs(poses, frame, scene.obj, renderer, crop_size=s,
                                                             constants=c, out_render=out[0], out_transf=out[1]),
        "register/score_net": lambda: torch.argmax(run_scorer(est.networks.scorer, inputs)),
        "track/upload": lambda: filter_and_backproject_stacked(torch.stack([rgb, rgb]), torch.stack([depth, depth]),
                                                               [scene.K, scene.K], constants=c),
        "track/render": lambda: build_refiner_inputs_per_frame(track_poses, batch.rgb, batch.xyz_cam, batch.Ks,
                                                               scene.obj, renderer, crop_size=s, constants=c,
                                                               out_render=track_out[0], out_transf=track_out[1]),
        "track/refine": lambda: run_refiner(est.networks.track_refiner, track_inputs),
        "track/pose_update": lambda: apply_refiner_output(track_poses, trans[:2], rot[:2], scene.obj.diameter),
        # the whole step that is captured in a CUDA graph: a literal there fails the capture on the H200
        "track/captured_step": lambda: track_step(step_buffers, step_group, renderer, step_forward, iterations=2,
                                                  crop_size=s, constants=c, validity=step_validity),
    }
    return {name: _probed(call, renderer) for name, call in calls.items()}


def _probed(call: Callable[[], Any], renderer: ProbedRenderer) -> Callable[[], Counter[str]]:
    def run() -> Counter[str]:
        call()  # warm-up: fills the constant caches
        with Probe() as probe:
            renderer.probe = probe
            try:
                call()
            finally:
                renderer.probe = None
        return probe.ops
    return run


STAGES = ["register/upload", "register/hypotheses", "register/guess_translation", "register/valid_count",
          "register/render", "register/refine", "register/pose_update", "register/score_render",
          "register/score_net", "track/upload", "track/render", "track/refine", "track/pose_update",
          "track/captured_step"]


@pytest.fixture(scope="module")
def stage_calls(scene, tiny_estimator):  # noqa: ANN001
    if tiny_estimator.device.type != "cpu":
        pytest.skip("the dispatch probe runs on the CPU path (the same ops are dispatched on CUDA)")
    return _stage_calls(scene, tiny_estimator, GeometryConstants(name="probe"))


def test_every_lane_stage_is_listed(stage_calls) -> None:  # noqa: ANN001
    assert sorted(stage_calls) == sorted(STAGES)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_lane_stage_has_no_host_sync_in_steady_state(stage_calls, stage: str) -> None:  # noqa: ANN001
    ops = stage_calls[stage]()
    assert sum(ops.values()) > 0, "the probe saw no op: it would pass anything"
    assert not FORBIDDEN & set(ops), {name: ops[name] for name in FORBIDDEN & set(ops)}


def test_the_probe_catches_each_kind_of_sync() -> None:
    x = torch.arange(6.0)
    for name, call in {"_local_scalar_dense": lambda: int(x.sum()), "nonzero": lambda: x.nonzero(),
                       "_linalg_check_errors": lambda: torch.linalg.inv(torch.eye(3)),
                       "lift_fresh": lambda: torch.tensor(0.5), "index[bool]": lambda: x[x > 2],
                       "masked_select": lambda: x.masked_select(x > 2)}.items():
        with Probe() as probe:
            call()
        assert name in probe.ops, (name, probe.ops)
    assert np.isfinite(x.numpy()).all()
