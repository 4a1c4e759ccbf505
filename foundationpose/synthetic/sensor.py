"""Sensor-like depth from an exact depth map: what an RGB-D camera adds to the geometry.

Effects, in order (each from the NumPy generator passed in, so a seed fixes them):

1. noise: Gaussian, standard deviation ``noise_m_at_1m x z^2`` (stereo and structured-light error grows with the
   square of the distance);
2. holes: single pixels dropped with probability ``hole_fraction``, plus blobs (smooth random field above its
   ``1 - blob_fraction`` quantile: dark or shiny patches);
3. edge dropout: pixels next to a depth discontinuity over ``edge_jump_m`` dropped with probability
   ``edge_dropout`` (mixed pixels that sensors invalidate);
4. quantisation: rounded to ``quantum_m`` (uint16 millimetres), readings below 1 mm become 0.

The defaults are the mean strengths that training's scene sampler draws (:class:`foundationpose.train.scenes.
SceneConfig`: noise up to 2.5 mm at 1 m, holes up to 4 %, edge dropout 0.5 over 2 cm), so evaluation sees the
sensor training prepared the networks for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import cv2
import numpy as np

from foundationpose.constants import MIN_VALID_DEPTH_M

__all__ = ["DEFAULT_SENSOR", "SensorDepthConfig", "sensor_depth"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SensorDepthConfig:
    noise_m_at_1m: float = 0.00125
    hole_fraction: float = 0.02
    blob_fraction: float = 0.03
    edge_jump_m: float = 0.02
    edge_dropout: float = 0.5
    quantum_m: float = 0.001

    def describe(self) -> dict:
        """The model as the evaluation's JSON states it."""
        return {"kind": "sensor", **asdict(self)}


DEFAULT_SENSOR = SensorDepthConfig()


def sensor_depth(depth: np.ndarray, rng: np.random.Generator, config: SensorDepthConfig = DEFAULT_SENSOR) -> np.ndarray:
    """(H, W) float32 metres: ``depth`` (exact, 0 = nothing) with the sensor effects of the module docstring."""
    exact = np.asarray(depth, dtype=np.float64)
    h, w = exact.shape
    valid = exact >= MIN_VALID_DEPTH_M
    out = exact + rng.standard_normal(exact.shape) * config.noise_m_at_1m * exact * exact
    drop = rng.random(exact.shape) < config.hole_fraction
    if config.blob_fraction > 0:
        coarse = rng.random((max(2, h // 24), max(2, w // 24))).astype(np.float32)
        field = cv2.resize(coarse, (w, h), interpolation=cv2.INTER_LINEAR)
        drop |= field > np.quantile(field, 1.0 - config.blob_fraction)
    kernel = np.ones((3, 3), np.uint8)
    far = cv2.dilate(np.where(valid, exact, 0.0).astype(np.float32), kernel)
    near = cv2.erode(np.where(valid, exact, np.inf).astype(np.float32), kernel)
    edge = valid & ((far - exact > config.edge_jump_m) | (exact - near > config.edge_jump_m))
    drop |= edge & (rng.random(exact.shape) < config.edge_dropout)
    out = np.round(np.where(valid & ~drop, out, 0.0) / config.quantum_m) * config.quantum_m
    return np.where(out >= MIN_VALID_DEPTH_M, out, 0.0).astype(np.float32)
