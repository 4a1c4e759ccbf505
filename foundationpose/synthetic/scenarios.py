"""Synthetic RGB-D sequences with ground truth, for tracking robustness: clean motion and the ways tracking fails.

Every scenario renders the object (the project's renderer, OpenCV pixel centres, like the bundled sequence) on a
smooth trajectory in front of a tilted, textured plane, composites the layers by depth and, by default, gives the
depth and the colour the sensor effects of :mod:`foundationpose.synthetic.sensor`. Frames stand for
:data:`FPS` = 30 frames/s. Scenarios (:data:`SCENARIOS`), their events at fixed frames from the start, so that
more frames only lengthen the plain motion after them:

* ``clean``:      the object moves and turns smoothly, always in view (false alarms are counted here);
* ``occluder``:   a board in front sweeps over the object (frames 3-10, covering 0 -> 100 %), stays (to 18),
                  then uncovers it (19-24);
* ``leave``:      the object slides out of the image from frame 3 (0.15 diameters per frame; wholly out by
                  frame 20 at the demo's field of view), stays out 5 frames, and comes back at another place;
* ``jump``:       at frame 10 the object moves 0.7 diameters and turns 50 degrees between two frames (it moved
                  while the camera looked away);
* ``distractor``: a second object of similar size (the ``tee`` prism) stands beside it; the object is taken
                  away at frame 10 and put back at 18 (recovery must not settle on the distractor).

At the demo's intrinsics every event is over, and the object back in view, before :data:`EVENTS_END` (26);
:data:`DEFAULT_FRAMES` (64) leaves :data:`OBSERVE_FRAMES` (38) frames after that: 1 s at 30 frames/s for a
recovery to be observed, plus a margin. Scenarios may be shorter (down to :data:`MIN_FRAMES`); the evaluation
then reports the events it cannot judge as unobserved.

Each frame carries its ground-truth ``visible_fraction``: the share of the object's camera-facing surface that
is inside the image and not hidden (visible pixels / the object's own pixels, times the share of its facing
surface samples that project inside the image). Sizes are in object diameters, so any mesh works.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from foundationpose.mesh import ObjectModel
from foundationpose.render import Renderer
from foundationpose.surface import sample_surface
from foundationpose.synthetic.sensor import (
    DEFAULT_COLOUR,
    DEFAULT_SENSOR,
    SensorColourConfig,
    SensorDepthConfig,
    sensor_depth,
    sensor_rgb,
)

__all__ = ["DEFAULT_FRAMES", "EVENTS_END", "FPS", "MIN_FRAMES", "OBSERVE_FRAMES", "SCENARIOS", "Scenario",
           "ScenarioFrame", "demo_intrinsics", "make_scenario"]

SCENARIOS = ("clean", "occluder", "leave", "jump", "distractor")
FPS = 30.0  # frames per second the scenarios stand for (the trajectory's period is 60 frames: 2 s)
MIN_FRAMES = 30  # the leave scenario needs about 25 (slide out, stay out, come back) at the demo's field of view
EVENTS_END = 26  # every event is over, the object back in view, before this frame (demo intrinsics)
OBSERVE_FRAMES = 38  # frames after the events: 1 s at FPS (the recovery criterion) + 8 frames of margin
DEFAULT_FRAMES = EVENTS_END + OBSERVE_FRAMES
_EVENT_START = 3  # the occluder's sweep and the leave scenario's slide start here (register + 2 track frames)
_EVENT_AT = 10  # the jump; the distractor scenario's object is taken away here ...
_AWAY_FRAMES = 8  # ... for this many frames
_COVER_AT, _UNCOVER_AT, _UNCOVER_FRAMES = 11, 19, 6  # occluder: covered by 10, uncovering 19-24
_OUT_FRAMES = 5  # leave: frames wholly out of view
_DEMO_K = np.array(  # the official demo intrinsics at 640 x 480 (also the bundled sequence's)
    [[319.5820007324219, 0.0, 320.2149847676956], [0.0, 417.1186828613281, 244.3486680871047], [0.0, 0.0, 1.0]]
)
_DISTANCE_DIAMETERS = 3.5  # the object's centre depth (the bundled sequence: 0.53 m for a 0.153 m object)
_PLANE_BEHIND_DIAMETERS = 3.0  # the background plane's distance behind the object
_VISIBILITY_POINTS = 1000


def demo_intrinsics(hw: tuple[int, int]) -> np.ndarray:
    """The demo's (3, 3) K scaled from 640 x 480 to ``hw`` (H, W)."""
    scale = np.diag([hw[1] / 640.0, hw[0] / 480.0, 1.0])
    return scale @ _DEMO_K


@dataclass(frozen=True, slots=True, eq=False)
class ScenarioFrame:
    """rgb: (H, W, 3) uint8 RGB. depth: (H, W) float32 metres as delivered (sensor or exact; 0 = no reading).
    mask: (H, W) bool visible object pixels. cam_from_centred: (4, 4) float32 ground truth.
    visible_fraction: share of the camera-facing surface seen (module docstring)."""

    rgb: np.ndarray
    depth: np.ndarray
    mask: np.ndarray
    cam_from_centred: np.ndarray
    visible_fraction: float


@dataclass(frozen=True, slots=True, eq=False)
class Scenario:
    """name, description; K (3, 3) float64 and hw of every frame; frames; events: scenario-specific frame
    indices (e.g. ``{"jump": 10}``); depth / colour: the sensor models (``{"kind": "sensor", ...}`` or
    ``{"kind": "exact"}``); seed: the one that made it; fps: the frame rate the frames stand for."""

    name: str
    description: str
    K: np.ndarray
    hw: tuple[int, int]
    frames: list[ScenarioFrame]
    events: dict[str, Any] = field(default_factory=dict)
    depth: dict[str, Any] = field(default_factory=dict)
    colour: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    fps: float = FPS

    def __len__(self) -> int:
        return len(self.frames)


def _rot(axis: int, angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    i, j = [(1, 2), (2, 0), (0, 1)][axis]
    r = np.eye(3)
    r[i, i], r[i, j], r[j, i], r[j, j] = c, -s, s, c
    return r


def _trajectory(frames: int, diameter: float, seed: int) -> np.ndarray:
    """(frames, 4, 4) float64 smooth poses of the centred object: about 2 degrees and 0.06 diameters per frame."""
    rng = np.random.default_rng([seed, 0])
    base = _rot(0, math.radians(-125.0)) @ _rot(2, math.radians(25.0 + 40.0 * rng.random()))
    phase0 = rng.random() * 2 * math.pi
    poses = np.tile(np.eye(4), (frames, 1, 1))
    z0 = _DISTANCE_DIAMETERS * diameter
    for i in range(frames):
        p = phase0 + 2.0 * math.pi * i / 60.0  # one period per 60 frames
        poses[i, :3, :3] = _rot(2, math.radians(20.0) * math.sin(p)) @ _rot(1, math.radians(30.0) * math.sin(p + 1.0)) @ base
        poses[i, :3, 3] = [0.4 * diameter * math.sin(p), 0.2 * diameter * math.sin(2 * p), z0 + 0.3 * diameter * math.sin(p + 2)]
    return poses


def _background(K: np.ndarray, hw: tuple[int, int], distance: float, square: float) -> tuple[np.ndarray, np.ndarray]:
    """(H, W, 3) float32 RGB in [0, 1] and (H, W) float64 depth of a plane tilted 20 degrees (top farther)."""
    h, w = hw
    v, u = np.mgrid[0:h, 0:w].astype(np.float64)
    rays = np.stack([(u - K[0, 2]) / K[0, 0], (v - K[1, 2]) / K[1, 1], np.ones_like(u)], axis=-1)
    normal = np.array([0.0, math.sin(math.radians(20.0)), math.cos(math.radians(20.0))])
    z = distance * normal[2] / (rays @ normal)
    pts = rays * z[..., None]
    checker = (np.floor(pts[..., 0] / square) + np.floor((pts[..., 1] * normal[2] - pts[..., 2] * normal[1]) / square)) % 2
    colour = np.stack([0.55 + 0.2 * checker, 0.5 + 0.1 * np.tanh(pts[..., 0] * 4), 0.4 - 0.15 * checker], axis=-1)
    return colour.astype(np.float32), z


def _render(renderer: Renderer, obj: ObjectModel, poses: np.ndarray, K: np.ndarray, hw: tuple[int, int]):
    """(N, H, W, 3) float32 rgb, (N, H, W) float64 depth (inf where empty), (N, H, W) bool mask."""
    out = renderer.render_full_frame(obj.tensors, torch.as_tensor(poses, dtype=torch.float32, device=renderer.device),
                                     K, hw, pixel_centre_exact=True)
    mask = out.mask.cpu().numpy()
    depth = np.where(mask, out.xyz_cam[..., 2].cpu().numpy().astype(np.float64), np.inf)
    return out.rgb.cpu().numpy(), depth, mask


def _in_image_fraction(points: np.ndarray, normals: np.ndarray, pose: np.ndarray, K: np.ndarray,
                       hw: tuple[int, int]) -> float:
    """Share of the camera-facing surface samples that project inside the image (0 when none faces the camera)."""
    p = points @ pose[:3, :3].T + pose[:3, 3]
    n = normals @ pose[:3, :3].T
    facing = ((n * p).sum(1) < 0) & (p[:, 2] > 1e-3)
    if not facing.any():
        return 0.0
    z = np.maximum(p[:, 2], 1e-3)
    u = np.round(K[0, 0] * p[:, 0] / z + K[0, 2])
    v = np.round(K[1, 1] * p[:, 1] / z + K[1, 2])
    inside = facing & (u >= 0) & (u <= hw[1] - 1) & (v >= 0) & (v <= hw[0] - 1)
    return float(inside.sum() / facing.sum())


def _scenario_poses(name: str, frames: int, diameter: float, K: np.ndarray, hw: tuple[int, int], seed: int
                    ) -> tuple[np.ndarray, dict[str, Any], str]:
    poses = _trajectory(frames, diameter, seed)
    if name == "leave":  # from right of the centre it slides out at 0.15 diameters per frame, then comes back left
        z = poses[:, 2, 3]
        half_width = (hw[1] / 2) / K[0, 0] * z  # metres from the optical axis to the image edge at depth z
        x = 0.55 * half_width + 0.15 * diameter * np.maximum(0, np.arange(frames) - _EVENT_START)
        beyond = np.flatnonzero(x > half_width + 0.8 * diameter)  # past the edge: wholly out of view
        if len(beyond) == 0 or beyond[0] + _OUT_FRAMES > frames - 4:
            raise ValueError(f"frames={frames} leaves no room for the object to leave and come back; use more")
        out_at = int(beyond[0])
        back_at = out_at + _OUT_FRAMES
        poses[:back_at, 0, 3] = x[:back_at]
        poses[back_at:, 0, 3] -= 0.45 * half_width[back_at:]
        return poses, {"gone": [out_at, back_at]}, "slides out of the image, stays out, comes back on the other side"
    if name == "jump":
        at = _EVENT_AT
        offset = np.eye(4)
        offset[:3, :3] = _rot(1, math.radians(50.0))
        for i in range(at, frames):
            poses[i, :3, :3] = offset[:3, :3] @ poses[i, :3, :3]
            poses[i, :3, 3] += [-0.7 * diameter, 0.25 * diameter, 0.0]
        return poses, {"jump": at}, "moves 0.7 diameters and turns 50 degrees between two frames"
    if name == "distractor":
        gone = [_EVENT_AT, _EVENT_AT + _AWAY_FRAMES]
        return poses, {"gone": gone}, "taken away (a similar-size object stays beside it), then put back"
    if name == "occluder":
        return poses, {}, "a board sweeps over it (0 -> 100 % covered), stays, then uncovers it"
    return poses, {}, "moves and turns smoothly, always in view"


def make_scenario(name: str, obj: ObjectModel, renderer: Renderer, *, frames: int = DEFAULT_FRAMES,
                  hw: tuple[int, int] = (480, 640), K: np.ndarray | None = None, seed: int = 0,
                  depth: SensorDepthConfig | None = DEFAULT_SENSOR,
                  colour: SensorColourConfig | None = DEFAULT_COLOUR, distractor: ObjectModel | None = None
                  ) -> Scenario:
    """One scenario of :data:`SCENARIOS` for ``obj`` (see the module docstring).

    K: (3, 3) pixels (default: the demo's, scaled to ``hw``). seed (>= 0): the trajectory (its own stream) and
    the sensor effects (one stream for depth, one for colour, all three derived from ``seed``). depth / colour:
    the sensor models, None = exact depth / colour. distractor: the ``distractor`` scenario's second object
    (required there).
    """
    if name not in SCENARIOS:
        raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}; got {name!r}")
    if frames < MIN_FRAMES:
        raise ValueError(f"frames must be >= {MIN_FRAMES} (a scenario needs room for its events), got {frames}")
    if name == "distractor" and distractor is None:
        raise ValueError("the distractor scenario needs a distractor object")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    K = demo_intrinsics(hw) if K is None else np.asarray(K, dtype=np.float64)
    d = obj.diameter
    poses, events, description = _scenario_poses(name, frames, d, K, hw, seed)
    bg_rgb, bg_depth = _background(K, hw, (_DISTANCE_DIAMETERS + _PLANE_BEHIND_DIAMETERS) * d, 0.5 * d)
    obj_rgb, obj_depth, obj_mask = _render(renderer, obj, poses, K, hw)
    if name == "distractor":  # the object is taken away for the "gone" frames
        gone = events["gone"]
        obj_mask[gone[0]:gone[1]] = False
        obj_depth[gone[0]:gone[1]] = np.inf
    static: list[tuple[np.ndarray, np.ndarray]] = []  # layers behind or beside the object, the same every frame
    if name == "distractor":
        pose = poses[0].copy()
        pose[0, 3] += 1.6 * d * (1 if pose[0, 3] < 0 else -1)  # beside the object, on the side nearer the centre
        pose[:3, :3] = _rot(1, 0.6) @ pose[:3, :3]
        d_rgb, d_depth, _ = _render(renderer, distractor, pose[None], K, hw)
        static.append((d_rgb[0], d_depth[0]))
        events["distractor_cam_from_centred"] = pose.astype(np.float32)
    board = None
    if name == "occluder":
        board = _occluder(obj_mask, poses, d, hw)
        events["full_cover"] = board[2]
    samples = sample_surface(np.asarray(obj.mesh_centred.vertices), np.asarray(obj.mesh_centred.faces),
                             _VISIBILITY_POINTS, seed=0)
    depth_rng, colour_rng = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 2])
    out: list[ScenarioFrame] = []
    for i in range(frames):
        z, paint = bg_depth.copy(), bg_rgb.copy()
        layers = [*static, (obj_rgb[i], obj_depth[i])]
        if board is not None:
            layers.append((board[0][i], board[1][i]))
        for layer_rgb, layer_depth in layers:  # z-test, layer by layer
            nearer = layer_depth < z
            z = np.where(nearer, layer_depth, z)
            paint = np.where(nearer[..., None], layer_rgb, paint)
        visible = obj_mask[i] & (z == obj_depth[i])
        exact = np.where(np.isfinite(z), z, 0.0)
        seen = sensor_depth(exact, depth_rng, depth) if depth is not None else exact.astype(np.float32)
        rgb = np.clip(np.round(paint * 255.0), 0, 255).astype(np.uint8)
        if colour is not None:
            rgb = sensor_rgb(rgb, colour_rng, colour)
        alone = int(obj_mask[i].sum())
        fraction = 0.0 if alone == 0 else visible.sum() / alone * _in_image_fraction(
            samples.points, samples.normals, poses[i], K, hw)
        out.append(ScenarioFrame(rgb=rgb, depth=seen,
                                 mask=visible, cam_from_centred=poses[i].astype(np.float32),
                                 visible_fraction=float(fraction)))
    return Scenario(name=name, description=description, K=K, hw=hw, frames=out, events=events,
                    depth=depth.describe() if depth is not None else {"kind": "exact"},
                    colour=colour.describe() if colour is not None else {"kind": "exact"}, seed=seed)


def _occluder(obj_mask: np.ndarray, poses: np.ndarray, diameter: float, hw: tuple[int, int]
              ) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A board 1.2 diameters in front of the object whose right edge sweeps left to right across the object's
    box (frames 3 .. 10), stays until 18, then moves on past it, the object wholly uncovered again from frame 24
    (:data:`_COVER_AT`, :data:`_UNCOVER_AT`, :data:`_UNCOVER_FRAMES`). Returns its (F, H, W, 3) colour,
    (F, H, W) depth (inf outside it) and the [first, last) frames it covers the object fully."""
    frames, h, w = obj_mask.shape
    cols = np.arange(w)[None, :]
    rows = np.arange(h)[:, None]
    any_col = obj_mask.any(axis=1)  # (F, W)
    left = np.where(any_col.any(1), np.argmax(any_col, axis=1), w // 2)
    right = np.where(any_col.any(1), w - 1 - np.argmax(any_col[:, ::-1], axis=1), w // 2)
    start, cover, leave = _EVENT_START, _COVER_AT, _UNCOVER_AT
    rgb = np.zeros((frames, h, w, 3), np.float32)
    depth = np.full((frames, h, w), np.inf)
    width = int(1.5 * (right - left).max()) + 4
    for i in range(frames):
        if i < start:
            edge = left[i] - 2
        elif i < cover:
            edge = left[i] + (right[i] + 2 - left[i]) * (i - start + 1) / (cover - start)
        elif i < leave:
            edge = right[i] + 2
        else:
            edge = right[i] + 2 + (width + 4) * (i - leave + 1) / _UNCOVER_FRAMES
        inside = (cols <= edge) & (cols > edge - width) & (rows >= 0)
        depth[i][inside] = poses[i, 2, 3] - 1.2 * diameter
        shade = 0.35 + 0.1 * ((rows // 6 + cols // 6) % 2)
        rgb[i][inside] = (np.stack([shade * 1.2, shade, shade * 0.8], axis=-1) * np.ones((h, w, 1)))[inside]
    return rgb, depth, [cover - 1, leave]
