"""cuBLAS through ctypes: row-major GEMM and the three products of a linear layer.

cuBLAS is column-major; graphtrain keeps every matrix row-major (like numpy and torch). A row-major
matrix read as column-major is its transpose, so a row-major C = op(A)·op(B) is computed as the
column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands, swap m and n, keep the leading dimensions.

Shapes are checked here, before the call, so cuBLAS never sees bad dimensions: a bad call would
otherwise fail asynchronously or, worse, read out of bounds.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from graphtrain.errors import GraphtrainError, UsageError
from graphtrain.libs import cuda
from graphtrain.libs._dl import LoadedLibrary, load_library

INSTALL = ("pip install 'graphtrain[cu12]' or 'graphtrain[cu13]' installs it "
           "(nvidia-cublas-cu12 or nvidia-cublas).")

# cublasStatus_t (cublas_api.h)
STATUS_NAMES = {
    0: "CUBLAS_STATUS_SUCCESS",
    1: "CUBLAS_STATUS_NOT_INITIALIZED",
    3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE",
    8: "CUBLAS_STATUS_ARCH_MISMATCH",
    11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED",
    14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}

# Enum values from cublas_api.h and library_types.h.
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_POINTER_MODE_HOST = 0
CUBLAS_DEFAULT_MATH = 0
CUBLAS_TF32_TENSOR_OP_MATH = 3
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_GEMM_DEFAULT = -1
# libraryPropertyType (library_types.h)
MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL = 0, 1, 2

WORKSPACE_ALIGNMENT = 256
_INT_MAX = 2**31 - 1  # cublasGemmEx takes int dimensions

# precision -> (compute type, math mode). "fp32" is true single precision: the default math mode
# never lets cuBLAS round inputs to TF32, so results match a float64 reference to ~1e-6.
PRECISIONS = {
    "fp32": (CUBLAS_COMPUTE_32F, CUBLAS_DEFAULT_MATH),
    "tf32": (CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_TF32_TENSOR_OP_MATH),
}


def status_name(status: int) -> str:
    """The cublasStatus_t name of a status code (e.g. 7 -> "CUBLAS_STATUS_INVALID_VALUE")."""
    name = STATUS_NAMES.get(int(status))
    if name is not None:
        return name
    lib = _library_if_loaded()
    if lib is not None and hasattr(lib.lib, "cublasGetStatusName"):
        try:
            text = lib.lib.cublasGetStatusName(int(status))
            if text:
                return text.decode(errors="replace")
        except Exception:
            pass
    return f"CUBLAS_STATUS_{int(status)}"


class CublasError(GraphtrainError):
    """A cuBLAS call returned an error status."""

    def __init__(self, call: str, status: int):
        self.call = call
        self.code = int(status)
        self.status = status_name(status)
        super().__init__(f"{call} failed: {self.status}")


class GemmShapeError(UsageError, ValueError):
    """A GEMM was asked with dimensions or leading dimensions that do not fit its matrices."""


def _check(status: int, call: str) -> None:
    if status:
        raise CublasError(call, status)


# --------------------------------------------------------------------------------------------
# Library


_loaded: LoadedLibrary | None = None
_load_lock = threading.Lock()


def _library_if_loaded() -> LoadedLibrary | None:
    return _loaded


def library() -> LoadedLibrary:
    """Open libcublas once and declare the C signatures we use."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _load_lock:
        if _loaded is not None:
            return _loaded
        found = load_library(
            "cublas",
            ("libcublas.so.13", "libcublas.so.12"),
            ("nvidia/cu13/lib", "nvidia/cublas/lib"),
            "cuBLAS (libcublas)",
            INSTALL,
        )
        lib = found.lib
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        p_int, p_handle = ctypes.POINTER(c_int), ctypes.POINTER(c_void_p)
        signatures = {
            "cublasCreate_v2": [p_handle],
            "cublasDestroy_v2": [c_void_p],
            "cublasSetStream_v2": [c_void_p, c_void_p],
            "cublasSetWorkspace_v2": [c_void_p, c_void_p, c_size_t],
            "cublasSetPointerMode_v2": [c_void_p, c_int],
            "cublasSetMathMode": [c_void_p, c_int],
            "cublasGetVersion_v2": [c_void_p, p_int],
            "cublasGetProperty": [c_int, p_int],
            # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
            # ldc, computeType, algo
            "cublasGemmEx": [c_void_p, c_int, c_int, c_int, c_int, c_int, c_void_p, c_void_p, c_int, c_int,
                             c_void_p, c_int, c_int, c_void_p, c_void_p, c_int, c_int, c_int, c_int],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = c_int
        if hasattr(lib, "cublasGetStatusName"):  # cuBLAS >= 11.4
            lib.cublasGetStatusName.argtypes = [c_int]
            lib.cublasGetStatusName.restype = ctypes.c_char_p
        _loaded = found
        return found


def library_version() -> str:
    """cuBLAS's version ("13.1.0") without a handle or a GPU."""
    lib = library().lib
    parts = []
    for prop in (MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL):
        value = ctypes.c_int()
        _check(lib.cublasGetProperty(prop, ctypes.byref(value)), "cublasGetProperty")
        parts.append(str(value.value))
    return ".".join(parts)


def _format_version(encoded: int) -> str:
    # CUBLAS_VERSION = major * 10000 + minor * 100 + patch (130100 -> "13.1.0")
    return f"{encoded // 10000}.{(encoded % 10000) // 100}.{encoded % 100}"


# --------------------------------------------------------------------------------------------
# Handle and GEMM


def _dim(value: Any, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise GemmShapeError(f"gemm: {what} must be an integer, not {value!r}")
    value = int(value)
    if not 1 <= value <= _INT_MAX:
        raise GemmShapeError(f"gemm: {what} must be between 1 and {_INT_MAX}, not {value}")
    return value


def _ptr(value: Any, what: str) -> int:
    value = getattr(value, "ptr", value)  # a memory.Buffer is fine too
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) <= 0:
        raise GemmShapeError(f"gemm: {what} must be a device address (a positive int), not {value!r}")
    return int(value)


class Cublas:
    """A cuBLAS handle bound to one stream and one workspace (needed for CUDA Graph capture:
    without a workspace of its own cuBLAS would allocate while capturing)."""

    def __init__(self, stream: cuda.Stream, workspace_ptr: int, workspace_bytes: int, precision: str = "fp32"):
        if precision not in PRECISIONS:
            raise UsageError(f"cuBLAS precision must be one of {sorted(PRECISIONS)}, not {precision!r}")
        if workspace_bytes < 0:
            raise ValueError(f"cuBLAS workspace size must be non-negative, not {workspace_bytes}")
        if workspace_bytes and (not workspace_ptr or int(workspace_ptr) % WORKSPACE_ALIGNMENT):
            raise ValueError(f"cuBLAS workspace must be a {WORKSPACE_ALIGNMENT}-byte aligned device address, "
                             f"not {workspace_ptr!r}")
        self._lib = library().lib
        self.precision = precision
        self._compute_type, math_mode = PRECISIONS[precision]
        self.stream = stream
        handle = ctypes.c_void_p()
        _check(self._lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate_v2")
        self._handle: ctypes.c_void_p | None = handle
        try:
            _check(self._lib.cublasSetStream_v2(handle, cuda._stream_handle(stream)), "cublasSetStream_v2")
            # After the stream: cublasSetStream resets the workspace to cuBLAS's default pool.
            if workspace_bytes:
                _check(self._lib.cublasSetWorkspace_v2(handle, int(workspace_ptr), int(workspace_bytes)),
                       "cublasSetWorkspace_v2")
            _check(self._lib.cublasSetPointerMode_v2(handle, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode_v2")
            _check(self._lib.cublasSetMathMode(handle, math_mode), "cublasSetMathMode")
        except BaseException:
            self.close()
            raise
        # alpha and beta are read from host memory during the call (pointer mode host).
        self._alpha = ctypes.c_float()
        self._beta = ctypes.c_float()
        self._alpha_ref = ctypes.byref(self._alpha)
        self._beta_ref = ctypes.byref(self._beta)

    def _require(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise UsageError("this cuBLAS handle was closed")
        return self._handle

    @property
    def version(self) -> str:
        """cuBLAS's version, e.g. "13.1.0"."""
        value = ctypes.c_int()
        _check(self._lib.cublasGetVersion_v2(self._require(), ctypes.byref(value)), "cublasGetVersion_v2")
        return _format_version(value.value)

    def gemm(self, transa: bool, transb: bool, m: int, n: int, k: int, alpha: float,
             a_ptr: int, lda: int, b_ptr: int, ldb: int, beta: float, c_ptr: int, ldc: int) -> None:
        """Row-major C (m×n, leading dim ldc) = alpha·op(A)·op(B) + beta·C, queued on the stream.

        A is m×k (k×m if transa), B is k×n (n×k if transb), all row-major with the given leading
        dimensions (the row strides, in elements).
        """
        m, n, k = _dim(m, "m"), _dim(n, "n"), _dim(k, "k")
        lda, ldb, ldc = _dim(lda, "lda"), _dim(ldb, "ldb"), _dim(ldc, "ldc")
        a_cols = m if transa else k
        b_cols = k if transb else n
        if lda < a_cols:
            raise GemmShapeError(f"gemm: lda={lda} is smaller than A's row length {a_cols} "
                                 f"(A is {'k×m' if transa else 'm×k'} = "
                                 f"{(k, m) if transa else (m, k)}, row-major)")
        if ldb < b_cols:
            raise GemmShapeError(f"gemm: ldb={ldb} is smaller than B's row length {b_cols} "
                                 f"(B is {'n×k' if transb else 'k×n'} = "
                                 f"{(n, k) if transb else (k, n)}, row-major)")
        if ldc < n:
            raise GemmShapeError(f"gemm: ldc={ldc} is smaller than C's row length n={n} (C is m×n = {(m, n)})")
        a, b, c = _ptr(a_ptr, "A"), _ptr(b_ptr, "B"), _ptr(c_ptr, "C")
        self._alpha.value = alpha
        self._beta.value = beta
        # Column-major Cᵀ (n×m) = op(B)ᵀ (n×k) · op(A)ᵀ (k×m): B first, then A.
        status = self._lib.cublasGemmEx(
            self._require(),
            CUBLAS_OP_T if transb else CUBLAS_OP_N,
            CUBLAS_OP_T if transa else CUBLAS_OP_N,
            n, m, k,
            self._alpha_ref,
            b, CUDA_R_32F, ldb,
            a, CUDA_R_32F, lda,
            self._beta_ref,
            c, CUDA_R_32F, ldc,
            self._compute_type, CUBLAS_GEMM_DEFAULT,
        )
        if status:
            raise CublasError("cublasGemmEx", status)

    # A linear layer keeps its weight W as out_features × in_features, row-major (torch's layout).

    def linear_forward(self, x: int, w: int, y: int, rows: int, in_features: int, out_features: int) -> None:
        """y (rows×out) = x (rows×in) · Wᵀ."""
        self.gemm(False, True, rows, out_features, in_features, 1.0, x, in_features, w, in_features,
                  0.0, y, out_features)

    def linear_grad_weight(self, dy: int, x: int, dw: int, rows: int, in_features: int, out_features: int) -> None:
        """dW (out×in) = dyᵀ (out×rows) · x (rows×in)."""
        self.gemm(True, False, out_features, in_features, rows, 1.0, dy, out_features, x, in_features,
                  0.0, dw, in_features)

    def linear_grad_input(self, dy: int, w: int, dx: int, rows: int, in_features: int, out_features: int) -> None:
        """dx (rows×in) = dy (rows×out) · W (out×in)."""
        self.gemm(False, False, rows, in_features, out_features, 1.0, dy, out_features, w, in_features,
                  0.0, dx, in_features)

    def close(self) -> None:
        """Destroy the handle (idempotent)."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _check(self._lib.cublasDestroy_v2(handle), "cublasDestroy_v2")

    def __enter__(self) -> Cublas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
