"""The network inputs on one GPU: Triton kernel vs the eager twin. Prints JSON; writes it and a profile to --out.

    python tools/network_inputs_probe.py [--out DIR] [--renderer triton] [--runs 15] [--fold-bn]

(``--device cpu --renderer cpu --sizes 1,3 --hypotheses 4 --runs 1``: a slow smoke run of the script itself,
the kernel under the Triton interpreter.)

* ``equality``: bit equality (int32 patterns) of ``assemble_pair_inputs(impl="triton")`` and ``impl="torch"`` on
  random tensors with invalid pixels (N = 1, 64, 252; S = 160) and on the refiner's and the scorer's real
  intermediates (renders and warps of the bench scene's register hypotheses; N = 1, 64, 252);
* ``timing``: CUDA-event p50 (and host p50 per call) of ``assemble_pair_inputs`` (both branches) per impl at
  N = 252 and N = 1 (the real refiner intermediates: NHWC renders, channels-first warp views), and of the two
  kernel launches alone (``triton/kernel``: the kernel's entry point, without the dispatch around it);
* ``register``: register p50/p90 of the fp16 channels-last path (no torch.compile) with each impl, interleaved
  runs, the per-stage breakdown p50 and the pose difference between the two;
* ``profile.txt``: torch.profiler (record_shapes, grouped by input shape, top 20 by CUDA time) of one
  ``build_refiner_inputs`` call at N = 252 with each impl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from deploy_core.timing import percentile
from engines.files import engine_files
from foundationpose.bench.e2e import DEMO_K, _scene
from foundationpose.crop import crop_sampling_grid, crop_windows, scorer_real_xyz, warp_to_crops
from foundationpose.estimator import EstimatorConfig, PoseEstimator
from foundationpose.network_inputs import (
    REFINE_CROP_RATIO,
    REFINE_INVALID_Z,
    RGB_SCALE,
    SCORE_CROP_RATIO,
    SCORE_INVALID_Z,
    XYZ_CLIP,
    _radius_reciprocal_f32,
)
from foundationpose.networks import NetworkConfig
from foundationpose.observation import prepare_frame
from foundationpose.refine import assemble_pair_inputs, build_refiner_inputs
from foundationpose.render import RenderOutput

IMPLS = ("torch", "triton")


def _p50(values: list[float]) -> float:
    return round(percentile(sorted(values), 50), 4)


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.int32) != b.contiguous().view(torch.int32)).sum())


def _random_intermediates(n: int, s: int, device: torch.device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    poses = torch.eye(4).repeat(n, 1, 1)
    poses[:, :3, 3] = torch.rand((n, 3), generator=g) * 0.2 - 0.1 + torch.tensor([0.0, 0.0, 0.5])

    def xyz() -> torch.Tensor:
        points = poses[:, None, None, :3, 3] + (torch.rand((n, s, s, 3), generator=g) * 2 - 1) * 0.25
        points[torch.rand((n, s, s), generator=g) < 0.3] = 0.0  # background / no depth
        return points

    rendered = RenderOutput(rgb=torch.rand((n, s, s, 3), generator=g).to(device), xyz_cam=xyz().to(device),
                            mask=torch.ones((n, s, s), dtype=torch.bool, device=device))
    rgb_b = (torch.rand((n, s, s, 3), generator=g) * 255).to(device)
    return rendered, rgb_b, xyz().to(device), poses.to(device)


def _real_intermediates(est, obj, frame, poses, scorer: bool):
    """What refine._build / score.build_scorer_inputs compute before assembling (renders and warps)."""
    ratio = SCORE_CROP_RATIO if scorer else REFINE_CROP_RATIO
    crop = crop_windows(poses, frame.K, obj.diameter, ratio, constants=est.constants)
    rendered = est.renderer.render(obj.tensors, poses, frame.K, frame.hw, crop)
    if scorer:
        rgb_b = warp_to_crops(frame.rgb, crop, mode="bilinear", constants=est.constants, contiguous=False)
        xyz_b = scorer_real_xyz(frame.depth, crop, frame.K, constants=est.constants)
    else:
        grid = crop_sampling_grid(crop, frame.hw, constants=est.constants)
        rgb_b = warp_to_crops(frame.rgb, crop, mode="bilinear", grid=grid, contiguous=False)
        xyz_b = warp_to_crops(frame.xyz_cam, crop, mode="nearest", grid=grid, contiguous=False)
    return rendered, rgb_b, xyz_b, crop


def _compare(rendered, rgb_b, xyz_b, poses, diameter, invalid_z, crop) -> dict[str, int]:
    outs = {impl: assemble_pair_inputs(rendered, rgb_b, xyz_b, poses, diameter, invalid_z, crop, impl=impl)
            for impl in IMPLS}
    a, b = outs["torch"], outs["triton"]
    return {"render_input_differing": _differing(a.render_input, b.render_input),
            "transf_input_differing": _differing(a.transf_input, b.transf_input),
            "zeros_xyz": int((a.transf_input[..., 3:] == 0).sum())}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _assemble_call(case, impl: str):
    """assemble_pair_inputs into fixed buffers with ``impl``; "triton/kernel": the two kernel launches directly
    (what assemble_pair_inputs does with impl="triton")."""
    rendered, rgb_b, xyz_b, poses, diameter, invalid_z, crop = case
    n, s = rendered.rgb.shape[:2]
    out_r = torch.empty((n, s, s, 6), device=rgb_b.device)
    out_t = torch.empty_like(out_r)
    if not impl.startswith("triton/"):
        return lambda: assemble_pair_inputs(rendered, rgb_b, xyz_b, poses, diameter, invalid_z, crop, out_r, out_t,
                                            impl=impl)
    from foundationpose import _network_inputs_triton as kernels

    t = poses[:, :3, 3]
    scalars = {"xyz_scale": float(_radius_reciprocal_f32(diameter)), "invalid_z": invalid_z,
               "rgb_unit_scale": RGB_SCALE, "xyz_clip": XYZ_CLIP}

    def call() -> None:
        kernels.write_network_input_triton(rendered.rgb, rendered.xyz_cam, t, out_r, rendered=True, **scalars)
        kernels.write_network_input_triton(rgb_b, xyz_b, t, out_t, rendered=False, **scalars)

    return call


def _time_assemble(case, impl: str, runs: int) -> dict[str, float]:
    call = _assemble_call(case, impl)
    rgb_b = case[1]
    for _ in range(3):
        call()
    cuda = rgb_b.device.type == "cuda"
    _sync(rgb_b.device)
    gpu, host = [], []
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(runs):
        if cuda:
            start.record()
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
    return {"gpu_p50_ms": _p50(gpu) if cuda else None, "host_p50_ms": _p50(host), "runs": runs}


def _register_ab(variants: dict[str, PoseEstimator], obj, rgb, depth, mask, K, runs: int) -> dict:
    times = {impl: [] for impl in variants}
    stages: dict[str, dict[str, list[float]]] = {impl: {} for impl in variants}
    results = {}
    for est in variants.values():  # warm-up (compiles the kernel, autotunes cuDNN)
        for _ in range(2):
            est.register(obj, rgb, depth, mask, K)
    for _ in range(runs):
        for impl, est in variants.items():  # interleaved: drifts hit both alike
            t0 = time.perf_counter()
            result = est.register(obj, rgb, depth, mask, K)
            times[impl].append((time.perf_counter() - t0) * 1e3)
            results[impl] = result
            for name, ms in result.timings_ms.items():
                stages[impl].setdefault(name, []).append(ms)
    out = {impl: {"p50_ms": _p50(t), "p90_ms": round(percentile(sorted(t), 90), 3), "min_ms": round(min(t), 3),
                  "stages_p50_ms": {k: _p50(v) for k, v in stages[impl].items()}} for impl, t in times.items()}
    out["p50_saving_ms"] = round(out["torch"]["p50_ms"] - out["triton"]["p50_ms"], 3)
    out["pose_max_abs_diff"] = float(np.abs(results["torch"].cam_from_mesh - results["triton"].cam_from_mesh).max())
    out["score_abs_diff"] = abs(results["torch"].score - results["triton"].score)
    return out


def _profile_build(est, obj, frame, poses, impl: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    def call() -> None:
        build_refiner_inputs(poses, frame, obj, est.renderer, constants=est.constants, impl=impl)

    call()
    cuda = est.device.type == "cuda"
    _sync(est.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        call()
        _sync(est.device)
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    table = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=20)
    return f"== build_refiner_inputs, N = {len(poses)}, impl={impl}: top 20 by CUDA time, by input shape ==\n{table}\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="folder for probe.json and profile.txt")
    p.add_argument("--device", default="cuda")
    p.add_argument("--renderer", default="triton", choices=["cpu", "nvdiffrast", "triton"])
    p.add_argument("--sizes", default="1,64,252", help="hypothesis counts of the equality checks (default 1,64,252)")
    p.add_argument("--hypotheses", type=int, default=None, help="register hypotheses (default 252)")
    p.add_argument("--runs", type=int, default=15, help="register runs per impl (default 15)")
    p.add_argument("--fold-bn", action="store_true", help="fold batch norms (as bench --fold-bn)")
    args = p.parse_args()
    device = torch.device(args.device)
    sizes = [int(v) for v in args.sizes.split(",") if v]
    cuda = device.type == "cuda"
    net_cfg = NetworkConfig(cast_model=cuda, channels_last=cuda, compile=False, fold_batchnorm=args.fold_bn)
    config = EstimatorConfig(track_graphs=False, network_input_impl="torch", num_hypotheses=args.hypotheses)
    est = PoseEstimator.create(device=device, config=config, network_config=net_cfg, renderer=args.renderer,
                               engine_files=engine_files)
    obj, rgb, depth, mask = _scene(est, (480, 640), DEMO_K)
    report: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "renderer": est.renderer.name,
                    "precision": est.networks.precision, "fold_bn": args.fold_bn}

    frame = prepare_frame(rgb, depth, DEMO_K, device, xyz_float64=True, constants=est.constants)
    poses_all = est.hypotheses(frame, torch.as_tensor(mask, device=device))
    equality: dict = {}
    for n in sizes:
        rendered, rgb_b, xyz_b, poses = _random_intermediates(n, 160, device, seed=n)
        crop = torch.eye(3, device=device).repeat(n, 1, 1)
        equality[f"random_{n}"] = _compare(rendered, rgb_b, xyz_b, poses, obj.diameter, REFINE_INVALID_Z, crop)
        for scorer in (False, True):
            if n > len(poses_all):
                continue
            poses = poses_all[:n]
            rendered, rgb_b, xyz_b, crop = _real_intermediates(est, obj, frame, poses, scorer)
            invalid_z = SCORE_INVALID_Z if scorer else REFINE_INVALID_Z
            equality[f"{'scorer' if scorer else 'refiner'}_{n}"] = _compare(
                rendered, rgb_b, xyz_b, poses, obj.diameter, invalid_z, crop
            )
    report["equality"] = equality
    report["bit_identical"] = all(v["render_input_differing"] == 0 == v["transf_input_differing"]
                                  for v in equality.values())

    timing: dict = {}
    for n in sorted({len(poses_all), 1}, reverse=True):
        poses = poses_all[:n]
        rendered, rgb_b, xyz_b, crop = _real_intermediates(est, obj, frame, poses, scorer=False)
        case = (rendered, rgb_b, xyz_b, poses, obj.diameter, REFINE_INVALID_Z, crop)
        timed = (*IMPLS, "triton/kernel")
        timing[f"n{n}"] = {impl: _time_assemble(case, impl, runs=50 if cuda else 2) for impl in timed}
    report["assemble_pair_inputs_timing"] = timing

    variants = {"torch": est, "triton": PoseEstimator(
        est.networks, est.renderer, device=device, config=dataclasses.replace(config, network_input_impl="triton")
    )}
    report["register"] = _register_ab(variants, obj, rgb, depth, mask, DEMO_K, args.runs)

    profile_text = "".join(_profile_build(est, obj, frame, poses_all, impl) for impl in IMPLS)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe.json").write_text(text, encoding="utf-8")
        (args.out / "profile.txt").write_text(profile_text, encoding="utf-8")
    else:
        print(profile_text)


if __name__ == "__main__":
    main()
