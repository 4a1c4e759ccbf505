"""Per-row object diameters: a batch whose rows may belong to different objects (an object group's track step).

The step's float arithmetic uses an object's diameter in three forms, each rounded on the host once per object from
the Python float (the float64 value), exactly as the scalar code rounds it:

* ``d64``: the float64 diameter (the crop window's radius ``d * crop_ratio / 2`` is computed from it in float64,
  :func:`foundationpose.crop.crop_windows`);
* ``rho32``: ``float32(d) / 2``, the radius that scales the refiner's translation output
  (:func:`foundationpose.pose_update.apply_refiner_output`);
* ``inv_rho32``: ``float32(1 / rho32)``, the xyz normalisation's factor (:func:`foundationpose.network_inputs.
  normalize_xyz`).

A :class:`RowDiameters` holds one value of each per row; a function that takes ``diameter: float | RowDiameters``
multiplies row i by row i's value where the scalar code multiplies by the Python float, which torch rounds to the
same float32 (or float64) value: row i equals the scalar call with row i's diameter, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["RowDiameters"]


@dataclass(frozen=True, slots=True)
class RowDiameters:
    """Diameters of N rows (or of K objects, as the table rows are gathered from), all (N,) on one device.

    d64: float64 metres. rho32: float32 ``float32(d) / 2``. inv_rho32: float32 ``float32(1 / rho32)``.
    """

    d64: Tensor
    rho32: Tensor
    inv_rho32: Tensor

    @classmethod
    def of(cls, diameters: Sequence[float], device: str | torch.device) -> RowDiameters:
        """The table of ``diameters`` (Python floats, one per object) on ``device``, each form rounded on the host."""
        d = [float(x) for x in diameters]
        rho = [np.float32(x) / np.float32(2.0) for x in d]
        inv = [np.float32(np.float32(1.0) / r) for r in rho]
        dev = torch.device(device)
        return cls(d64=torch.tensor(d, dtype=torch.float64, device=dev),
                   rho32=torch.tensor(np.asarray(rho, dtype=np.float32), device=dev),
                   inv_rho32=torch.tensor(np.asarray(inv, dtype=np.float32), device=dev))

    def rows(self, index: Tensor) -> RowDiameters:
        """Row i = entry ``index[i]`` of this table (``index``: (N,) integer on the table's device; no host sync)."""
        return RowDiameters(self.d64.index_select(0, index), self.rho32.index_select(0, index),
                            self.inv_rho32.index_select(0, index))

    def __len__(self) -> int:
        return int(self.d64.shape[0])
