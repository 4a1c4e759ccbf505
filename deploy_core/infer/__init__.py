"""Inference cores: one ``infer(inputs, outputs=None, stream=None)`` call, whatever the backend.

Backends: ``TorchInferCore`` (eager / compiled / CUDA graphs), ``OnnxRuntimeInferCore`` (CPU or CUDA EP, IO
binding), ``TensorRTInferCore`` (TensorRT >= 10 plans). Heavy libraries are imported lazily by their
backend; probe with :func:`has_onnxruntime` / :func:`has_tensorrt`.

::

    core = make_infer_core("torch", net, inputs=[TensorSpec("x", (-1, 3, 32, 32), torch.float32)],
                           outputs=[TensorSpec("y", (-1, 10), torch.float32)], max_batch=8, device="cpu")
    core.warmup([1, 8])
    result = core.infer({"x": x}, outputs={"y": lease.view("y", (n, 10))})
"""

from deploy_core.infer._base import BaseInferCore, TensorSpec
from deploy_core.infer._factory import BACKENDS, make_infer_core
from deploy_core.infer._ort_core import OnnxRuntimeInferCore, has_onnxruntime
from deploy_core.infer._torch_core import TorchInferCore
from deploy_core.infer._trt_core import TensorRTInferCore, has_tensorrt

__all__ = [
    "BACKENDS",
    "BaseInferCore",
    "OnnxRuntimeInferCore",
    "TensorRTInferCore",
    "TensorSpec",
    "TorchInferCore",
    "has_onnxruntime",
    "has_tensorrt",
    "make_infer_core",
]
