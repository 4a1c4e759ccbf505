"""Sensor-like depth and colour from exact renders: what an RGB-D camera adds to the geometry.

Depth effects (:func:`sensor_depth`), in order, each from the NumPy generator passed in, so a seed fixes them:

1. depth edges: a pixel whose 3 x 3 neighbourhood holds a reading more than ``edge_jump_m`` nearer or farther
   sits on a discontinuity, where a sensor integrates both surfaces (a mixed pixel). Each such pixel is dropped
   with probability ``edge_dropout`` (the mixed pixels sensors invalidate); of the others, a share
   ``flying_fraction`` are flying pixels, read at ``near + s (far - near)``, where ``near`` and ``far`` are the
   nearest and farthest readings of the neighbourhood (the foreground and the background surface) and ``s`` is
   the share of the pixel's footprint on the far surface: uniform in [0, 0.5) on the near side of the edge, in
   [0.5, 1) on the far side (the silhouette crosses the pixel's own half);
2. bias: the whole frame's depth is scaled by ``1 + b``, ``b`` drawn once per call (per frame) uniformly in
   ``[-bias_max, bias_max]`` (calibration and temperature drift: a few millimetres at 1 m);
3. noise: Gaussian, standard deviation ``noise_m_at_1m x z^2`` (stereo and structured-light error grows with the
   square of the distance);
4. holes: single pixels dropped with probability ``hole_fraction``, plus blobs (smooth random field above its
   ``1 - blob_fraction`` quantile: dark or shiny patches);
5. quantisation: rounded to ``quantum_m`` (uint16 millimetres), readings below 1 mm become 0.

Colour (:func:`sensor_rgb`): Gaussian noise of ``noise_std`` 8-bit levels, independent per pixel and channel,
then rounded and clipped to [0, 255].

The noise, hole and edge-dropout defaults are the mean strengths that training's scene sampler draws
(:class:`foundationpose.train.scenes.SceneConfig`: noise up to 2.5 mm at 1 m, holes up to 4 %, edge dropout 0.5
over 2 cm), so evaluation sees the sensor training prepared the networks for. Flying pixels, the per-frame bias
and the colour noise go beyond what training's sampler adds: a quarter of the edge pixels a sensor keeps fly
(sensors invalidate mixed pixels preferentially; one in eight of all edge pixels), a bias of at most 0.2 % (1 mm
at the scenarios' 0.53 m), colour noise of 2 levels (a good camera in office light).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import cv2
import numpy as np

from foundationpose.constants import MIN_VALID_DEPTH_M

__all__ = ["DEFAULT_COLOUR", "DEFAULT_SENSOR", "SensorColourConfig", "SensorDepthConfig", "depth_edges",
           "sensor_depth", "sensor_rgb"]

_FRACTIONS = ("hole_fraction", "blob_fraction", "edge_dropout", "flying_fraction")


@dataclass(frozen=True, slots=True, kw_only=True)
class SensorDepthConfig:
    """The depth effects of the module docstring (metres; fractions in [0, 1])."""

    noise_m_at_1m: float = 0.00125
    hole_fraction: float = 0.02
    blob_fraction: float = 0.03
    edge_jump_m: float = 0.02
    edge_dropout: float = 0.5
    flying_fraction: float = 0.25
    bias_max: float = 0.002
    quantum_m: float = 0.001

    def __post_init__(self) -> None:
        for name in _FRACTIONS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for f in fields(self):
            if f.name not in _FRACTIONS and getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")
        if self.quantum_m <= 0 or self.bias_max >= 0.1:
            raise ValueError(f"quantum_m must be > 0 and bias_max < 0.1, got {self.quantum_m} and {self.bias_max}")

    def describe(self) -> dict:
        """The model as the evaluation's JSON states it."""
        return {"kind": "sensor", **asdict(self)}


@dataclass(frozen=True, slots=True, kw_only=True)
class SensorColourConfig:
    """Colour noise: standard deviation in 8-bit levels, per pixel and channel."""

    noise_std: float = 2.0

    def __post_init__(self) -> None:
        if self.noise_std < 0:
            raise ValueError(f"noise_std must be >= 0, got {self.noise_std}")

    def describe(self) -> dict:
        """The model as the evaluation's JSON states it."""
        return {"kind": "sensor", **asdict(self)}


DEFAULT_SENSOR = SensorDepthConfig()
DEFAULT_COLOUR = SensorColourConfig()


def depth_edges(depth: np.ndarray, jump_m: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(edge, near, far) of an exact (H, W) depth map (0 = nothing): ``edge`` (H, W) bool marks readings whose
    3 x 3 neighbourhood holds a reading more than ``jump_m`` nearer or farther; ``near`` / ``far`` (H, W) float64
    are the nearest / farthest readings of that neighbourhood (the pixel itself included)."""
    exact = np.asarray(depth, dtype=np.float64)
    valid = exact >= MIN_VALID_DEPTH_M
    kernel = np.ones((3, 3), np.uint8)
    far = cv2.dilate(np.where(valid, exact, 0.0), kernel)
    near = cv2.erode(np.where(valid, exact, np.inf), kernel)
    edge = valid & ((far - exact > jump_m) | (exact - near > jump_m))
    return edge, near, far


def sensor_depth(depth: np.ndarray, rng: np.random.Generator, config: SensorDepthConfig = DEFAULT_SENSOR) -> np.ndarray:
    """(H, W) float32 metres: ``depth`` (exact, 0 = nothing) with the sensor effects of the module docstring."""
    exact = np.asarray(depth, dtype=np.float64)
    h, w = exact.shape
    valid = exact >= MIN_VALID_DEPTH_M
    edge, near, far = depth_edges(exact, config.edge_jump_m)
    u = rng.random(exact.shape)  # one draw per pixel: dropped edge / flying edge / kept edge
    dropped = edge & (u < config.edge_dropout)
    flying = edge & ~dropped & (u < config.edge_dropout + (1.0 - config.edge_dropout) * config.flying_fraction)
    near, far = np.where(edge, near, exact), np.where(edge, far, exact)  # finite wherever they are used
    # the share of the pixel's footprint on the far surface: under half on the near side of the edge, over half
    # on the far side (the silhouette crosses the pixel's own half)
    far_side = exact - near > far - exact
    share = 0.5 * (rng.random(exact.shape) + far_side)
    mixed = np.where(flying, near + share * (far - near), exact)
    bias = rng.uniform(-config.bias_max, config.bias_max)
    biased = mixed * (1.0 + bias)
    out = biased + rng.standard_normal(exact.shape) * config.noise_m_at_1m * biased * biased
    drop = dropped | (rng.random(exact.shape) < config.hole_fraction)
    if config.blob_fraction > 0:
        coarse = rng.random((max(2, h // 24), max(2, w // 24))).astype(np.float32)
        field = cv2.resize(coarse, (w, h), interpolation=cv2.INTER_LINEAR)
        drop |= field > np.quantile(field, 1.0 - config.blob_fraction)
    out = np.round(np.where(valid & ~drop, out, 0.0) / config.quantum_m) * config.quantum_m
    return np.where(out >= MIN_VALID_DEPTH_M, out, 0.0).astype(np.float32)


def sensor_rgb(rgb: np.ndarray, rng: np.random.Generator, config: SensorColourConfig = DEFAULT_COLOUR) -> np.ndarray:
    """(H, W, 3) uint8: ``rgb`` (uint8) with the colour noise of the module docstring."""
    noisy = np.asarray(rgb, dtype=np.float64) + rng.standard_normal(np.shape(rgb)) * config.noise_std
    return np.clip(np.round(noisy), 0, 255).astype(np.uint8)
