"""The spec's numbers that several modules read: one home each, with the section that fixes it.

Constants read by one module only stay in that module (e.g. the crop ratios in ``refine``/``score``,
the xyz thresholds in ``network_inputs``). The network crop side ``S`` lives with the networks
(:data:`foundationpose.models.blocks.CROP_SIZE`), since their positional table fixes it.
"""

from __future__ import annotations

__all__ = ["MIN_VALID_DEPTH_M"]

# spec §2.8 "valid depth" (>= 0.001 m) and §2.3: depth filters, translation guess (§2.2), the register
# validity check (§1.2 step 3), back-projection (§1.2 step 5, §1.3 step 3) and the demo reader (§7.1).
# Always compared in float32 against float32 depth: float32(0.001) is the real threshold.
MIN_VALID_DEPTH_M = 0.001
