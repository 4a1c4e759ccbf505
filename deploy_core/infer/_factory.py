"""Build an inference core by backend name."""

from __future__ import annotations

from typing import Any, Literal

from deploy_core.infer._base import BaseInferCore

__all__ = ["BACKENDS", "make_infer_core"]

Backend = Literal["torch", "onnxruntime", "tensorrt"]
BACKENDS: tuple[str, ...] = ("torch", "onnxruntime", "tensorrt")


def make_infer_core(backend: Backend, /, *args: Any, **kwargs: Any) -> BaseInferCore:
    """``make_infer_core("torch", module, inputs, outputs, max_batch, device, ...)`` ->
    :class:`TorchInferCore`; ``"onnxruntime"`` -> :class:`OnnxRuntimeInferCore` (``onnx_path, max_batch,
    device, providers``); ``"tensorrt"`` -> :class:`TensorRTInferCore` (``plan_path, max_batch, device,
    profile_index``). Remaining arguments go to the backend's constructor unchanged.

    For the file-based backends ``path=`` is accepted as an alias of ``onnx_path=`` / ``plan_path=``, so a
    caller can pass one keyword whatever the backend.

    A backend whose library is missing raises ``ImportError`` with the install hint; probe first with
    ``has_onnxruntime()`` / ``has_tensorrt()``.
    """
    if backend == "torch":
        from deploy_core.infer._torch_core import TorchInferCore

        return TorchInferCore(*args, **kwargs)
    if backend == "onnxruntime":
        from deploy_core.infer._ort_core import OnnxRuntimeInferCore

        return OnnxRuntimeInferCore(*args, **_alias_path(kwargs, "onnx_path"))
    if backend == "tensorrt":
        from deploy_core.infer._trt_core import TensorRTInferCore

        return TensorRTInferCore(*args, **_alias_path(kwargs, "plan_path"))
    raise ValueError(f"unknown inference backend {backend!r}; expected one of {list(BACKENDS)}")


def _alias_path(kwargs: dict[str, Any], name: str) -> dict[str, Any]:
    if "path" in kwargs:
        if name in kwargs:
            raise TypeError(f"pass either path= or {name}=, not both")
        kwargs = dict(kwargs)
        kwargs[name] = kwargs.pop("path")
    return kwargs
