"""Time each building block of register/track on one device (synchronised), then a torch.profiler
table of one track step. For finding where time goes; prints JSON + tables.

    python tools/profile_steps.py [--device cuda] [--hypotheses 252]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from foundationpose.bench.e2e import DEMO_K, _scene
from foundationpose.crop import crop_windows, scorer_real_xyz, warp_to_crops
from foundationpose.estimator import EstimatorConfig, PoseEstimator
from foundationpose.network_inputs import REFINE_CROP_RATIO, SCORE_CROP_RATIO
from foundationpose.networks import NetworkConfig
from foundationpose.observation import prepare_frame
from foundationpose.refine import build_refiner_inputs, run_refiner
from foundationpose.sampling import bilateral_filter_depth, depth_to_xyz, erode_depth


def timeit(fn, device, runs=10):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t.append((time.perf_counter() - t0) * 1e3)
    return round(float(np.median(t)), 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--hypotheses", type=int, default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    fast = device.type == "cuda"
    est = PoseEstimator.create(
        device=device,
        config=EstimatorConfig(num_hypotheses=args.hypotheses),
        network_config=NetworkConfig(cast_model=fast, channels_last=fast, cuda_graph_batches=(1,) if fast else ()),
    )
    est.networks.refiner.warmup([1])
    obj, rgb, depth, mask = _scene(est, (480, 640), DEMO_K)
    K = DEMO_K
    frame = prepare_frame(rgb, depth, K, device, xyz_float64=False)
    depth_t = torch.as_tensor(depth, device=device)
    reg = est.register(obj, rgb, depth, mask, K)
    pose1 = torch.as_tensor(reg.cam_from_centred, device=device)[None]
    poses = torch.as_tensor(est.rotation_grid(), device=device).clone()
    poses[:, :3, 3] = pose1[0, :3, 3]
    r = {}
    r["upload_rgb_depth"] = timeit(lambda: (torch.as_tensor(rgb).to(device), torch.as_tensor(depth).to(device)), device)
    r["erode"] = timeit(lambda: erode_depth(depth_t), device)
    r["bilateral"] = timeit(lambda: bilateral_filter_depth(depth_t), device)
    r["xyz_f32"] = timeit(lambda: depth_to_xyz(frame.depth, K), device)
    r["xyz_f64"] = timeit(lambda: depth_to_xyz(frame.depth, K, float64=True), device)
    r["prepare_frame"] = timeit(lambda: prepare_frame(rgb, depth, K, device, xyz_float64=False), device)
    for n, P in (("1", pose1), (str(len(poses)), poses)):
        F = crop_windows(P, K, obj.diameter, REFINE_CROP_RATIO)
        r[f"crop_windows_{n}"] = timeit(lambda P=P: crop_windows(P, K, obj.diameter, REFINE_CROP_RATIO), device)
        r[f"render_{n}"] = timeit(lambda P=P, F=F: est.renderer.render(obj.tensors, P, K, (480, 640), F), device)
        r[f"warp_rgb_{n}"] = timeit(lambda F=F: warp_to_crops(frame.rgb, F, mode="bilinear"), device)
        r[f"warp_xyz_{n}"] = timeit(lambda F=F: warp_to_crops(frame.xyz_cam, F, mode="nearest"), device)
        Fs = crop_windows(P, K, obj.diameter, SCORE_CROP_RATIO)
        r[f"scorer_real_xyz_{n}"] = timeit(lambda Fs=Fs: scorer_real_xyz(frame.depth, Fs, K), device, runs=3)
        inputs = build_refiner_inputs(P, frame, obj, est.renderer)
        r[f"build_refiner_inputs_{n}"] = timeit(lambda P=P: build_refiner_inputs(P, frame, obj, est.renderer), device)
        r[f"run_refiner_{n}"] = timeit(lambda inputs=inputs: run_refiner(est.networks.refiner, inputs), device)
    r["track_total"] = timeit(lambda: est.track(obj, rgb, depth, K, reg.cam_from_mesh), device)
    r["register_total"] = timeit(lambda: est.register(obj, rgb, depth, mask, K), device, runs=3)
    print(json.dumps(r, indent=1))
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            est.track(obj, rgb, depth, K, reg.cam_from_mesh)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
