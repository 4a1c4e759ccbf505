"""deploy_core.capture.capture_graph on CUDA: captures in several threads at once, and a step that fails mid-capture."""

from __future__ import annotations

import threading

import pytest
import torch

from deploy_core.capture import capture_graph

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


def _affine_step(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, hold: threading.Event | None = None,
                 calls: list[int] | None = None):
    """out = relu(x @ w) + 1, in three launches; ``hold``: wait for it on the host between them (a capture in
    progress for as long as the test wants)."""
    def run() -> torch.Tensor:
        if calls is not None:
            calls.append(1)
        y = x @ w
        if hold is not None and calls is not None and len(calls) == 3:  # the captured call (after two warm-ups)
            hold.wait(timeout=60)
        out.copy_(torch.relu(y) + 1.0)
        return out
    return run


@needs_cuda
def test_a_capture_beside_another_in_progress_leaves_both_whole_cuda() -> None:
    """A second runner that starts capturing while the first is mid-capture waits for it: both graphs replay right
    (torch.cuda.graph's device-wide synchronise at entry would fail and break the first)."""
    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    xs = [torch.randn(64, 64, generator=gen).to(device) for _ in range(2)]
    ws = [torch.randn(64, 64, generator=gen).to(device) for _ in range(2)]
    outs = [torch.empty(64, 64, device=device) for _ in range(2)]
    first_capturing, release = threading.Event(), threading.Event()
    calls: list[int] = []
    results: dict[str, object] = {}

    class Hold(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:  # the first is inside its capture now
            first_capturing.set()
            return release.wait(timeout)

    def capture(name: str, run) -> None:
        try:
            results[name] = capture_graph(run, device, torch.cuda.Stream(device))[0]
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            results[name] = exc

    first = threading.Thread(target=capture, args=("first", _affine_step(xs[0], ws[0], outs[0], Hold(), calls)))
    second = threading.Thread(target=capture, args=("second", _affine_step(xs[1], ws[1], outs[1])))
    first.start()
    assert first_capturing.wait(timeout=60), "the first capture never reached its captured call"
    second.start()
    release.set()
    first.join(timeout=120)
    second.join(timeout=120)
    assert not first.is_alive() and not second.is_alive()
    for name, i in (("first", 0), ("second", 1)):
        graph = results[name]
        assert isinstance(graph, torch.cuda.CUDAGraph), f"{name} capture failed: {graph!r}"
        outs[i].zero_()
        graph.replay()
        torch.cuda.synchronize(device)
        torch.testing.assert_close(outs[i], torch.relu(xs[i] @ ws[i]) + 1.0)


@needs_cuda
def test_a_step_failing_mid_capture_raises_its_own_error_and_frees_the_stream_cuda() -> None:
    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    x = torch.ones(8, device=device)
    calls: list[int] = []

    def run() -> torch.Tensor:
        calls.append(1)
        y = x * 2.0
        if len(calls) == 3:  # the captured call
            raise ValueError("the step's own error")
        return y

    with pytest.raises(ValueError, match="the step's own error"):
        capture_graph(run, device, stream)
    with torch.cuda.stream(stream):  # the stream takes eager work again
        z = (x + 1.0).sum()
    stream.synchronize()
    assert float(z) == 16.0
    assert not torch.cuda.is_current_stream_capturing()
