"""How far to trust a tracked pose: measurements of the observation at the refined pose, and the verdict.

Principle 11 of the design: every track answer says how much to trust it. The measurements project model
surface points, drawn once per object (:class:`ValidityModel`), at the refined pose into the observed
(filtered) depth and count what the depth says about them; no rendering. For each point the camera should
see (its face turned to the camera, projecting inside the image) with a depth reading ``d`` at its pixel and
predicted depth ``z``:

* agree:    ``|d - z| <= tol``  (the surface is where the pose puts it)
* occluded: ``d < z - tol``     (something is in front: no evidence either way)
* behind:   ``d > z + tol``     (the camera sees through the pose: the object is not there)

``tol = depth_tolerance_diameters x diameter``. The measurements, one row per track request, columns in
:data:`MEASUREMENTS` order:

==  =====================  ==================================================================================
 0  in_image_fraction      front-facing points projecting inside the image / front-facing points
 1  reading_fraction       of those inside, the share with a depth reading (>= 1 mm)
 2  agree_fraction         agree / points with a reading
 3  occluded_fraction      occluded / points with a reading
 4  behind_fraction        behind / points with a reading
 5  consistent_fraction    agree / (agree + behind): how much of the unoccluded evidence confirms the pose
 6  support_fraction       agree / front-facing points: how much of what the camera should see is confirmed
 7  residual_m             mean ``|d - z|`` over agreeing points, metres
 8  translation_m          ``|t_final - t_start|``: the step's correction, metres
 9  rotation_deg           angle of ``R_final R_start^T``, degrees
10  visible_points         front-facing points inside the image (a count, as float)
11  appearance_cells       cells of the refiner's crop compared by appearance (a count, as float; see below)
12  texture_contrast       std. deviation of the cells' intensity, rendered or observed (the larger), [0, 1]
13  appearance_ncc         normalised cross-correlation of rendered and observed intensity over those cells
==  =====================  ==================================================================================

Appearance (columns 11-13) sees what depth cannot: a pose turned the wrong way round on a near-symmetric shape
fits the depth, but its render shows the object's print or detail where the camera sees something else. It is
measured on the last refine iteration's network inputs (:func:`measure_appearance`: the rendered crop and the
observed crop of the same window, :class:`foundationpose.refine.PairInputs`), so it costs no render: pixels where
both crops have a surface whose depths agree (``|z_render - z_real| <= tol``, occluders left out) are pooled into
cells of :data:`APPEARANCE_CELL_PX` pixels (a few pixels of misalignment do not decorrelate a print), and the
rendered and observed mean intensities of the cells at least half compared are correlated. The correlation is
gain- and offset-free (a camera's exposure and white level do not matter); it judges the render of the pose the
last iteration started from, which the step's last correction moves by at most its small update. An object whose
surface colours are plain (:attr:`ValidityModel.textured` false) and a crop whose rendered cells show no contrast
carry no orientation: their appearance is not judged (``appearance_cells`` 0, or contrast below the minimum in
both the rendered and the observed cells: a render showing a plain face where the camera sees a print is
judged), so a pose that is equivalent under a symmetry the texture does not break is never called invalid for
its appearance (its render looks the same). Without network inputs (a register's pick, :class:`FrameJudge`) the three columns
are 0: not judged.

:func:`judge_validity` turns a row into ``valid`` (every gated measurement on the good side of its threshold,
:class:`ValidityConfig`) and ``confidence`` in [0, 1]: the smallest of the gated measurements' scores, each a
piecewise-linear ramp that is 0.5 at its threshold, so ``valid`` is ``confidence >= 0.5`` up to rounding.

Both functions are batched torch code that runs inside a captured CUDA graph: no host synchronisation (no
``.item()``, ``nonzero``, boolean indexing, tensor literals or value-dependent Python branches). What they read of
an object is a :class:`ValidityRows`: its points (on the device, in :class:`ValidityModel`) and its
:class:`ValidityParams` (tolerance, texture flag, thresholds and the ramps' scales), either one object's (Python
floats: :func:`measure_validity` with a model and a config) or each row's own (a :class:`ValidityTable` of a
group's K objects on the device, gathered by the rows' object indices: :func:`measure_validity_rows`, one pass for
a batch of several objects, as the track step runs it). A float and its per-row float32 value give the same
result bit for bit (PyTorch rounds a Python scalar to the tensor's float32 the same way), and a row's measurements
do not depend on its batch nor on the padding of a table whose objects have different point counts (the points
are rotated by multiply-adds, padding points are masked out and the residual sum is a scan, which on the CPU
accumulates in sequence: trailing zeros add nothing).
On CUDA the measurements run as Triton kernels (:mod:`foundationpose._validity_triton`): one launch for a batch's
rows, two with the appearance, in place of the batched torch code's some 140 small ops (about 45 of them the
appearance's, counted as dispatched on the CPU), which stays their twin (``impl="torch"``; the path on the CPU).
The kernels keep the properties above (one program per row; the residuals summed in fixed chunks, so padding adds
exact zeros), give the twin's counts and fractions exactly and its sums (residual, motion, the cells' moments) to
float32 rounding.
:func:`foundationpose._validity_reference.measure_validity_reference` is the readable per-row twin.
The thresholds' defaults come from ``python -m foundationpose.evaluate calibrate`` (docs/tracking.md).
:class:`FrameJudge` is the host-side convenience for one frame at a time (the track step's depth filters, then
both functions), for callers outside the track step (evaluation, the demo) until the step reports validity.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from foundationpose.constants import MIN_VALID_DEPTH_M
from foundationpose.mesh import ObjectModel
from foundationpose.sampling import bilateral_filter_depth, erode_depth
from foundationpose.sampling.depth_filters import FilterImpl, import_triton_module, pick_triton_module
from foundationpose.surface import sample_surface

__all__ = [
    "APPEARANCE_CELL_PX",
    "FrameJudge",
    "GATED",
    "JUDGED_COLUMNS",
    "Judgement",
    "MEASUREMENTS",
    "VALIDITY_POINTS",
    "ValidityConfig",
    "ValidityModels",
    "ValidityModel",
    "ValidityParams",
    "ValidityRows",
    "ValidityTable",
    "column",
    "config_of",
    "judge_validity",
    "judgement_of_row",
    "measure_appearance",
    "measure_validity",
    "measure_validity_rows",
    "surface_contrast",
    "validity_impl",
]

MEASUREMENTS = (
    "in_image_fraction", "reading_fraction", "agree_fraction", "occluded_fraction", "behind_fraction",
    "consistent_fraction", "support_fraction", "residual_m", "translation_m", "rotation_deg", "visible_points",
    "appearance_cells", "texture_contrast", "appearance_ncc",
)
# what `valid` depends on (appearance_ncc only where the appearance is judged: enough cells, enough contrast)
GATED = ("support_fraction", "consistent_fraction", "translation_m", "rotation_deg", "appearance_ncc")
VALIDITY_POINTS = 512  # model points per object: B x 512 gathers are negligible next to a refine iteration
_MIN_Z_M = 1e-3  # points nearer than this to the camera plane are treated as not projectable
APPEARANCE_CELL_PX = 8  # crop pixels per cell side: a 160-pixel crop (1.2 diameters) is 20 x 20 cells of ~6 % d
_APPEARANCE_COLUMNS = 3  # appearance_cells, texture_contrast, appearance_ncc: the last columns of a row
_SURFACE_COLOUR_SAMPLES = 4000  # surface samples whose colours say whether an object is textured
_COLUMN = {name: i for i, name in enumerate(MEASUREMENTS)}
JUDGED_COLUMNS = len(MEASUREMENTS) + 2  # a judged row: the measurements, then confidence, then valid (1.0 / 0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidityConfig:
    """Thresholds of one object's validity (docs/tracking.md: the calibration that chose the defaults).

    depth_tolerance_diameters: the agree band ``|d - z| <= this x diameter``.
    min_support: ``support_fraction`` at or above it (enough of the visible surface confirmed).
    min_consistent: ``consistent_fraction`` at or above it (the unoccluded evidence mostly confirms).
    max_translation_m, max_rotation_deg: the largest correction one track step may make (the object's motion
        between two frames, so they scale with the frame interval: the defaults assume about 30 frames/s and
        hand-held motion up to about 0.8 m/s and 330 degrees/s; raise them for faster objects).
    min_appearance_ncc: ``appearance_ncc`` at or above it where the appearance is judged (the render's print lies
        where the camera sees it).
    min_texture_contrast: the appearance is judged only where the rendered or the observed cells' intensity varies
        at least this much ([0, 1] units), and only for objects whose surface colours do
        (:attr:`ValidityModel.textured`).
    min_appearance_cells: ... and only where at least this many cells were compared.
    """

    # python -m foundationpose.evaluate calibrate (docs/tracking.md, 2026-12-05): pooled over the L-block and the
    # tee, 1 % false alarms on correct poses in view, 99.8-99.9 % of wrong or unsupported poses caught
    depth_tolerance_diameters: float = 0.04
    min_support: float = 0.23
    min_consistent: float = 0.42
    max_translation_m: float = 0.028  # 3 x the largest step of the smooth scenarios (0.84 m/s at 30 frames/s)
    max_rotation_deg: float = 11.0  # 3 x 3.4 degrees per frame
    # python -m foundationpose.evaluate.flip_views --split tune --views 8 (docs/tracking.md), on the suite's tune
    # objects only (mug, spray bottle, cereal box, can): 8 views each with a sensor's noise, true poses exact and
    # off by 2 degrees and 2 mm, against the same poses turned 180 degrees about the object's x, y and z axes.
    # True poses the depth accepts and the appearance judges: correlation 0.655 at the lowest (can; mug 0.672,
    # cereal box 0.933, spray bottle 0.994). Flips the depth accepts whose print differs: mug 8 of 8 at -0.99 to
    # -0.11, cereal box 9 of 9 at -0.02 to 0.29, can 16 at -0.09 to 0.96 (a half-turn that shows part of the same
    # label). 0.4 catches all of the mug's and box's and 10 of the can's 16 while keeping 0.25 below the lowest
    # true pose, for a real camera's lighting, which the renderer's shading does not copy. Contrast: plain
    # surfaces shaded by the renderer give 0.01-0.02 in the compared cells; 0.02 judges nothing on a blank face.
    # 40 cells (of 400): less than a tenth of the crop compared is too little to tell a print from an occluder.
    min_appearance_ncc: float = 0.4
    min_texture_contrast: float = 0.02
    min_appearance_cells: float = 40.0

    def __post_init__(self) -> None:
        if not self.depth_tolerance_diameters > 0:
            raise ValueError(f"depth_tolerance_diameters must be > 0, got {self.depth_tolerance_diameters}")
        for name in ("min_support", "min_consistent", "min_appearance_ncc", "min_texture_contrast"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        for name in ("max_translation_m", "max_rotation_deg", "min_appearance_cells"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True, eq=False)
class ValidityModel:
    """Per-object constants of the measurements, on one device (built once per object and device).

    points_centred: (P, 3) float32 metres, uniform surface samples of the centred mesh.
    normals_centred: (P, 3) float32 unit outward face normals of those points. diameter: metres.
    textured: whether the object's surface colours vary (:func:`surface_contrast` at least its
    ``min_texture_contrast``): only then is its appearance judged.
    """

    points_centred: Tensor
    normals_centred: Tensor
    diameter: float
    textured: bool = False

    @classmethod
    def from_object(cls, obj: ObjectModel, device: str | torch.device | None = None, *,
                    count: int = VALIDITY_POINTS, seed: int = 0) -> ValidityModel:
        """Sample ``count`` points on ``obj``'s centred mesh (seeded) onto ``device`` (default: the object's);
        textured when :func:`surface_contrast` reaches the object's ``min_texture_contrast`` (:func:`config_of`)."""
        mesh = obj.mesh_centred
        samples = sample_surface(np.asarray(mesh.vertices), np.asarray(mesh.faces), count, seed)
        dev = torch.device(device) if device is not None else obj.tensors.device
        textured = surface_contrast(obj, seed=seed) >= config_of(obj).min_texture_contrast
        return cls(points_centred=torch.tensor(samples.points, dtype=torch.float32, device=dev),
                   normals_centred=torch.tensor(samples.normals, dtype=torch.float32, device=dev),
                   diameter=float(obj.diameter), textured=bool(textured))

    def to(self, device: str | torch.device) -> ValidityModel:
        dev = torch.device(device)
        return ValidityModel(self.points_centred.to(dev), self.normals_centred.to(dev), self.diameter, self.textured)


def surface_contrast(obj: ObjectModel, count: int = _SURFACE_COLOUR_SAMPLES, seed: int = 0) -> float:
    """Standard deviation of the intensity (mean of R, G, B in [0, 1]) of ``count`` seeded, area-uniform samples
    of the object's surface colours (texture image, else face or vertex colours): 0 for a plain object."""
    from foundationpose.symmetry_evidence import (
        coloured_surface,  # trimesh sampling and a KD-tree: load time only
    )

    colours = coloured_surface(obj.mesh, count, seed).colours
    return float(colours.mean(axis=1).std())


RowValue = float | Tensor  # one object's value (a Python float) or each row's own ((B,) float32 on the device)


@dataclass(frozen=True, slots=True)
class ValidityParams:
    """The numbers :func:`measure_validity_rows` and :func:`judge_validity` read of an object: its model's depth
    tolerance and texture flag, its config's thresholds and the scales of their score ramps (``*_below`` /
    ``*_above``: ``0.5 / threshold`` and ``0.5 / (1 - threshold)``; ``*_scale``: ``0.5 / limit``), computed once in
    double precision. Each field is one object's Python float (:meth:`of`) or each row's own, (B,) float32 on the
    device (:meth:`ValidityTable.rows`); both give the same results bit for bit (a Python scalar is rounded to
    float32 by the op exactly as the table's values were).

    tol_m: ``depth_tolerance_diameters x diameter``, metres (NaN where no diameter was given: judging only).
    band: the same band in normalised-depth units (``2 x depth_tolerance_diameters``). textured: 1.0 / 0.0.
    """

    tol_m: RowValue
    band: RowValue
    textured: RowValue
    min_support: RowValue
    support_below: RowValue
    support_above: RowValue
    min_consistent: RowValue
    consistent_below: RowValue
    consistent_above: RowValue
    max_translation_m: RowValue
    translation_scale: RowValue
    max_rotation_deg: RowValue
    rotation_scale: RowValue
    min_appearance_ncc: RowValue
    ncc_below: RowValue
    ncc_above: RowValue
    min_texture_contrast: RowValue
    min_appearance_cells: RowValue

    @classmethod
    def of(cls, config: ValidityConfig, diameter: float = float("nan"), textured: bool = False) -> ValidityParams:
        """One object's parameters as Python floats (``diameter``: metres; none is needed to judge)."""
        c = config
        return cls(
            tol_m=c.depth_tolerance_diameters * float(diameter), band=2.0 * c.depth_tolerance_diameters,
            textured=1.0 if textured else 0.0,
            min_support=c.min_support, support_below=0.5 / c.min_support,
            support_above=0.5 / (1.0 - c.min_support),
            min_consistent=c.min_consistent, consistent_below=0.5 / c.min_consistent,
            consistent_above=0.5 / (1.0 - c.min_consistent),
            max_translation_m=c.max_translation_m, translation_scale=0.5 / c.max_translation_m,
            max_rotation_deg=c.max_rotation_deg, rotation_scale=0.5 / c.max_rotation_deg,
            min_appearance_ncc=c.min_appearance_ncc, ncc_below=0.5 / c.min_appearance_ncc,
            ncc_above=0.5 / (1.0 - c.min_appearance_ncc),
            min_texture_contrast=c.min_texture_contrast, min_appearance_cells=c.min_appearance_cells,
        )

    def values(self) -> tuple[RowValue, ...]:
        """The fields in declaration order (a table's columns)."""
        return tuple(getattr(self, name) for name in _PARAM_FIELDS)


_PARAM_FIELDS = tuple(ValidityParams.__dataclass_fields__)


def _per_row(value: RowValue, ndim: int) -> RowValue:
    """A (B,) per-row value shaped to broadcast against a (B, ...) tensor of ``ndim`` dims; a float as it is (a
    Python branch on the value's type, never on its data)."""
    return value.reshape(-1, *([1] * (ndim - 1))) if isinstance(value, Tensor) else value


@dataclass(frozen=True, slots=True, eq=False)
class ValidityRows:
    """What a batch's measurements read of its objects: ``points`` / ``normals`` (P, 3) float32 (one object, every
    row) or (B, P, 3) (each row its own object's), ``present`` None or (B, P) bool (False: a padding point of a
    table whose objects have fewer points than P; never counted), and ``params`` (:class:`ValidityParams`)."""

    points: Tensor
    normals: Tensor
    present: Tensor | None
    params: ValidityParams


@dataclass(frozen=True, slots=True, eq=False)
class ValidityTable:
    """K objects' validity data on one device, gathered per row by object index (:meth:`rows`), so a batch of rows
    of several objects is measured and judged in ONE pass (:func:`foundationpose.object_group.judge_rows`).

    points, normals: (K, P, 3) float32, object k's model points (P the largest count; fewer are zero-padded).
    present: (K, P) bool, False at padding. params: (K, len(ValidityParams fields)) float32, object k's
    :class:`ValidityParams` (its model's diameter and texture flag, its config).
    """

    points: Tensor
    normals: Tensor
    present: Tensor
    params: Tensor

    @classmethod
    def of(cls, validity: Sequence[tuple[ValidityModel, ValidityConfig]],
           device: str | torch.device | None = None) -> ValidityTable:
        """The table of ``validity`` (one ``(model, config)`` per object, in the group's order) on ``device``
        (default: the first model's). Host-to-device copies: build it outside a capture. Raises ValueError for no
        objects."""
        if not validity:
            raise ValueError("a validity table needs at least one object")
        dev = torch.device(device) if device is not None else validity[0][0].points_centred.device
        count = max(int(m.points_centred.shape[0]) for m, _ in validity)
        points = torch.zeros((len(validity), count, 3), dtype=torch.float32, device=dev)
        normals = torch.zeros_like(points)
        present = torch.zeros((len(validity), count), dtype=torch.bool, device=dev)
        for k, (model, _) in enumerate(validity):
            n = int(model.points_centred.shape[0])
            points[k, :n] = model.points_centred.to(dev, torch.float32)
            normals[k, :n] = model.normals_centred.to(dev, torch.float32)
            present[k, :n] = True
        rows = [ValidityParams.of(config, model.diameter, model.textured).values() for model, config in validity]
        params = torch.tensor(rows, dtype=torch.float32, device=dev)
        return cls(points=points, normals=normals, present=present, params=params)

    def __len__(self) -> int:
        return int(self.params.shape[0])

    def rows(self, row_object: Tensor) -> ValidityRows:
        """Row i's object's data for a batch whose row i is object ``row_object[i]`` ((B,) int64 on the table's
        device): gathers, no host synchronisation."""
        params = self.params.index_select(0, row_object)  # (B, C)
        return ValidityRows(points=self.points.index_select(0, row_object),
                            normals=self.normals.index_select(0, row_object),
                            present=self.present.index_select(0, row_object),
                            params=ValidityParams(*params.unbind(1)))


def _params_of(config: ValidityConfig | ValidityParams, textured: bool = False) -> ValidityParams:
    """A config's parameters (no diameter: for judging and the appearance), or the parameters as given."""
    return config if isinstance(config, ValidityParams) else ValidityParams.of(config, textured=textured)


def measure_appearance(render_input: Tensor, transf_input: Tensor, config: ValidityConfig | ValidityParams,
                       textured: bool = True, *, impl: FilterImpl = "auto") -> Tensor:
    """Columns ``appearance_cells``, ``texture_contrast``, ``appearance_ncc`` (module docstring) of a batch of
    network-input pairs. No host synchronisation.

    render_input, transf_input: (B, S, S, 6) float32 NHWC, the rendered and the observed crop of the same windows
    (R, G, B in [0, 1], normalised X, Y, Z: :func:`foundationpose.refine.assemble_pair_inputs`); S a multiple of
    :data:`APPEARANCE_CELL_PX`. config: the object's thresholds, or :class:`ValidityParams` (one object's or each
    row's: then its ``textured`` is used and ``textured`` here is ignored). textured: the object's
    (:attr:`ValidityModel.textured`); False gives 0 cells. impl: "auto" = the Triton kernels
    (:mod:`foundationpose._validity_triton`, two launches) for float32 CUDA tensors when triton imports, else the
    batched torch twin; "torch" = the twin; "triton" = the kernels (on CPU tensors under the Triton interpreter:
    slow, for tests). Returns (B, 3) float32.
    """
    assert render_input.shape == transf_input.shape and render_input.shape[-1] == 6, (render_input.shape,
                                                                                      transf_input.shape)
    params = _params_of(config, textured)
    kernels = _kernels_for(render_input.device, impl)
    if kernels is not None and (impl == "triton" or _appearance_fits(render_input, transf_input, params)):
        return kernels.measure_appearance_triton(render_input, transf_input, band=params.band,
                                                 textured=params.textured, cell=APPEARANCE_CELL_PX)
    return _measure_appearance_torch(render_input, transf_input, params)


def _measure_appearance_torch(render_input: Tensor, transf_input: Tensor, params: ValidityParams) -> Tensor:
    """:func:`measure_appearance`'s batched torch twin (some 45 small ops per call; the readable definition the
    kernels follow)."""
    # normalised z is (z - t_z) / (d / 2): the depth band tol = k d is 2 k in those units
    band = _per_row(params.band, 3)
    rendered, observed = render_input[..., 3:], transf_input[..., 3:]
    compared = ((rendered != 0).any(-1) & (observed != 0).any(-1)
                & ((rendered[..., 2] - observed[..., 2]).abs() <= band))  # (B, S, S)
    weight = compared.to(torch.float32)[:, None]  # (B, 1, S, S)
    intensity = torch.stack([render_input[..., :3].mean(-1), transf_input[..., :3].mean(-1)], 1)  # (B, 2, S, S)
    cell = APPEARANCE_CELL_PX
    share = F.avg_pool2d(weight, cell)  # (B, 1, C, C): compared share of each cell
    means = F.avg_pool2d(intensity * weight, cell) / share.clamp_min(1e-6)  # (B, 2, C, C) cell mean intensities
    w = torch.where(share >= 0.5, share, torch.zeros_like(share))  # cells at least half compared
    cells = w.flatten(1).gt(0).sum(1).to(torch.float32) * params.textured  # (B,)
    total = w.sum((1, 2, 3)).clamp_min(1e-6)
    centred = means - (means * w).sum((2, 3), keepdim=True) / total[:, None, None, None]
    var = (w * centred * centred).sum((2, 3))  # (B, 2) weighted, rendered and observed
    cov = (w[:, 0] * centred[:, 0] * centred[:, 1]).sum((1, 2))
    contrast = (var.amax(1) / total).sqrt()  # the rendered or the observed print, whichever shows more
    ncc = cov / (var[:, 0] * var[:, 1]).sqrt().clamp_min(1e-12)
    return torch.stack([cells, contrast, ncc], dim=1)


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """The Triton kernel module, or None where triton does not import (probed once per process)."""
    return import_triton_module("foundationpose._validity_triton", "validity kernels")


def _kernels_for(device: torch.device, impl: FilterImpl) -> ModuleType | None:
    return pick_triton_module(_triton_kernels, device.type == "cuda", impl, "validity")


def validity_impl(device: str | torch.device, impl: FilterImpl = "auto") -> str:
    """Which path ``impl`` takes for float32 inputs on ``device``: "triton" or "torch" (what a bench reports)."""
    return "torch" if _kernels_for(torch.device(device), impl) is None else "triton"


def _is_f32(value: RowValue) -> bool:
    return not isinstance(value, Tensor) or value.dtype == torch.float32


def _appearance_fits(render_input: Tensor, transf_input: Tensor, params: ValidityParams) -> bool:
    """Whether the kernels take these crops ("auto" runs the torch twin for others: a branch on dtypes and shapes,
    never on data)."""
    size = render_input.shape[1]
    return (render_input.dtype == transf_input.dtype == torch.float32 and render_input.shape[2] == size
            and size > 0 and size % APPEARANCE_CELL_PX == 0 and _is_f32(params.band) and _is_f32(params.textured))


def _rows_fit(depth: Tensor, K: Tensor, start: Tensor, final: Tensor, rows: ValidityRows,
              appearance: tuple[Tensor, Tensor] | None) -> bool:
    """Whether the kernels take these inputs (float32 throughout, K float32 or float64)."""
    return (depth.dtype == start.dtype == final.dtype == rows.points.dtype == rows.normals.dtype == torch.float32
            and K.dtype in (torch.float32, torch.float64) and _is_f32(rows.params.tol_m)
            and (appearance is None or _appearance_fits(*appearance, rows.params)))


def _rotate(v: Tensor, rot: Tensor) -> Tensor:
    """``v @ rot^T`` for v (P, 3) or (B, P, 3) and rot (B, 3, 3), as (B, P, 3) multiply-adds: each point's result
    depends on its own inputs only (a batched matmul's blocking may depend on P or B)."""
    r = rot[:, None]  # (B, 1, 3, 3): r[..., j] is column j of R, broadcast over the points
    return v[..., 0:1] * r[..., 0] + v[..., 1:2] * r[..., 1] + v[..., 2:3] * r[..., 2]


def measure_validity(depth: Tensor, K: Tensor, start_cam_from_centred: Tensor, cam_from_centred: Tensor,
                     model: ValidityModel, config: ValidityConfig,
                     appearance: tuple[Tensor, Tensor] | None = None, *, impl: FilterImpl = "auto") -> Tensor:
    """The measurements of :data:`MEASUREMENTS` for a batch of track results of ONE object
    (:func:`measure_validity_rows` with the model's points and the config's floats). No host synchronisation.

    depth: (B, H, W) float32 metres, the filtered observed depth of the step (0 = no reading).
    K: (B, 3, 3) float32 or float64 pixels (skew ignored, as by back-projection).
    start_cam_from_centred, cam_from_centred: (B, 4, 4) float32 the step's start pose and its refined pose.
    model: the object's points on depth's device. appearance: the last refine iteration's ``(render_input,
    transf_input)`` (:func:`measure_appearance`); None: the appearance columns are 0 (not judged).
    impl: as :func:`measure_validity_rows`. Returns (B, M) float32, M = len(MEASUREMENTS).
    """
    rows = ValidityRows(points=model.points_centred, normals=model.normals_centred, present=None,
                        params=ValidityParams.of(config, model.diameter, model.textured))
    return measure_validity_rows(depth, K, start_cam_from_centred, cam_from_centred, rows, appearance, impl=impl)


def measure_validity_rows(depth: Tensor, K: Tensor, start_cam_from_centred: Tensor, cam_from_centred: Tensor,
                          rows: ValidityRows, appearance: tuple[Tensor, Tensor] | None = None, *,
                          impl: FilterImpl = "auto") -> Tensor:
    """:func:`measure_validity` with each row's own object (``rows``: one object's, or a :class:`ValidityTable`'s
    rows): one pass whatever the objects. No host synchronisation. Returns (B, M) float32.

    impl: "auto" = the Triton kernels (:mod:`foundationpose._validity_triton`: one launch, two with
    ``appearance``) for float32 CUDA tensors when triton imports, else the batched torch twin
    (:func:`_measure_validity_rows_torch`, some 140 small ops); "torch" = the twin; "triton" = the kernels (on CPU
    tensors under the Triton interpreter: slow, for tests). The kernels give the twin's counts and fractions of
    counts exactly and its sums to float32 rounding (:mod:`foundationpose._validity_triton`).
    """
    assert depth.ndim == 3 and K.shape == (depth.shape[0], 3, 3), (depth.shape, K.shape)
    assert cam_from_centred.shape == start_cam_from_centred.shape == (depth.shape[0], 4, 4), cam_from_centred.shape
    kernels = _kernels_for(depth.device, impl)
    if kernels is not None and (impl == "triton"
                                or _rows_fit(depth, K, start_cam_from_centred, cam_from_centred, rows, appearance)):
        params = rows.params
        return kernels.measure_rows_triton(
            depth, K, start_cam_from_centred, cam_from_centred, rows.points, rows.normals, rows.present,
            tol=params.tol_m, band=params.band, textured=params.textured, appearance=appearance,
            cell=APPEARANCE_CELL_PX, min_z=_MIN_Z_M, min_depth=MIN_VALID_DEPTH_M, columns=len(MEASUREMENTS))
    return _measure_validity_rows_torch(depth, K, start_cam_from_centred, cam_from_centred, rows, appearance)


def _measure_validity_rows_torch(depth: Tensor, K: Tensor, start_cam_from_centred: Tensor, cam_from_centred: Tensor,
                                 rows: ValidityRows, appearance: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """:func:`measure_validity_rows`' batched torch twin (the readable definition the kernels follow)."""
    batch, height, width = depth.shape
    params = rows.params
    tol = _per_row(params.tol_m, 2)  # a float, or (B, 1) against the (B, P) residuals
    rot = cam_from_centred[:, :3, :3]  # (B, 3, 3)
    pts = _rotate(rows.points, rot) + cam_from_centred[:, None, :3, 3]  # (B, P, 3)
    nrm = _rotate(rows.normals, rot)  # (B, P, 3)
    z = pts[..., 2]  # (B, P)
    towards = nrm[..., 0] * pts[..., 0] + nrm[..., 1] * pts[..., 1] + nrm[..., 2] * pts[..., 2]
    facing = (towards < 0) & (z > _MIN_Z_M)  # the face turns to the camera, in front of it
    if rows.present is not None:  # a table's padding points are never seen (the table's shape, not its data)
        facing = facing & rows.present
    Kf = K.to(torch.float32)
    z_safe = z.clamp_min(_MIN_Z_M)
    u = torch.round(Kf[:, 0, 0, None] * pts[..., 0] / z_safe + Kf[:, 0, 2, None])  # (B, P) pixel column
    v = torch.round(Kf[:, 1, 1, None] * pts[..., 1] / z_safe + Kf[:, 1, 2, None])  # (B, P) pixel row
    inside = facing & (u >= 0) & (u <= width - 1) & (v >= 0) & (v <= height - 1)
    # clamped (and a NaN pose's NaN pixels made 0) so the gather is always in bounds; `inside` masks them out
    pixel = (torch.nan_to_num(v, nan=0.0).clamp(0, height - 1) * width
             + torch.nan_to_num(u, nan=0.0).clamp(0, width - 1)).to(torch.int64)  # (B, P)
    seen = depth.reshape(batch, height * width).gather(1, pixel)  # (B, P) metres
    reading = inside & (seen >= MIN_VALID_DEPTH_M)
    residual = seen - z
    agree = reading & (residual.abs() <= tol)
    occluded = reading & (residual < -tol)
    behind = reading & (residual > tol)

    n_facing, n_inside, n_reading = facing.sum(1).float(), inside.sum(1).float(), reading.sum(1).float()  # (B,)
    n_agree, n_occluded, n_behind = agree.sum(1).float(), occluded.sum(1).float(), behind.sum(1).float()
    # a scan's last value: in sequence on the CPU (float64 accumulator), so a padded table's zeros add nothing
    abs_residual = torch.where(agree, residual.abs(), torch.zeros_like(residual)).cumsum(1)[:, -1]

    start_rot = start_cam_from_centred[:, :3, :3]
    trace = (rot * start_rot).sum((1, 2))  # trace(R_final R_start^T)
    rotation_deg = torch.rad2deg(torch.acos(((trace - 1.0) * 0.5).clamp(-1.0, 1.0)))
    translation_m = (cam_from_centred[:, :3, 3] - start_cam_from_centred[:, :3, 3]).norm(dim=1)
    if appearance is None:
        seen_alike = torch.zeros((batch, _APPEARANCE_COLUMNS), dtype=torch.float32, device=depth.device)
    else:
        seen_alike = _measure_appearance_torch(*appearance, params)
    depth_part = torch.stack([
        n_inside / n_facing.clamp_min(1.0),
        n_reading / n_inside.clamp_min(1.0),
        n_agree / n_reading.clamp_min(1.0),
        n_occluded / n_reading.clamp_min(1.0),
        n_behind / n_reading.clamp_min(1.0),
        n_agree / (n_agree + n_behind).clamp_min(1.0),
        n_agree / n_facing.clamp_min(1.0),
        abs_residual / n_agree.clamp_min(1.0),
        translation_m,
        rotation_deg,
        n_inside,
    ], dim=1)
    return torch.cat([depth_part, seen_alike], dim=1)  # (B, M)


def _at_least(value: Tensor, threshold: RowValue, below_scale: RowValue, above_scale: RowValue) -> Tensor:
    """Score of a fraction that must reach ``threshold``: 0 at 0, 0.5 at the threshold, 1 at 1 (linear pieces;
    the scales are ``0.5 / threshold`` and ``0.5 / (1 - threshold)``)."""
    below = value * below_scale
    above = 0.5 + (value - threshold) * above_scale
    return torch.where(value < threshold, below, above).clamp(0.0, 1.0)


def _at_most(value: Tensor, scale: RowValue) -> Tensor:
    """Score of a magnitude that must stay within a limit: 1 at 0, 0.5 at the limit, 0 at twice the limit
    (``scale`` is ``0.5 / limit``)."""
    return (1.0 - value * scale).clamp(0.0, 1.0)


def judge_validity(measurements: Tensor, config: ValidityConfig | ValidityParams) -> tuple[Tensor, Tensor]:
    """``(confidence (B,) float32 in [0, 1], valid (B,) bool)`` from (B, M) measurements. No host synchronisation.

    config: one object's thresholds for every row, or :class:`ValidityParams` (one object's, or each row's own
    from a :class:`ValidityTable`).
    valid: support and consistency at or above their minimums, the step's correction within its limits and, where
    the appearance is judged (at least ``min_appearance_cells`` cells with at least ``min_texture_contrast``),
    the appearance correlation at or above ``min_appearance_ncc``.
    confidence: the smallest of the five scores (:func:`_at_least`, :func:`_at_most`; the appearance's is 1 where
    it is not judged), 0.5 at a threshold. A row with NaN measurements (a non-finite pose) is invalid with
    confidence 0.
    """
    p = _params_of(config)
    m = measurements
    support, consistent = m[:, _COLUMN["support_fraction"]], m[:, _COLUMN["consistent_fraction"]]
    translation, rotation = m[:, _COLUMN["translation_m"]], m[:, _COLUMN["rotation_deg"]]
    ncc = m[:, _COLUMN["appearance_ncc"]]
    judged = ((m[:, _COLUMN["appearance_cells"]] >= p.min_appearance_cells)
              & (m[:, _COLUMN["texture_contrast"]] >= p.min_texture_contrast))
    valid = ((support >= p.min_support) & (consistent >= p.min_consistent)
             & (translation <= p.max_translation_m) & (rotation <= p.max_rotation_deg)
             & (~judged | (ncc >= p.min_appearance_ncc)))
    appearance = torch.where(judged, _at_least(ncc.clamp(0.0, 1.0), p.min_appearance_ncc, p.ncc_below, p.ncc_above),
                             torch.ones_like(ncc))
    scores = torch.stack([
        _at_least(support, p.min_support, p.support_below, p.support_above),
        _at_least(consistent, p.min_consistent, p.consistent_below, p.consistent_above),
        _at_most(translation, p.translation_scale), _at_most(rotation, p.rotation_scale), appearance,
    ], dim=1)  # (B, 5)
    confidence = scores.amin(dim=1)
    confidence = torch.where(torch.isnan(confidence), torch.zeros_like(confidence), confidence)
    return confidence, valid


def column(name: str) -> int:
    """Index of a measurement in a (B, M) row (raises KeyError naming the known ones)."""
    try:
        return _COLUMN[name]
    except KeyError:
        raise KeyError(f"unknown measurement {name!r}; known: {', '.join(MEASUREMENTS)}") from None


@dataclass(frozen=True, slots=True, eq=False)
class Judgement:
    """measurements: (M,) float32 in :data:`foundationpose.validity.MEASUREMENTS` order; confidence in [0, 1]."""

    measurements: np.ndarray
    confidence: float
    valid: bool


def judgement_of_row(row: np.ndarray) -> Judgement:
    """The :class:`Judgement` of one judged row (:data:`JUDGED_COLUMNS` float32: measurements, confidence, valid)."""
    m = len(MEASUREMENTS)
    return Judgement(measurements=np.array(row[:m], dtype=np.float32), confidence=float(row[m]),
                     valid=bool(row[m + 1] > 0.5))


def config_of(obj: ObjectModel) -> ValidityConfig:
    """The object's thresholds (``ObjectModel.validity``), or the calibrated defaults."""
    return obj.validity if obj.validity is not None else _DEFAULT_CONFIG


_DEFAULT_CONFIG = ValidityConfig()


class ValidityModels:
    """The :class:`ValidityModel` of each object on one device, built on first use and dropped with the object."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._models: weakref.WeakKeyDictionary[ObjectModel, ValidityModel] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def of(self, obj: ObjectModel) -> ValidityModel:
        with self._lock:
            model = self._models.get(obj)
            if model is None:
                model = self._models[obj] = ValidityModel.from_object(obj, self.device)
            return model

    def judge_pose(self, obj: ObjectModel, depth_f: Tensor, K: np.ndarray, cam_from_centred: Tensor) -> Judgement:
        """Validity of one pose (4, 4) float32 on the device against itself (no motion: a register's pick) on a
        filtered (H, W) depth map; one host copy of the judged row."""
        k = torch.as_tensor(np.asarray(K, dtype=np.float64), device=self.device)[None]
        pose = cam_from_centred.reshape(1, 4, 4).to(device=self.device, dtype=torch.float32)
        config = config_of(obj)
        m = measure_validity(depth_f.reshape(1, *depth_f.shape[-2:]), k, pose, pose, self.of(obj), config)
        confidence, valid = judge_validity(m, config)
        row = torch.cat([m[0], confidence, valid.to(torch.float32)]).cpu().numpy()
        return judgement_of_row(row)


class FrameJudge:
    """Validity of one object's poses on the compute device. config: the object's thresholds."""

    def __init__(self, obj: ObjectModel, config: ValidityConfig | None = None,
                 device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.model = ValidityModel.from_object(obj, self.device)
        self.config = config or ValidityConfig()

    def filtered_depth(self, depth: np.ndarray) -> torch.Tensor:
        """(1, H, W) float32: the track step's filters applied to a raw (H, W) depth map (metres)."""
        raw = torch.as_tensor(np.ascontiguousarray(depth, dtype=np.float32), device=self.device)[None]
        return bilateral_filter_depth(erode_depth(raw))

    def judge(self, depth: np.ndarray, K: np.ndarray, start_cam_from_centred: np.ndarray,
              cam_from_centred: np.ndarray) -> Judgement:
        """Validity of ``cam_from_centred`` (4, 4) refined from ``start_cam_from_centred`` on a raw depth map."""
        return self.judge_filtered(self.filtered_depth(depth), K, start_cam_from_centred, cam_from_centred)

    def judge_filtered(self, depth_f: torch.Tensor, K: np.ndarray, start_cam_from_centred: np.ndarray,
                       cam_from_centred: np.ndarray) -> Judgement:
        """As :meth:`judge` on an already filtered (1, H, W) depth (several poses on one frame)."""
        dev = self.device
        k = torch.as_tensor(np.asarray(K, dtype=np.float64), device=dev)[None]
        start = torch.as_tensor(np.asarray(start_cam_from_centred, dtype=np.float32), device=dev)[None]
        final = torch.as_tensor(np.asarray(cam_from_centred, dtype=np.float32), device=dev)[None]
        m = measure_validity(depth_f, k, start, final, self.model, self.config)
        confidence, valid = judge_validity(m, self.config)
        return Judgement(m[0].cpu().numpy(), float(confidence[0]), bool(valid[0]))
