"""Training: synthetic scenes, targets, the loop (loss falls on a fixed problem), CLI smoke run, resume,
determinism, and weights that load strictly in the official layout. All on the CPU with tiny crops."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from foundationpose.demo.dataset import BUNDLED_SEQUENCE_DIR
from foundationpose.mesh import load_object
from foundationpose.pose_update import ROT_NORMALIZER, apply_refiner_output
from foundationpose.render import make_renderer
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.train.config import TrainConfig
from foundationpose.train.loop import LOG_FILE, STATE_FILE, Trainer, lr_factor
from foundationpose.train.refiner_targets import perturb_poses, refiner_targets, so3_log
from foundationpose.train.scenes import SceneConfig, random_rotations, sample_scenes
from foundationpose.train.scorer_ranking import (
    RankingConfig,
    add_per_hypothesis,
    hypothesis_set,
    ranking_loss,
)
from foundationpose.weights import REFINER_RUN, SCORER_RUN, ensure_weights, load_refiner, load_scorer

DEMO_MESH = BUNDLED_SEQUENCE_DIR / "mesh" / "textured_simple.obj"
TINY = dict(crop_size=32, frame_hw=(96, 128), refiner_batch=4, hypotheses_per_scene=2, scorer_sets=1,
            ranking=RankingConfig(set_size=4), device="cpu", renderer="cpu", progress=False, log_every=2)


@pytest.fixture(scope="module")
def obj():
    return load_object(make_procedural_mesh("textured_asym"))


@pytest.mark.slow
def test_scenes_are_plausible_and_deterministic(obj) -> None:
    renderer = make_renderer("cpu", "cpu")
    batches = [sample_scenes(obj, renderer, 3, (96, 128), torch.Generator().manual_seed(5),
                             torch.Generator().manual_seed(6)) for _ in range(2)]
    a, b = batches
    assert torch.equal(a.rgb, b.rgb) and torch.equal(a.depth, b.depth) and np.array_equal(a.Ks, b.Ks)
    assert a.rgb.dtype == torch.uint8 and a.rgb.shape == (3, 96, 128, 3)
    z = a.cam_from_centred[:, 2, 3]
    low, high = SceneConfig().distance_diameters
    assert torch.all(z >= low * obj.diameter - 1e-6) and torch.all(z <= high * obj.diameter + 1e-6)
    assert torch.all(a.mask.flatten(1).sum(1) > 20)  # the object is visible in every frame
    # depth is millimetre-quantised, holes are 0, the object's visible depth is near its pose's depth
    assert torch.allclose(a.depth * 1000, torch.round(a.depth * 1000), atol=2e-3)
    obj_depth = torch.where(a.mask & (a.depth > 0), a.depth, torch.nan).flatten(1).nanmedian(1).values
    assert torch.all((obj_depth - z).abs() < obj.diameter)
    R = a.cam_from_centred[:, :3, :3]
    assert torch.allclose(R @ R.transpose(1, 2), torch.eye(3).expand(3, 3, 3), atol=1e-5)


def test_scene_config_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError, match=r"^distance_diameters must be"):
        SceneConfig(distance_diameters=(3.0, 1.0))


def test_so3_log_inverts_exp() -> None:
    from foundationpose.pose_update import so3_exp_map

    omega = torch.tensor([[0.3, -0.2, 0.1], [0.0, 0.0, 1.2], [1e-6, 0.0, 0.0]], dtype=torch.float64)
    back = so3_log(so3_exp_map(omega, eps=0.0))
    assert torch.allclose(back, omega, atol=1e-6)


def test_refiner_targets_undo_the_perturbation(obj) -> None:
    """Feeding the targets back through the inference pose update lands on the truth (within the 20 deg bound)."""
    gen = torch.Generator().manual_seed(0)
    gt = torch.eye(4).repeat(64, 1, 1)
    gt[:, :3, :3] = random_rotations(64, gen).float()
    gt[:, :3, 3] = torch.tensor([0.02, -0.01, 0.5])
    hyp = perturb_poses(gt, obj.diameter, gen)
    trans, unit_rot = refiner_targets(hyp, gt, obj.diameter)
    inside = unit_rot.abs().max(dim=1).values < 0.97  # components not clipped
    assert inside.sum() > 32
    updated = apply_refiner_output(hyp, trans, torch.atanh(unit_rot), obj.diameter)
    points = torch.as_tensor(np.asarray(obj.mesh_centred.vertices), dtype=torch.float32)
    before = add_per_hypothesis(hyp, gt, points)
    after = add_per_hypothesis(updated, gt, points)
    assert before[inside].mean() > 0.05 * obj.diameter
    assert after[inside].max() < 1e-3 * obj.diameter  # pytorch3d-style exp eps keeps it from being exact
    assert torch.all(after[~inside] < before[~inside])  # clipped ones still move towards the truth
    angles = torch.rad2deg(torch.acos(((hyp[:, :3, :3] @ gt[:, :3, :3].transpose(1, 2)).diagonal(dim1=1, dim2=2).sum(1)
                                       .clamp(-1, 3) - 1) / 2))
    assert angles.max() <= 40.5 and angles.median() < 20  # the register/refine/track mixture
    assert abs(ROT_NORMALIZER - math.radians(20)) < 1e-12


def test_flipped_hypotheses_sit_where_a_register_leaves_them_turned_at_any_angle_with_depth_close_translations() -> None:
    cfg = RankingConfig(set_size=200, near_fraction=0.1, flip_fraction=0.9)
    gt = torch.eye(4, dtype=torch.float64)
    gt[2, 3] = 0.5
    diameter = 0.1
    hyp = hypothesis_set(gt.float(), diameter, torch.Generator().manual_seed(3), cfg).double()
    angles = torch.rad2deg(torch.acos(((hyp[:, :3, :3].diagonal(dim1=1, dim2=2).sum(1) - 1) / 2).clamp(-1, 1)))
    flipped = angles > 31.0  # the near ones stay within 30 deg (plus the flips' 3 deg jitter at most few sigma)
    assert 150 <= int(flipped.sum()) <= 180
    offsets = (hyp[flipped, :3, 3] - gt[:3, 3]).norm(dim=1)
    assert offsets.max() < 6 * cfg.flip_diameters * diameter  # depth-close: a refined register's translation
    quarter_or_half = ((angles[flipped] - 90).abs() < 12) | ((angles[flipped] - 180).abs() < 12)
    assert 0.3 < quarter_or_half.float().mean() < 0.8  # some at the box's 90 / 180 deg minima, the rest anywhere


@pytest.mark.parametrize("field, value", [("flip_diameters", -0.01), ("flip_any_angle", 1.5), ("flip_any_angle", -0.1)])
def test_flipped_hypotheses_settings_out_of_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RankingConfig(**{field: value})


def test_ranking_set_and_loss(obj) -> None:
    cfg = RankingConfig(set_size=8)
    gt = torch.eye(4)
    gt[2, 3] = 0.5
    hyp = hypothesis_set(gt, obj.diameter, torch.Generator().manual_seed(1), cfg)
    assert hyp.shape == (8, 4, 4)
    points = torch.as_tensor(np.asarray(obj.mesh_centred.vertices), dtype=torch.float32)
    add = add_per_hypothesis(hyp[None], gt[None, None], points)  # (1, 8)
    best = add.argmin(dim=1)
    good = torch.full((1, 8), -5.0)
    good[0, best] = 5.0
    _, hit_good = ranking_loss(good, add, obj.diameter, cfg)
    _, hit_bad = ranking_loss(-good, add, obj.diameter, cfg)
    assert hit_good.item() == 1.0 and hit_bad.item() == 0.0
    optimum = -add / (cfg.temperature_diameters * obj.diameter)  # logits equal to the target's log-probabilities
    loss_opt, _ = ranking_loss(optimum, add, obj.diameter, cfg)
    target = torch.softmax(optimum, dim=1)
    entropy = -(target * target.log().clamp(min=-1e30)).sum()
    loss_flat, _ = ranking_loss(torch.zeros(1, 8), add, obj.diameter, cfg)
    assert loss_opt.item() == pytest.approx(entropy.item(), abs=1e-5)
    assert loss_opt < loss_flat and loss_flat.item() == pytest.approx(math.log(8), abs=1e-5)


def test_lr_schedule() -> None:
    assert lr_factor(0, 0.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 0.0, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(100, 0.5, 10, 0.1) == pytest.approx(0.55)
    assert lr_factor(100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(100, 2.0, 10, 0.1) == pytest.approx(0.1)


def test_train_config_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^refiner_batch must be a positive multiple"):
        TrainConfig(mesh=DEMO_MESH, out_dir=tmp_path, refiner_batch=3, hypotheses_per_scene=2)
    with pytest.raises(ValueError, match=r"^crop_size must be"):
        TrainConfig(mesh=DEMO_MESH, out_dir=tmp_path, crop_size=200)


@pytest.mark.slow
def test_loss_falls_on_a_fixed_tiny_problem(tmp_path) -> None:
    """Overfit one fixed refiner batch and one fixed scorer set: both losses fall below half their start."""
    config = TrainConfig(mesh=DEMO_MESH, out_dir=tmp_path, lr=1e-4, warmup_steps=1, min_lr_fraction=1.0, **TINY)
    trainer = Trainer(config)
    refiner_batch = trainer.source.refiner_batch(4, 2)
    scorer_batch = trainer.source.scorer_batch(1)
    # 14 steps: the default L1 loss falls linearly rather than geometrically as the MSE did (10 were enough)
    refiner_losses = [float(trainer.refiner_step(refiner_batch)["refiner_loss"]) for _ in range(14)]
    scorer_losses = [float(trainer.scorer_step(scorer_batch)["scorer_loss"]) for _ in range(10)]
    assert refiner_losses[0] > 0.01
    assert refiner_losses[-1] < 0.5 * refiner_losses[0], refiner_losses
    assert scorer_losses[-1] < 0.5 * scorer_losses[0], scorer_losses


def _run_cli(out: Path, steps: int, *extra: str) -> dict:
    from foundationpose.train.cli import main

    argv = ["--mesh", str(DEMO_MESH), "--out", str(out), "--steps", str(steps), "--device", "cpu", "--batch", "2",
            "--scorer-sets", "1", "--set-size", "3", "--crop-size", "32", "--frame-size", "96", "128",
            "--log-every", "2", "--no-progress", *extra]
    assert main(argv) == 0
    return json.loads((out / "train_summary.json").read_text(encoding="utf-8"))


@pytest.mark.slow
def test_cli_smoke_run_writes_loadable_official_layout(tmp_path) -> None:
    out = tmp_path / "w"
    summary = _run_cli(out, 4)
    assert summary["steps"] == 4 and summary["refiner_steps"] + summary["scorer_steps"] == 4
    assert summary["scorer_steps"] >= 1
    rows = [json.loads(line) for line in (out / LOG_FILE).read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and all(math.isfinite(r["refiner_loss"]) for r in rows if "refiner_loss" in r)
    assert (out / "loss_curve.png").stat().st_size > 1000
    for run in (REFINER_RUN, SCORER_RUN):
        assert (out / run / "model_best.pth").is_file() and (out / run / "config.yml").is_file()
    # strict loads (load_refiner / load_scorer raise WeightsError on any key or shape mismatch)
    refiner, scorer = load_refiner(out), load_scorer(out)
    state = torch.load(out / STATE_FILE, map_location="cpu", weights_only=False)
    for model, key in ((refiner, "refiner"), (scorer, "scorer")):
        saved = state[key]
        assert set(model.state_dict()) == set(saved)
        assert all(torch.equal(model.state_dict()[k], saved[k].float() if saved[k].is_floating_point() else saved[k])
                   for k in saved)
    root, is_random = ensure_weights(out)
    assert root == out and not is_random
    assert "trained" in (out / REFINER_RUN / "config.yml").read_text(encoding="utf-8")


@pytest.mark.slow
def test_resume_continues_and_matches_an_uninterrupted_run(tmp_path) -> None:
    configs = {name: TrainConfig(mesh=DEMO_MESH, out_dir=tmp_path / name, steps=4, **TINY) for name in "ab"}
    straight = Trainer(configs["a"]).run()
    interrupted = Trainer(configs["b"])
    interrupted.run(stop_after=2)
    assert interrupted.step == 2 and (tmp_path / "b" / STATE_FILE).is_file()
    resumed_trainer = Trainer(configs["b"])
    assert resumed_trainer.step == 2
    resumed = resumed_trainer.run()
    assert straight["steps"] == resumed["steps"] == 4 and resumed["scorer_steps"] == straight["scorer_steps"] >= 1
    assert [r["step"] for r in resumed_trainer.history] == [2, 4]
    a = load_refiner(tmp_path / "a").state_dict()
    b = load_refiner(tmp_path / "b").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = load_scorer(tmp_path / "a").state_dict(), load_scorer(tmp_path / "b").state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_init_fine_tunes_from_existing_weights(tmp_path) -> None:
    _run_cli(tmp_path / "base", 2)
    _run_cli(tmp_path / "tuned", 2, "--init", str(tmp_path / "base"), "--seed", "3")
    base = load_refiner(tmp_path / "base").state_dict()
    tuned = load_refiner(tmp_path / "tuned").state_dict()
    key = "encodeA.0.net.0.weight"
    assert not torch.equal(base[key], tuned[key])
    assert (base[key] - tuned[key]).abs().max() < 0.05  # two small steps away from the initial weights


def test_cli_reports_bad_arguments(tmp_path, capsys) -> None:
    from foundationpose.train.cli import main

    assert main(["--mesh", str(tmp_path / "missing.obj"), "--out", str(tmp_path / "o"), "--device", "cpu",
                 "--steps", "1"]) == 1
    assert capsys.readouterr().err.startswith("InputError: ")


def test_refiner_loss_kinds_weigh_small_errors() -> None:
    """MSE's pull shrinks with the error; L1's does not (why L1 is the default); bad kinds are refused."""
    from foundationpose.train.refiner_targets import RefinerLossConfig, refiner_loss

    target = torch.zeros(1, 3)
    grads = {}
    for kind in ("mse", "l1", "smooth_l1"):
        for err in (0.02, 0.5):  # 0.4 deg (track) vs 10 deg in units of the 20 deg bound
            rot = torch.atanh(torch.full((1, 3), err)).requires_grad_()
            refiner_loss(torch.zeros(1, 3), rot, target, target, RefinerLossConfig(kind=kind)).total.backward()
            grads[kind, err] = float(rot.grad.abs().mean() / (1 - err * err))  # d loss / d tanh(rot)
    assert grads["mse", 0.5] / grads["mse", 0.02] == pytest.approx(25, rel=1e-3)
    assert grads["l1", 0.5] == pytest.approx(grads["l1", 0.02], rel=1e-4)
    assert grads["smooth_l1", 0.5] == pytest.approx(grads["smooth_l1", 0.02], rel=1e-4)  # beta 0.02: linear from there
    with pytest.raises(ValueError, match=r"^kind must be one of mse, l1, smooth_l1"):
        RefinerLossConfig(kind="huber")


def test_small_motion_rotation_errors_only_count_small_perturbations() -> None:
    from foundationpose.pose_update import so3_exp_map
    from foundationpose.train.loop import small_motion_rotation_errors

    gt = torch.eye(4).repeat(3, 1, 1)
    hyp = gt.clone()
    hyp[:, :3, :3] = so3_exp_map(torch.tensor([[math.radians(2.0), 0, 0], [0, math.radians(4.0), 0], [0, 0, math.radians(30.0)]]))
    updated = gt.clone()
    updated[:, :3, :3] = so3_exp_map(torch.tensor([[math.radians(1.0), 0, 0], [0, 0, math.radians(1.0)], [0, 0, 0.0]]))
    before, after = small_motion_rotation_errors(hyp, updated, gt)
    assert before.item() == pytest.approx(3.0, abs=1e-2) and after.item() == pytest.approx(1.0, abs=1e-2)


@pytest.mark.slow
def test_refiner_and_scorer_steps_log_the_precision_metrics(tmp_path) -> None:
    trainer = Trainer(TrainConfig(mesh=DEMO_MESH, out_dir=tmp_path, steps=2, **TINY))
    refiner = trainer.refiner_step()
    scorer = trainer.scorer_step()
    assert float(refiner["refiner_small_rot_before_deg"]) >= 0 and math.isfinite(float(refiner["refiner_small_rot_after_deg"]))
    assert float(scorer["scorer_pick_miss"]) in (0.0, 1.0)  # one set of 4


@pytest.mark.slow
def test_a_non_finite_batch_is_skipped_and_leaves_the_weights_finite(tmp_path) -> None:
    """A NaN input gives a NaN gradient: the step is skipped (and logged), the weights stay as they were."""
    trainer = Trainer(TrainConfig(mesh=DEMO_MESH, out_dir=tmp_path, **TINY))
    batch = trainer.source.scorer_batch(1)
    batch.render_input[0, 0, 0, 0] = float("nan")
    before = [p.detach().clone() for p in trainer.scorer.parameters()]
    out = trainer.scorer_step(batch)
    assert out["scorer_skipped"] == 1.0
    for old, new in zip(before, trainer.scorer.parameters(), strict=True):
        assert torch.equal(old, new.detach())
    good = trainer.scorer_step(trainer.source.scorer_batch(1))
    assert good["scorer_skipped"] == 0.0 and math.isfinite(float(good["scorer_loss"]))
    assert all(bool(torch.isfinite(p).all()) for p in trainer.scorer.parameters())
    assert trainer.scorer_lr == 1.5e-4 < trainer.config.lr  # the scorer has its own, lower peak


@pytest.mark.slow
def test_cli_hypotheses_per_scene(tmp_path, capsys) -> None:
    summary = _run_cli(tmp_path / "w", 2, "--batch", "4", "--hypotheses-per-scene", "4")
    assert summary["config"]["refiner_batch"] == 4 and summary["config"]["hypotheses_per_scene"] == 4
    from foundationpose.train.cli import main

    assert main(["--mesh", str(DEMO_MESH), "--out", str(tmp_path / "o"), "--device", "cpu", "--steps", "1",
                 "--batch", "6", "--hypotheses-per-scene", "4"]) == 1
    assert "multiple of hypotheses_per_scene" in capsys.readouterr().err
