"""cuDNN through ctypes: a row-wise softmax and its backward pass.

cuDNN 9 is split into sub-libraries; the legacy functions used here (tensor descriptors, softmax)
live in libcudnn_ops and are exported through the libcudnn.so.9 shim, which loads the
sub-library on first use. Descriptors are created at setup and destroyed by `close`, so the
training step only launches.
"""

from __future__ import annotations

import ctypes

from graphtrain.libs import cuda
from graphtrain.libs.shared_lib import SharedLibrary

# Enum values from cudnn_graph.h / cudnn_ops.h.
CUDNN_TENSOR_NCHW = 0
CUDNN_DATA_FLOAT = 0
CUDNN_SOFTMAX_ACCURATE = 1  # subtracts the row maximum first: no overflow for large logits
CUDNN_SOFTMAX_MODE_INSTANCE = 0  # one softmax per n, over c·h·w

_int, _ptr = ctypes.c_int, ctypes.c_void_p
library = SharedLibrary("cudnn", "cuDNN 9 (libcudnn)", {
    "cudnnGetVersion": ([], ctypes.c_size_t),
    "cudnnGetErrorString": ([_int], ctypes.c_char_p),
    "cudnnCreate": ([ctypes.POINTER(_ptr)], _int),
    "cudnnDestroy": ([_ptr], _int),
    "cudnnSetStream": ([_ptr, _ptr], _int),
    "cudnnCreateTensorDescriptor": ([ctypes.POINTER(_ptr)], _int),
    # desc, format, dataType, n, c, h, w
    "cudnnSetTensor4dDescriptor": ([_ptr, _int, _int, _int, _int, _int, _int], _int),
    "cudnnDestroyTensorDescriptor": ([_ptr], _int),
    # handle, algo, mode, alpha, xDesc, x, beta, yDesc, y
    "cudnnSoftmaxForward": ([_ptr, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr], _int),
    # handle, algo, mode, alpha, yDesc, y, dyDesc, dy, beta, dxDesc, dx
    "cudnnSoftmaxBackward": ([_ptr, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr], _int),
}, status_name="cudnnGetErrorString")


def version() -> str:
    """cuDNN's version ("9.13.0"), without a GPU: cudnnGetVersion is major·10000 + minor·100 + patch."""
    encoded = int(library.load().cudnnGetVersion())
    return f"{encoded // 10000}.{(encoded % 10000) // 100}.{encoded % 100}"


class Cudnn:
    """A cuDNN handle bound to one stream."""

    def __init__(self, stream: cuda.Stream):
        self._lib = lib = library.load()
        handle = ctypes.c_void_p()
        library.check(lib.cudnnCreate(ctypes.byref(handle)), "cudnnCreate")
        self._handle: ctypes.c_void_p | None = handle
        self._descs: list[ctypes.c_void_p] = []  # tensor descriptors, destroyed by close()
        self.stream = stream
        try:
            library.check(lib.cudnnSetStream(handle, int(stream.handle)), "cudnnSetStream")
        except BaseException:
            self.close()
            raise
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._one_ref, self._zero_ref = ctypes.byref(self._one), ctypes.byref(self._zero)

    def _require(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise cuda.ClosedError("this cuDNN handle was closed")
        return self._handle

    def tensor_4d(self, n: int, c: int, h: int = 1, w: int = 1) -> ctypes.c_void_p:
        """A float32 NCHW tensor descriptor, destroyed by `close`. For row-wise softmax over a
        rows×classes matrix use tensor_4d(rows, classes, 1, 1)."""
        self._require()
        desc = ctypes.c_void_p()
        library.check(self._lib.cudnnCreateTensorDescriptor(ctypes.byref(desc)), "cudnnCreateTensorDescriptor")
        self._descs.append(desc)  # destroyed by close(), also when setting it fails below
        library.check(self._lib.cudnnSetTensor4dDescriptor(desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, c, h, w),
                      "cudnnSetTensor4dDescriptor")
        return desc

    def softmax_forward(self, desc: ctypes.c_void_p, x_ptr: int, y_ptr: int) -> None:
        """y = softmax(x) over each instance (c·h·w values), accurate algorithm; queued."""
        status = self._lib.cudnnSoftmaxForward(self._require(), CUDNN_SOFTMAX_ACCURATE, CUDNN_SOFTMAX_MODE_INSTANCE,
                                               self._one_ref, desc, x_ptr, self._zero_ref, desc, y_ptr)
        if status:
            library.check(status, "cudnnSoftmaxForward")

    def softmax_backward(self, desc: ctypes.c_void_p, y_ptr: int, dy_ptr: int, dx_ptr: int) -> None:
        """dx = y ⊙ (dy − Σ y·dy) per instance, from the forward output y; queued."""
        status = self._lib.cudnnSoftmaxBackward(self._require(), CUDNN_SOFTMAX_ACCURATE, CUDNN_SOFTMAX_MODE_INSTANCE,
                                                self._one_ref, desc, y_ptr, desc, dy_ptr, self._zero_ref, desc, dx_ptr)
        if status:
            library.check(status, "cudnnSoftmaxBackward")

    def close(self) -> None:
        """Destroy every descriptor made here, then the handle (idempotent)."""
        descs, self._descs = self._descs, []
        for desc in descs:
            library.check(self._lib.cudnnDestroyTensorDescriptor(desc), "cudnnDestroyTensorDescriptor")
        if self._handle is not None:
            handle, self._handle = self._handle, None
            library.check(self._lib.cudnnDestroy(handle), "cudnnDestroy")
