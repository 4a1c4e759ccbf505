"""The Triton network-input kernel (foundationpose/_network_inputs_triton.py) against its eager twin.

Bit-identical (compared as int32 bit patterns, so even the sign of a zero counts) to
``network_inputs.write_network_input_reference`` under the Triton interpreter on CPU tensors, on odd sizes,
with invalid-z pixels, values exactly at the thresholds and strided views; the register and track steps with the
kernel equal the steps with the eager twin; error paths; the generated PTX
(offline compile for sm_90, no GPU); and, on a GPU, the compiled kernel at the register's size, eager and
captured in a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundationpose import network_inputs
from foundationpose.network_inputs import (
    REFINE_INVALID_Z,
    SCORE_INVALID_Z,
    XYZ_CLIP,
    write_network_input,
    write_network_input_reference,
)
from foundationpose.refine import assemble_pair_inputs
from foundationpose.render.base import RenderOutput
from tests.foundationpose._triton import import_kernels, triton_marks

kernels, _IMPORT_ERROR = import_kernels("foundationpose._network_inputs_triton")

needs_interpreter, needs_cuda = triton_marks(kernels, _IMPORT_ERROR)
F32 = np.float32


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    differing = int((bits(got) != bits(want)).sum())
    assert differing == 0, f"{differing} of {want.numel()} values differ"


def branch_inputs(
    n: int, s: int, seed: int, diameter: float, invalid_z: float, device: str = "cpu"
) -> tuple[torch.Tensor, ...]:
    """rgb in [0, 1], rgb 0..255, xyz around t with background, invalid z (just below, exactly at the threshold)
    and components that normalise to exactly +-XYZ_CLIP and to the float32 just inside it."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand((n, 3), generator=g) * 0.2 - 0.1
    t[:, 2] += 0.5
    rho = diameter / 2
    xyz = t[:, None, None, :] + (torch.rand((n, s, s, 3), generator=g) * 2 - 1) * (2.6 * rho)  # some beyond clip
    xyz[0, 0, :] = 0.0  # background row
    if n > 1:  # x', y' = 0.5 (z' is clipped: z is far from t)
        xyz[1, 1, :2, :2] = t[1, :2] + 0.5 * rho
        xyz[1, 1, 0, 2] = float(F32(invalid_z))  # exactly at the threshold: valid
        xyz[1, 1, 1, 2] = float(np.nextafter(F32(invalid_z), F32(0)))  # just below: all three zeroed
    xyz[-1, -1, -1, 2] = -0.3  # behind the camera
    rgb_unit = torch.rand((n, s, s, 3), generator=g)
    rgb_unit[0, 0, 0] = torch.tensor([0.0, 1.0, 0.5])
    rgb_255 = torch.rand((n, s, s, 3), generator=g) * 255.0
    rgb_255[0, 0, 0] = torch.tensor([0.0, 255.0, 127.5])
    return tuple(x.to(device) for x in (rgb_unit, rgb_255, xyz, t))


DIRECT = ["kernel"]  # the kernel's own entry point, besides write_network_input (None)


def triton_write(rgb, xyz, t, out, *, diameter, invalid_z, rendered, layout=None):
    """The Triton path: write_network_input when layout is None, else the kernel's entry point directly."""
    if layout is None:
        assert write_network_input(
            rgb, xyz, t, out, diameter=diameter, invalid_z=invalid_z, rendered=rendered, impl="triton"
        ) is out
        return
    kernels.write_network_input_triton(
        rgb, xyz, t, out, rendered=rendered, xyz_scale=float(network_inputs._radius_reciprocal_f32(diameter)),
        invalid_z=invalid_z, rgb_unit_scale=network_inputs.RGB_SCALE, xyz_clip=XYZ_CLIP,
    )


def both(rgb, xyz, t, *, diameter, invalid_z, rendered, layout=None):
    """(eager twin, triton kernel) outputs in fresh buffers pre-filled with garbage (both fully overwritten).
    layout None: through write_network_input, else the kernel's entry point directly."""
    shape = (*rgb.shape[:-1], 6)
    outs = [torch.full(shape, float("nan"), device=rgb.device) for _ in range(2)]
    kwargs = {"diameter": diameter, "invalid_z": invalid_z, "rendered": rendered}
    write_network_input_reference(rgb, xyz, t, outs[0], **kwargs)
    triton_write(rgb, xyz, t, outs[1], layout=layout, **kwargs)
    return outs


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------


def test_auto_on_cpu_never_touches_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden():
        raise AssertionError("triton probed for a CPU tensor")

    monkeypatch.setattr(network_inputs, "_triton_kernels", forbidden)
    rgb, _, xyz, t = branch_inputs(2, 5, 0, 0.2, REFINE_INVALID_Z)
    out = torch.empty((2, 5, 5, 6))
    write_network_input(rgb, xyz, t, out, diameter=0.2, invalid_z=REFINE_INVALID_Z, rendered=True)
    want = write_network_input_reference(
        rgb, xyz, t, torch.empty_like(out), diameter=0.2, invalid_z=REFINE_INVALID_Z, rendered=True
    )
    assert_bit_equal(out, want)


def test_impl_triton_without_triton_raises_and_bad_impl_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.setattr(network_inputs, "_triton_kernels", lambda: None)
    rgb, _, xyz, t = branch_inputs(1, 3, 0, 0.2, REFINE_INVALID_Z)
    out = torch.empty((1, 3, 3, 6))
    kwargs = {"diameter": 0.2, "invalid_z": REFINE_INVALID_Z, "rendered": False}
    with pytest.raises(RuntimeError, match=r"^network input impl='triton' requested but triton does not import$"):
        write_network_input(rgb, xyz, t, out, impl="triton", **kwargs)
    with pytest.raises(ValueError, match=r"^network input impl must be one of auto, torch, triton; got 'cuda'$"):
        write_network_input(rgb, xyz, t, out, impl="cuda", **kwargs)  # type: ignore[arg-type]
    write_network_input(rgb, xyz, t, out, impl="torch", **kwargs)  # explicit torch never probes triton
    expected = torch.empty_like(out)
    write_network_input(rgb, xyz, t, expected, impl="torch", **kwargs)
    write_network_input(rgb, xyz, t, out, impl="auto", **kwargs)  # auto without triton: the eager twin
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))


# ----------------------------------------------------------------------------------------------
# Kernel under the interpreter (CPU tensors)
# ----------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize(("n", "s", "seed"), [(3, 7, 0), (1, 5, 1), (2, 13, 2)])
@pytest.mark.parametrize("invalid_z", [REFINE_INVALID_Z, SCORE_INVALID_Z])
@pytest.mark.parametrize("layout", [None, *DIRECT])
def test_interpreter_bit_identical_to_the_eager_twin(n: int, s: int, seed: int, invalid_z: float, layout) -> None:
    diameter = 0.1523  # an r = 1 / rho that is not a power of two
    rgb_unit, rgb_255, xyz, t = branch_inputs(n, s, seed, diameter, invalid_z)
    for rgb, rendered in ((rgb_unit, True), (rgb_255, False)):
        want, got = both(rgb, xyz, t, diameter=diameter, invalid_z=invalid_z, rendered=rendered, layout=layout)
        assert_bit_equal(got, want)
        assert torch.isfinite(got).all()
        assert (got[..., 3:] == 0).any() and (got[..., 3:].abs() > 1).any()  # zeroed and large components
    if n > 1:  # exactly at the threshold stays, just below it zeroes all three
        assert (got[1, 1, 0, 3:5] != 0).all() and (got[1, 1, 1, 3:] == 0).all()
    assert got[0, 0, 0, :3].tolist() == [0.0, 1.0, float(F32(127.5) * F32(network_inputs.RGB_SCALE))]


@needs_interpreter
@pytest.mark.parametrize("layout", DIRECT)
def test_interpreter_clip_bound_is_exclusive(layout: str) -> None:
    # d = 0.5: rho = 0.25, r = 4 exactly; t = 0.25. x = 0.75 -> x' = 2 exactly (zeroed); the float32 below 0.75
    # -> x' just under 2 (kept); x = -0.25 -> -2 (zeroed); z = 0.5 -> 1 (kept) shows only one component goes.
    below = float(np.nextafter(F32(0.75), F32(0)))
    xyz = torch.tensor([[[[0.75, below, 0.5], [-0.25, 0.25, 0.5], [below, -0.25, 0.75]]]])
    t = torch.tensor([[0.25, 0.25, 0.25]])
    rgb = torch.zeros_like(xyz)
    want, got = both(rgb, xyz, t, diameter=0.5, invalid_z=REFINE_INVALID_Z, rendered=True, layout=layout)
    assert_bit_equal(got, want)
    kept = float((F32(below) - F32(0.25)) * F32(4.0))
    assert kept < XYZ_CLIP
    assert got[0, 0, :, 3:].tolist() == [[0.0, kept, 1.0], [0.0, 0.0, 1.0], [kept, 0.0, 0.0]]


@needs_interpreter
@pytest.mark.parametrize("layout", [None, *DIRECT])
def test_interpreter_strided_views_and_in_place(layout) -> None:
    n, s, diameter = 2, 9, 0.3
    rgb_unit, rgb_255, xyz, _ = branch_inputs(n, s, 3, diameter, REFINE_INVALID_Z)
    poses = torch.eye(4).repeat(n, 1, 1)
    poses[:, :3, 3] = torch.tensor([[0.01, -0.02, 0.5], [0.0, 0.03, 0.45]])
    t = poses[:, :3, 3]  # strides (16, 4): a column of the pose batch
    rgb_cf = rgb_unit.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)  # channels-first storage
    xyz_wide = torch.zeros((n, s, s, 4))
    xyz_wide[..., :3] = xyz
    xyz_view = xyz_wide[..., :3]  # a channel slice
    want = write_network_input_reference(
        rgb_unit, xyz, t.contiguous(), torch.empty((n, s, s, 6)), diameter=diameter, invalid_z=REFINE_INVALID_Z,
        rendered=True,
    )
    pool = torch.full((n + 3, 6, s, s), float("nan"))  # a channels-first pool buffer; rows 1..n are ours
    out = pool[1 : n + 1].permute(0, 2, 3, 1)
    triton_write(rgb_cf, xyz_view, t, out, diameter=diameter, invalid_z=REFINE_INVALID_Z, rendered=True, layout=layout)
    assert_bit_equal(out, want)
    assert pool[0].isnan().all() and pool[n + 1 :].isnan().all()  # nothing outside the view
    # In place: the buffer holds the inputs in its own channels (pixel for pixel the same memory).
    buf = torch.cat([rgb_255, xyz], dim=-1)
    want_b = write_network_input_reference(
        rgb_255, xyz, t, torch.empty_like(buf), diameter=diameter, invalid_z=SCORE_INVALID_Z, rendered=False
    )
    triton_write(
        buf[..., :3], buf[..., 3:], t, buf, diameter=diameter, invalid_z=SCORE_INVALID_Z, rendered=False, layout=layout
    )
    assert_bit_equal(buf, want_b)


@needs_interpreter
def test_assemble_pair_inputs_triton_equals_torch() -> None:
    n, s, diameter = 3, 6, 0.2
    rgb_unit, rgb_255, xyz_a, _ = branch_inputs(n, s, 4, diameter, REFINE_INVALID_Z)
    _, _, xyz_b, _ = branch_inputs(n, s, 5, diameter, REFINE_INVALID_Z)
    poses = torch.eye(4).repeat(n, 1, 1)
    poses[:, :3, 3] = torch.tensor([0.01, 0.02, 0.5])
    rendered = RenderOutput(rgb=rgb_unit, xyz_cam=xyz_a, mask=torch.ones((n, s, s), dtype=torch.bool))
    crop = torch.eye(3).repeat(n, 1, 1)
    want = assemble_pair_inputs(rendered, rgb_255, xyz_b, poses, diameter, REFINE_INVALID_Z, crop, impl="torch")
    out_r, out_t = torch.empty((n, s, s, 6)), torch.empty((n, s, s, 6))
    got = assemble_pair_inputs(
        rendered, rgb_255, xyz_b, poses, diameter, REFINE_INVALID_Z, crop, out_r, out_t, impl="triton"
    )
    assert got.render_input is out_r and got.transf_input is out_t and got.crop_from_img is crop
    assert_bit_equal(got.render_input, want.render_input)
    assert_bit_equal(got.transf_input, want.transf_input)
    # float64 poses: t is rounded to float32 first, as normalize_xyz's t.to(xyz.dtype)
    got64 = assemble_pair_inputs(rendered, rgb_255, xyz_b, poses.double(), diameter, REFINE_INVALID_Z, crop,
                                 impl="triton")
    assert_bit_equal(got64.transf_input, want.transf_input)


@needs_interpreter
def test_kernel_rejects_bad_arguments_with_named_fields() -> None:
    rgb, _, xyz, t = branch_inputs(2, 4, 6, 0.2, REFINE_INVALID_Z)
    out = torch.empty((2, 4, 4, 6))
    kwargs = {"diameter": 0.2, "invalid_z": REFINE_INVALID_Z, "rendered": True, "impl": "triton"}
    with pytest.raises(TypeError, match=r"^xyz: expected float32; got torch.float64$"):
        write_network_input(rgb, xyz.double(), t, out, **kwargs)
    with pytest.raises(ValueError, match=r"^out: expected shape \(2, 4, 4, 6\); got \(2, 4, 4, 5\)$"):
        write_network_input(rgb, xyz, t, out[..., :5], **kwargs)
    with pytest.raises(ValueError, match=r"^t: expected shape \(2, 3\); got \(2, 4\)$"):
        write_network_input(rgb, xyz, torch.zeros((2, 4)), out, **kwargs)
    with pytest.raises(ValueError, match=r"^rgb: expected \(N, S, S, 3\); got \(2, 4, 4\)$"):
        write_network_input(rgb[..., 0], xyz, t, out, **kwargs)
    with pytest.raises(ValueError, match=r"^xyz: expected shape \(2, 4, 4, 3\); got \(1, 4, 4, 3\)$"):
        write_network_input(rgb, xyz[:1], t, out, **kwargs)
    empty = torch.empty((0, 4, 4, 6))  # no crops: nothing to launch
    assert write_network_input(rgb[:0], xyz[:0], t[:0], empty, **kwargs) is empty


# ----------------------------------------------------------------------------------------------
# The estimator, the lanes and the track-graph runner pass the config through
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    calls: list[bool] = []
    real = kernels.write_network_input_triton

    def spy(*args, **kwargs):
        calls.append(kwargs["rendered"])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "write_network_input_triton", spy)
    return calls


@pytest.mark.slow
@needs_interpreter
def test_the_step_runners_with_the_kernel_give_the_eager_twins_poses(scene, tiny_estimator, kernel_calls) -> None:
    """The register and track steps with ``network_input_impl="triton"`` (what "auto" picks on CUDA) equal the
    steps with the eager twin, bit for bit, and call the kernel once per branch of every iteration."""
    from foundationpose.observation import prepare_frame
    from foundationpose.register_graph import RegisterGraphRunner
    from foundationpose.track_graph import TrackFrame, TrackGraphConfig, TrackGraphRunner

    if tiny_estimator.device.type != "cpu":
        pytest.skip("the interpreter runs on CPU tensors")
    est = tiny_estimator
    frame = prepare_frame(scene.rgb, scene.depth, scene.K, "cpu", xyz_float64=True, constants=est.constants)
    mask = torch.as_tensor(scene.mask)
    poses = est.hypotheses(frame, mask)
    iterations = est.config.register_iterations
    registers = [RegisterGraphRunner(est.networks.refiner, est.networks.scorer, est.renderer, "cpu",
                                     constants=est.constants, network_input_impl=impl) for impl in ("triton", "torch")]
    kernel_calls.clear()
    got = registers[0].run(scene.obj, frame, poses, iterations)
    assert kernel_calls == [True, False] * (iterations + 1)  # each refine iteration and the scorer, A then B
    want = registers[1].run(scene.obj, frame, poses, iterations)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1:] == want[1:]
    start = np.asarray(got[0], np.float32)
    track_frame = TrackFrame(rgb=scene.rgb, depth=scene.depth, K=scene.K, start=start)
    tracks = [TrackGraphRunner(est.networks.track_refiner, est.renderer, "cpu", config=TrackGraphConfig(batch_sizes=(1,)),
                               constants=est.constants, network_input_impl=impl) for impl in ("triton", "torch")]
    kernel_calls.clear()
    tracked, judged = tracks[0].run(scene.obj, [track_frame], est.config.track_iterations)
    assert kernel_calls == [True, False] * est.config.track_iterations
    twin_poses, twin_judged = tracks[1].run(scene.obj, [track_frame], est.config.track_iterations)
    np.testing.assert_array_equal(tracked, twin_poses)
    np.testing.assert_array_equal(judged, twin_judged)


# ----------------------------------------------------------------------------------------------
# Generated code (offline compile for sm_90; no GPU needed)
# ----------------------------------------------------------------------------------------------


def _count(ptx: str, opcode: str) -> int:
    return sum(1 for line in ptx.splitlines() if line.strip().split(" ")[0].split("\t")[0] == opcode)


@pytest.mark.slow
@pytest.mark.skipif(kernels is None, reason=_IMPORT_ERROR or "")
@pytest.mark.parametrize("rendered", [True, False])
def test_generated_ptx_rounds_every_product(tmp_path, monkeypatch: pytest.MonkeyPatch, rendered: bool) -> None:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDAOptions  # noqa: F401
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("triton without the NVIDIA backend")
    if kernels._is_interpreted(kernels._JIT):
        pytest.skip("TRITON_INTERPRET=1: no compiler")
    assert kernels._COMPILE_OPTIONS == {"enable_fp_fusion": False}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    signature = {name: "*fp32" for name in ("rgb_ptr", "xyz_ptr", "t_ptr", "out_ptr", "scale_rows_ptr")}
    strides = [f"{a}_s{b}" for a in ("rgb", "xyz", "out") for b in "nhwc"]
    signature.update({name: "i32" for name in ("height", "width", *strides, "t_sn", "t_sc")})
    signature.update({name: "fp32" for name in ("rgb_unit_scale", "xyz_scale", "invalid_z", "xyz_clip")})
    signature.update(RENDERED="constexpr", SCALE_ROWS="constexpr", BLOCK="constexpr")
    options = {"num_warps": kernels._NUM_WARPS, **kernels._COMPILE_OPTIONS}
    ptx = ""
    for scale_rows in (False, True):  # one xyz factor for the batch, then one per row (an object group's rows)
        src = ASTSource(fn=kernels._JIT, signature=signature,
                        constexprs={"RENDERED": rendered, "SCALE_ROWS": scale_rows, "BLOCK": kernels.BLOCK_PIXELS})
        ptx += triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    # Every float32 product and difference carries an explicit round-to-nearest (``.rn``), which ptxas never
    # contracts into an FMA; how many remain after the compiler folds constants and drops unselected lanes is the
    # compiler's business, not the property.
    f32 = [line.strip().split()[0] for line in ptx.splitlines()
           if line.strip() and line.strip().split()[0].endswith(".f32")]
    products = [op for op in f32 if op.startswith("mul.")]
    differences = [op for op in f32 if op.startswith(("sub.", "add."))]
    assert products and differences, "the kernel has no float32 arithmetic left: the test reads the wrong PTX"
    assert set(products) == {"mul.rn.f32"}, f"unrounded products: {sorted(set(products))}"
    assert {op.split(".")[1] for op in differences} == {"rn"}, f"unrounded sums: {sorted(set(differences))}"
    assert not [op for op in f32 if op.startswith(("fma.", "mad."))]
    assert "div" not in "".join(line for line in ptx.splitlines() if ".f32" in line)


# ----------------------------------------------------------------------------------------------
# CUDA: the compiled kernel vs the eager twin on the same GPU
# ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("n", [1, 64, 252])
@pytest.mark.parametrize("layout", [None, *DIRECT])
def test_cuda_bit_identical_at_register_sizes(n: int, layout) -> None:
    diameter = 0.1523
    rgb_unit, rgb_255, xyz, t = branch_inputs(n, 160, n, diameter, REFINE_INVALID_Z, device="cuda")
    planar = xyz.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)  # as the warps hand them over
    for rgb, points, rendered, invalid_z in (
        (rgb_unit, xyz, True, REFINE_INVALID_Z), (rgb_255, planar, False, SCORE_INVALID_Z)
    ):
        want, got = both(rgb, points, t, diameter=diameter, invalid_z=invalid_z, rendered=rendered, layout=layout)
        assert_bit_equal(got, want)
    assert torch.equal(write_network_input(rgb, planar, t, torch.empty_like(got), diameter=diameter,
                                           invalid_z=SCORE_INVALID_Z, rendered=False), got)  # auto = triton here


@needs_cuda
def test_cuda_graph_capture_replays_the_same_bits() -> None:
    n, s, diameter = 8, 160, 0.2
    rgb_unit, rgb_255, xyz, t = branch_inputs(n, s, 9, diameter, REFINE_INVALID_Z, device="cuda")
    out = torch.empty((n, s, s, 6), device="cuda")
    kwargs = {"diameter": diameter, "invalid_z": REFINE_INVALID_Z, "rendered": True, "impl": "triton"}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        write_network_input(rgb_unit, xyz, t, out, **kwargs)  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_network_input(rgb_unit, xyz, t, out, **kwargs)
    xyz.add_(0.01)  # new data in the same buffers
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = write_network_input_reference(rgb_unit, xyz, t, torch.empty_like(out), diameter=diameter,
                                         invalid_z=REFINE_INVALID_Z, rendered=True)
    assert_bit_equal(out, want)
