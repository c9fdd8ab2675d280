"""cuDNN through ctypes: a row-wise softmax and its backward pass.

cuDNN 9 is split into sub-libraries; the legacy functions used here (tensor descriptors, softmax)
live in libcudnn_ops but are exported through the libcudnn.so.9 shim, which loads the sub-library
on first use. If a shim ever lacks a symbol we fall back to the sub-library in the same folder.

Descriptors are created at setup and destroyed by `close`, so the training step only launches.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from graphtrain.errors import GraphtrainError, UsageError
from graphtrain.libs import cuda
from graphtrain.libs._dl import LoadedLibrary, load_library

INSTALL = ("pip install 'graphtrain[cu12]' or 'graphtrain[cu13]' installs it "
           "(nvidia-cudnn-cu12 or nvidia-cudnn-cu13).")

# Enum values from cudnn_graph.h / cudnn_ops.h.
CUDNN_STATUS_SUCCESS = 0
CUDNN_TENSOR_NCHW = 0
CUDNN_DATA_FLOAT = 0
CUDNN_SOFTMAX_ACCURATE = 1  # subtracts the row maximum first: no overflow for large logits
CUDNN_SOFTMAX_MODE_INSTANCE = 0  # one softmax per n, over c·h·w


class CudnnError(GraphtrainError):
    """A cuDNN call returned an error status."""

    def __init__(self, call: str, status: int):
        self.call = call
        self.code = int(status)
        self.status = status_name(status)
        super().__init__(f"{call} failed: {self.status}")


def status_name(status: int) -> str:
    """cuDNN's own name for a status (cudnnGetErrorString), e.g. "CUDNN_STATUS_BAD_PARAM"."""
    if _loaded is not None:
        try:
            text = _symbol("cudnnGetErrorString")(int(status))
            if text:
                return text.decode(errors="replace")
        except Exception:
            pass
    return f"CUDNN_STATUS_{int(status)}"


def _check(status: int, call: str) -> None:
    if status != CUDNN_STATUS_SUCCESS:
        raise CudnnError(call, status)


# --------------------------------------------------------------------------------------------
# Library


_loaded: LoadedLibrary | None = None
_extra: list[ctypes.CDLL] = []
_symbols: dict[str, Any] = {}
_load_lock = threading.Lock()

_c_int, _c_void_p, _c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "cudnnGetVersion": ([], _c_size_t),
    "cudnnGetErrorString": ([_c_int], ctypes.c_char_p),
    "cudnnCreate": ([ctypes.POINTER(_c_void_p)], _c_int),
    "cudnnDestroy": ([_c_void_p], _c_int),
    "cudnnSetStream": ([_c_void_p, _c_void_p], _c_int),
    "cudnnCreateTensorDescriptor": ([ctypes.POINTER(_c_void_p)], _c_int),
    # desc, format, dataType, n, c, h, w
    "cudnnSetTensor4dDescriptor": ([_c_void_p, _c_int, _c_int, _c_int, _c_int, _c_int, _c_int], _c_int),
    "cudnnDestroyTensorDescriptor": ([_c_void_p], _c_int),
    # handle, algo, mode, alpha, xDesc, x, beta, yDesc, y
    "cudnnSoftmaxForward": ([_c_void_p, _c_int, _c_int, _c_void_p, _c_void_p, _c_void_p, _c_void_p,
                             _c_void_p, _c_void_p], _c_int),
    # handle, algo, mode, alpha, yDesc, y, dyDesc, dy, beta, dxDesc, dx
    "cudnnSoftmaxBackward": ([_c_void_p, _c_int, _c_int, _c_void_p, _c_void_p, _c_void_p, _c_void_p,
                              _c_void_p, _c_void_p, _c_void_p, _c_void_p], _c_int),
}
_SUB_LIBRARIES = ("libcudnn_ops.so.9", "libcudnn_graph.so.9")


def library() -> LoadedLibrary:
    """Open libcudnn once."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _load_lock:
        if _loaded is None:
            _loaded = load_library("cudnn", ("libcudnn.so.9",), ("nvidia/cudnn/lib",), "cuDNN 9 (libcudnn)", INSTALL)
    return _loaded


def _symbol(name: str) -> Any:
    """A cuDNN function with its C signature declared; looked up in the shim, then sub-libraries."""
    fn = _symbols.get(name)
    if fn is not None:
        return fn
    found = library()
    candidates = [found.lib, *_extra]
    fn = None
    for lib in candidates:
        fn = getattr(lib, name, None)
        if fn is not None:
            break
    if fn is None and found.path:
        folder = os.path.dirname(found.path)
        for sub in _SUB_LIBRARIES:
            try:
                lib = ctypes.CDLL(os.path.join(folder, sub))
            except OSError:
                continue
            _extra.append(lib)
            fn = getattr(lib, name, None)
            if fn is not None:
                break
    if fn is None:
        raise GraphtrainError(f"cuDNN at {found.path or 'libcudnn.so.9'} does not export {name}; {INSTALL}")
    argtypes, restype = _SIGNATURES[name]
    fn.argtypes = argtypes
    fn.restype = restype
    _symbols[name] = fn
    return fn


def _format_version(encoded: int) -> str:
    # cuDNN 9: major * 10000 + minor * 100 + patch (91300 -> "9.13.0"); cuDNN 8 used major * 1000.
    if encoded >= 90000:
        return f"{encoded // 10000}.{(encoded % 10000) // 100}.{encoded % 100}"
    return f"{encoded // 1000}.{(encoded % 1000) // 100}.{encoded % 100}"


def library_version() -> str:
    """cuDNN's version ("9.13.0"); needs no GPU."""
    return _format_version(int(_symbol("cudnnGetVersion")()))


# --------------------------------------------------------------------------------------------
# Handle, descriptors, softmax


class TensorDesc:
    """A float32 NCHW tensor descriptor owned by a Cudnn handle."""

    def __init__(self, handle: ctypes.c_void_p, n: int, c: int, h: int, w: int):
        self._handle: ctypes.c_void_p | None = handle
        self.shape = (n, c, h, w)

    @property
    def handle(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise UsageError("this cuDNN tensor descriptor was destroyed")
        return self._handle

    def _destroy(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _check(_symbol("cudnnDestroyTensorDescriptor")(handle), "cudnnDestroyTensorDescriptor")

    def __repr__(self) -> str:
        return f"TensorDesc(nchw={self.shape})"


class Cudnn:
    """A cuDNN handle bound to one stream."""

    def __init__(self, stream: cuda.Stream):
        library()
        handle = ctypes.c_void_p()
        _check(_symbol("cudnnCreate")(ctypes.byref(handle)), "cudnnCreate")
        self._handle: ctypes.c_void_p | None = handle
        self._descs: list[TensorDesc] = []
        self.stream = stream
        try:
            _check(_symbol("cudnnSetStream")(handle, cuda._stream_handle(stream)), "cudnnSetStream")
        except BaseException:
            self.close()
            raise
        self._one = ctypes.c_float(1.0)
        self._zero = ctypes.c_float(0.0)
        self._one_ref = ctypes.byref(self._one)
        self._zero_ref = ctypes.byref(self._zero)
        self._forward = _symbol("cudnnSoftmaxForward")
        self._backward = _symbol("cudnnSoftmaxBackward")

    def _require(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise UsageError("this cuDNN handle was closed")
        return self._handle

    @property
    def version(self) -> str:
        """cuDNN's version, e.g. "9.13.0"."""
        return library_version()

    def tensor_4d(self, n: int, c: int, h: int = 1, w: int = 1) -> TensorDesc:
        """A float32 NCHW descriptor, destroyed by `close`. For row-wise softmax over a
        rows×classes matrix use tensor_4d(rows, classes, 1, 1)."""
        dims = (n, c, h, w)
        if not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 2**31 - 1 for d in dims):
            raise UsageError(f"cuDNN tensor dimensions must be positive ints, not {dims}")
        self._require()
        raw = ctypes.c_void_p()
        _check(_symbol("cudnnCreateTensorDescriptor")(ctypes.byref(raw)), "cudnnCreateTensorDescriptor")
        desc = TensorDesc(raw, n, c, h, w)
        try:
            _check(_symbol("cudnnSetTensor4dDescriptor")(raw, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c, h, w),
                   "cudnnSetTensor4dDescriptor")
        except BaseException:
            desc._destroy()
            raise
        self._descs.append(desc)
        return desc

    def softmax_forward(self, desc: TensorDesc, x_ptr: int, y_ptr: int) -> None:
        """y = softmax(x) over each instance (c·h·w values), accurate algorithm; queued."""
        status = self._forward(self._require(), CUDNN_SOFTMAX_ACCURATE, CUDNN_SOFTMAX_MODE_INSTANCE,
                               self._one_ref, desc.handle, x_ptr, self._zero_ref, desc.handle, y_ptr)
        if status:
            raise CudnnError("cudnnSoftmaxForward", status)

    def softmax_backward(self, desc: TensorDesc, y_ptr: int, dy_ptr: int, dx_ptr: int) -> None:
        """dx = y ⊙ (dy − Σ y·dy) per instance, from the forward output y; queued."""
        status = self._backward(self._require(), CUDNN_SOFTMAX_ACCURATE, CUDNN_SOFTMAX_MODE_INSTANCE,
                                self._one_ref, desc.handle, y_ptr, desc.handle, dy_ptr,
                                self._zero_ref, desc.handle, dx_ptr)
        if status:
            raise CudnnError("cudnnSoftmaxBackward", status)

    def close(self) -> None:
        """Destroy every descriptor made here, then the handle (idempotent)."""
        descs, self._descs = self._descs, []
        for desc in descs:
            desc._destroy()
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _check(_symbol("cudnnDestroy")(handle), "cudnnDestroy")

    def __enter__(self) -> Cudnn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
