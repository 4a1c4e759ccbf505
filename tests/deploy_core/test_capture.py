"""deploy_core.capture.capture_graph on CUDA: captures in several threads at once, and a step that fails mid-capture."""

from __future__ import annotations

import logging
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


class _Entry:
    def __init__(self, obj: object) -> None:
        self.obj = obj
        self.graph = None


class _Stream:
    def __init__(self) -> None:
        self.synchronised = 0

    def synchronize(self) -> None:
        self.synchronised += 1


def _steps_failing(monkeypatch, failures: int):
    """CapturedSteps whose capture fails ``failures`` times, then succeeds; the captures tried, in a list. The CUDA
    parts (stream, pool, the capture itself) are stand-ins: this checks the retry rule, the CUDA tests above the
    capture."""
    import deploy_core.capture as capture

    tried: list[tuple] = []

    def fake_capture(run, device, stream, *, pool=None, warmup_runs=capture.WARMUP_RUNS):
        tried.append(stream)
        if len(tried) <= failures:
            raise RuntimeError("operation not permitted when stream is capturing")
        return "graph", None

    monkeypatch.setattr(capture, "capture_graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    stream = _Stream()
    steps = capture.CapturedSteps(torch.device("cpu"), stream, capturable=True, max_entries=4, name="track")
    return steps, tried, stream


def test_a_failed_capture_is_tried_again_on_the_entrys_next_use(monkeypatch, caplog) -> None:
    steps, tried, stream = _steps_failing(monkeypatch, failures=1)
    obj = object()
    with caplog.at_level(logging.INFO, logger="deploy_core.capture"):
        entry = steps.get((id(obj), 8), lambda: _Entry(obj), lambda e: None)
        assert entry.graph is None and steps.capture_failures == 1 and stream.synchronised == 1
        assert steps.get((id(obj), 8), lambda: _Entry(obj), lambda e: None) is entry
    assert entry.graph == "graph" and len(tried) == 2 and steps.captures == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("attempt 1 of 3" in m and "tried again on its next use" in m for m in messages), messages
    assert any("captured" in m and "after 1 failed" in m for m in messages), messages
    steps.get((id(obj), 8), lambda: _Entry(obj), lambda e: None)
    assert len(tried) == 2  # captured: never again


def test_a_capture_that_keeps_failing_stays_eager_after_its_attempts(monkeypatch, caplog) -> None:
    from deploy_core.capture import CAPTURE_ATTEMPTS

    steps, tried, _ = _steps_failing(monkeypatch, failures=10**6)
    obj = object()
    with caplog.at_level(logging.WARNING, logger="deploy_core.capture"):
        for _ in range(CAPTURE_ATTEMPTS + 5):
            entry = steps.get((id(obj), 4), lambda: _Entry(obj), lambda e: None)
    assert entry.graph is None and len(tried) == CAPTURE_ATTEMPTS == steps.capture_failures
    assert "eager from now on" in caplog.records[-1].getMessage()
    assert sum(bool(r.exc_info) for r in caplog.records) == 1  # the traceback once
    steps.forget(obj)  # a new entry of the key (the object uploaded again) gets its own attempts
    steps.get((id(obj), 4), lambda: _Entry(obj), lambda e: None)
    assert len(tried) == CAPTURE_ATTEMPTS + 1
