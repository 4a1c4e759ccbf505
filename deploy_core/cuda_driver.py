"""A handful of CUDA driver calls that keep the GIL: enqueue copies, a graph launch and an event in microseconds.

Every PyTorch call that touches the GPU releases the GIL and takes it back afterwards. That is right for long calls,
but a captured step's submit is a dozen calls of a few microseconds each, and under many busy Python threads each
retake can wait for another thread's whole slice (the switch interval), so a submit's wall time can be many times
its work (docs/benchmarks.md, "Host path"). Calling the driver through
``ctypes.PyDLL`` keeps the GIL for the call, so a submit is one uninterrupted run of enqueues. Waits (event
synchronisation) go through ``ctypes.CDLL``, which releases the GIL, as they must.

Only what the captured runners need is bound: host <-> device async copies, ``cuGraphLaunch`` of a captured
``torch.cuda.CUDAGraph`` (``raw_cuda_graph_exec``), events (create, record, synchronise) and the
primary context of a device (a thread that never called the CUDA runtime has no current context). Handles are the
runtime's (``cudaStream_t`` == ``CUstream``, ``cudaGraphExec_t`` == ``CUgraphExec``). :func:`load_driver` returns
None where there is no driver (CPU machines); callers keep their PyTorch path for that case.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

__all__ = ["CudaDriver", "CudaDriverError", "load_driver"]

log = logging.getLogger(__name__)

_CU_EVENT_DISABLE_TIMING = 0x2
_CUDA_SUCCESS = 0
_LIBRARY_NAMES = ("libcuda.so.1", "libcuda.so")

_loaded: CudaDriver | None = None
_load_failed: str | None = None
_load_lock = threading.Lock()


class CudaDriverError(RuntimeError):
    """A CUDA driver call returned an error: ``code`` and its driver name (e.g. CUDA_ERROR_INVALID_VALUE)."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


def load_driver() -> CudaDriver | None:
    """The process's :class:`CudaDriver` (loaded once), or None when libcuda cannot be loaded (no NVIDIA driver:
    the reason is logged once at INFO)."""
    global _loaded, _load_failed
    if _loaded is not None or _load_failed is not None:
        return _loaded
    with _load_lock:
        if _loaded is None and _load_failed is None:
            try:
                _loaded = CudaDriver()
            except OSError as exc:
                _load_failed = str(exc)
                log.info("CUDA driver calls unavailable (%s): runners keep their PyTorch launches", exc)
    return _loaded


def _library_path() -> str:
    for name in _LIBRARY_NAMES:
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    found = ctypes.util.find_library("cuda")
    if found is None:
        raise OSError(f"none of {_LIBRARY_NAMES} could be loaded (no NVIDIA driver on this machine)")
    return found


class CudaDriver:
    """libcuda loaded twice: ``held`` (a PyDLL: the GIL stays held, for enqueues) and ``released`` (a CDLL, for
    waits). Methods raise :class:`CudaDriverError` on a failed call. Thread-safe: the driver is."""

    def __init__(self, path: str | None = None) -> None:
        path = path or _library_path()
        self.path = path
        self.held = ctypes.PyDLL(path)
        self.released = ctypes.CDLL(path)
        vp, sz, u32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        signatures = {
            "cuMemcpyHtoDAsync_v2": (ctypes.c_uint64, vp, sz, vp),
            "cuMemcpyDtoHAsync_v2": (vp, ctypes.c_uint64, sz, vp),
            "cuMemcpyDtoDAsync_v2": (ctypes.c_uint64, ctypes.c_uint64, sz, vp),
            "cuGraphLaunch": (vp, vp),
            "cuEventCreate": (ctypes.POINTER(vp), u32),
            "cuEventRecord": (vp, vp),
            "cuEventSynchronize": (vp,),
            "cuCtxGetCurrent": (ctypes.POINTER(vp),),
            "cuCtxSetCurrent": (vp,),
            "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
            "cuDevicePrimaryCtxRetain": (ctypes.POINTER(vp), ctypes.c_int),
            "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
        }
        for lib in (self.held, self.released):
            for name, args in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = list(args), ctypes.c_int
        self._contexts: dict[int, int] = {}  # device ordinal -> its retained primary context
        self._context_lock = threading.Lock()

    # -- errors and contexts ----------------------------------------------------------------------------------------

    def _check(self, call: str, code: int) -> None:
        if code != _CUDA_SUCCESS:
            name = ctypes.c_char_p()
            self.held.cuGetErrorName(code, ctypes.byref(name))
            raise CudaDriverError(call, code, (name.value or b"unknown").decode())

    def use_device(self, ordinal: int) -> None:
        """Make the primary context of device ``ordinal`` current on this thread if it is not (the context the CUDA
        runtime, and so PyTorch, uses; retained once per process)."""
        context = self._contexts.get(ordinal)
        if context is None:
            with self._context_lock:
                context = self._contexts.get(ordinal)
                if context is None:
                    dev = ctypes.c_int()
                    self._check("cuDeviceGet", self.held.cuDeviceGet(ctypes.byref(dev), ordinal))
                    ctx = ctypes.c_void_p()
                    self._check("cuDevicePrimaryCtxRetain", self.held.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
                    context = self._contexts[ordinal] = int(ctx.value or 0)
        # asked every time (~1 us): PyTorch may have made another device's context current on this thread since
        current = ctypes.c_void_p()
        self._check("cuCtxGetCurrent", self.held.cuCtxGetCurrent(ctypes.byref(current)))
        if int(current.value or 0) != context:
            self._check("cuCtxSetCurrent", self.held.cuCtxSetCurrent(context))

    # -- enqueues (the GIL stays held) ------------------------------------------------------------------------------

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Enqueue ``nbytes`` from host address ``src`` to device address ``dst`` on ``stream`` (asynchronous from
        page-locked memory; from pageable memory the driver stages it before returning)."""
        self._check("cuMemcpyHtoDAsync", self.held.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream))

    def copy_to_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Enqueue ``nbytes`` from device address ``src`` to host address ``dst`` (page-locked) on ``stream``."""
        self._check("cuMemcpyDtoHAsync", self.held.cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream))

    def copy_on_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Enqueue ``nbytes`` from device address ``src`` to device address ``dst`` on ``stream``."""
        self._check("cuMemcpyDtoDAsync", self.held.cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream))

    def launch_graph(self, graph_exec: int, stream: int) -> None:
        """Enqueue one launch of an instantiated graph on ``stream``."""
        self._check("cuGraphLaunch", self.held.cuGraphLaunch(graph_exec, stream))

    def new_event(self) -> int:
        """A new event without timing (cheaper to record and wait for), kept for the process's life."""
        event = ctypes.c_void_p()
        self._check("cuEventCreate", self.held.cuEventCreate(ctypes.byref(event), _CU_EVENT_DISABLE_TIMING))
        return int(event.value or 0)

    def record_event(self, event: int, stream: int) -> None:
        self._check("cuEventRecord", self.held.cuEventRecord(event, stream))

    # -- waits (the GIL released) -----------------------------------------------------------------------------------

    def wait_event(self, event: int) -> None:
        """Block this thread until the event's last record has completed; other Python threads run meanwhile."""
        self._check("cuEventSynchronize", self.released.cuEventSynchronize(event))

