"""cuBLAS through ctypes: a row-major GEMM on one stream with its own workspace.

cuBLAS is column-major; graphtrain keeps every matrix row-major (like numpy and torch). A row-major
matrix read as column-major is its transpose, so a row-major C = op(A)·op(B) is computed as the
column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands, swap m and n, keep the leading dimensions.
"""

from __future__ import annotations

import ctypes

from graphtrain.libs import cuda
from graphtrain.libs.shared_lib import SharedLibrary

# Enum values from cublas_api.h and library_types.h.
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0
CUBLAS_DEFAULT_MATH, CUBLAS_TF32_TENSOR_OP_MATH = 0, 3
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
CUBLAS_GEMM_DEFAULT = -1
MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL = 0, 1, 2  # libraryPropertyType

WORKSPACE_ALIGNMENT = 256
_INT_MAX = 2**31 - 1  # cublasGemmEx takes int dimensions

# precision -> (compute type, math mode). "fp32" is true single precision: the default math mode
# never lets cuBLAS round inputs to TF32, so results match a float64 reference to ~1e-6.
PRECISIONS = {
    "fp32": (CUBLAS_COMPUTE_32F, CUBLAS_DEFAULT_MATH),
    "tf32": (CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_TF32_TENSOR_OP_MATH),
}

_int, _ptr, _size = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
_i64 = ctypes.c_longlong  # the strided batched products' strides
library = SharedLibrary("cublas", "cuBLAS (libcublas)", {
    "cublasGetStatusName": ([_int], ctypes.c_char_p),
    "cublasGetProperty": ([_int, ctypes.POINTER(_int)], _int),
    "cublasCreate_v2": ([ctypes.POINTER(_ptr)], _int),
    "cublasDestroy_v2": ([_ptr], _int),
    "cublasSetStream_v2": ([_ptr, _ptr], _int),
    "cublasSetWorkspace_v2": ([_ptr, _ptr, _size], _int),
    "cublasSetPointerMode_v2": ([_ptr, _int], _int),
    "cublasSetMathMode": ([_ptr, _int], _int),
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
    # computeType, algo
    "cublasGemmEx": ([_ptr, _int, _int, _int, _int, _int, _ptr, _ptr, _int, _int, _ptr, _int, _int, _ptr, _ptr,
                      _int, _int, _int, _int], _int),
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C,
    # Ctype, ldc, strideC, batchCount, computeType, algo
    "cublasGemmStridedBatchedEx": ([_ptr, _int, _int, _int, _int, _int, _ptr, _ptr, _int, _int, _i64, _ptr, _int,
                                    _int, _i64, _ptr, _ptr, _int, _int, _i64, _int, _int, _int], _int),
}, status_name="cublasGetStatusName")


class GemmShapeError(ValueError):
    """A GEMM was asked with dimensions that do not fit its matrices: a bug in the caller."""


def version() -> str:
    """cuBLAS's version ("13.1.0"), without a handle or a GPU."""
    lib, value, parts = library.load(), ctypes.c_int(), []
    for prop in (MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL):
        library.check(lib.cublasGetProperty(prop, ctypes.byref(value)), "cublasGetProperty")
        parts.append(str(value.value))
    return ".".join(parts)


def check_gemm_shape(transa: bool, transb: bool, m: int, n: int, k: int, lda: int, ldb: int, ldc: int) -> None:
    """GemmShapeError unless row-major A (m×k, or k×m if transa), B (k×n, or n×k if transb) and
    C (m×n) fit their leading dimensions (row strides, in elements) and cuBLAS's int range."""
    a_cols, b_cols = (m if transa else k), (k if transb else n)
    if 0 < m <= _INT_MAX and 0 < n <= _INT_MAX and 0 < k <= _INT_MAX and a_cols <= lda <= _INT_MAX \
            and b_cols <= ldb <= _INT_MAX and n <= ldc <= _INT_MAX:
        return
    raise GemmShapeError(f"gemm(transa={transa}, transb={transb}, m={m}, n={n}, k={k}, lda={lda}, ldb={ldb}, "
                         f"ldc={ldc}): every dimension must be in 1..{_INT_MAX}, and the leading dimensions at least "
                         f"the row lengths of A ({a_cols}), B ({b_cols}) and C ({n})")


def check_gemm_batch(m: int, ldc: int, batch: int, stride_a: int, stride_b: int, stride_c: int) -> None:
    """GemmShapeError unless `batch` products (1..INT_MAX) have strides (in elements) that cuBLAS
    takes and outputs that do not overlap: stride_a, stride_b ≥ 0 (0: every product reads the
    same matrix), stride_c at least C's m rows of ldc (any stride for one product)."""
    if 0 < batch <= _INT_MAX and stride_a >= 0 and stride_b >= 0 and (batch == 1 or stride_c >= m * ldc):
        return
    raise GemmShapeError(f"gemm_strided_batched(m={m}, ldc={ldc}, batch={batch}, stride_a={stride_a}, "
                         f"stride_b={stride_b}, stride_c={stride_c}): the batch must be in 1..{_INT_MAX}, the input "
                         f"strides non-negative, and C's stride at least its m·ldc = {m * ldc} elements")


class Cublas:
    """A cuBLAS handle bound to one stream and one workspace (needed for CUDA Graph capture:
    without a workspace of its own cuBLAS would allocate while capturing)."""

    def __init__(self, stream: cuda.Stream, workspace_ptr: int, workspace_bytes: int, precision: str = "fp32"):
        if precision not in PRECISIONS:
            raise ValueError(f"cuBLAS precision must be one of {sorted(PRECISIONS)}, not {precision!r}")
        if workspace_bytes and int(workspace_ptr) % WORKSPACE_ALIGNMENT:
            raise ValueError(f"the cuBLAS workspace must be {WORKSPACE_ALIGNMENT}-byte aligned, not {workspace_ptr:#x}")
        self._lib = lib = library.load()
        self.precision, self.stream = precision, stream
        self._compute_type, math_mode = PRECISIONS[precision]
        handle = ctypes.c_void_p()
        library.check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate_v2")
        self._handle: ctypes.c_void_p | None = handle
        try:
            library.check(lib.cublasSetStream_v2(handle, int(stream.handle)), "cublasSetStream_v2")
            # After the stream: cublasSetStream resets the workspace to cuBLAS's default pool.
            if workspace_bytes:
                library.check(lib.cublasSetWorkspace_v2(handle, int(workspace_ptr), int(workspace_bytes)),
                              "cublasSetWorkspace_v2")
            library.check(lib.cublasSetPointerMode_v2(handle, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode_v2")
            library.check(lib.cublasSetMathMode(handle, math_mode), "cublasSetMathMode")
        except BaseException:
            self.close()
            raise
        # alpha and beta are read from host memory during the call (pointer mode host).
        self._alpha, self._beta = ctypes.c_float(), ctypes.c_float()
        self._alpha_ref, self._beta_ref = ctypes.byref(self._alpha), ctypes.byref(self._beta)

    def gemm(self, transa: bool, transb: bool, m: int, n: int, k: int, alpha: float,
             a_ptr: int, lda: int, b_ptr: int, ldb: int, beta: float, c_ptr: int, ldc: int) -> None:
        """Row-major C (m×n, leading dim ldc) = alpha·op(A)·op(B) + beta·C, queued on the stream.

        A is m×k (k×m if transa), B is k×n (n×k if transb), all row-major with the given leading
        dimensions. The shape is checked first (cheap), so cuBLAS never sees one that cannot fit.
        """
        check_gemm_shape(transa, transb, m, n, k, lda, ldb, ldc)
        if self._handle is None:
            raise cuda.ClosedError("this cuBLAS handle was closed")
        self._alpha.value, self._beta.value = alpha, beta
        # Column-major Cᵀ (n×m) = op(B)ᵀ (n×k) · op(A)ᵀ (k×m): B first, then A.
        status = self._lib.cublasGemmEx(
            self._handle, CUBLAS_OP_T if transb else CUBLAS_OP_N, CUBLAS_OP_T if transa else CUBLAS_OP_N,
            n, m, k, self._alpha_ref, b_ptr, CUDA_R_32F, ldb, a_ptr, CUDA_R_32F, lda,
            self._beta_ref, c_ptr, CUDA_R_32F, ldc, self._compute_type, CUBLAS_GEMM_DEFAULT)
        if status:
            library.check(status, "cublasGemmEx")

    def gemm_strided_batched(self, transa: bool, transb: bool, m: int, n: int, k: int, alpha: float,
                             a_ptr: int, lda: int, stride_a: int, b_ptr: int, ldb: int, stride_b: int, beta: float,
                             c_ptr: int, ldc: int, stride_c: int, batch: int) -> None:
        """`gemm` for `batch` products in one call: product i reads A at a_ptr + i·stride_a and B at
        b_ptr + i·stride_b and writes C at c_ptr + i·stride_c, strides in elements (a stride of 0:
        every product reads the same matrix). Row-major, the same compute type and math mode as
        `gemm`; the shape and the strides are checked first."""
        check_gemm_shape(transa, transb, m, n, k, lda, ldb, ldc)
        check_gemm_batch(m, ldc, batch, stride_a, stride_b, stride_c)
        if self._handle is None:
            raise cuda.ClosedError("this cuBLAS handle was closed")
        self._alpha.value, self._beta.value = alpha, beta
        # Column-major Cᵀ = op(B)ᵀ · op(A)ᵀ per product, as `gemm`: B first, then A, each with its stride.
        status = self._lib.cublasGemmStridedBatchedEx(
            self._handle, CUBLAS_OP_T if transb else CUBLAS_OP_N, CUBLAS_OP_T if transa else CUBLAS_OP_N,
            n, m, k, self._alpha_ref, b_ptr, CUDA_R_32F, ldb, stride_b, a_ptr, CUDA_R_32F, lda, stride_a,
            self._beta_ref, c_ptr, CUDA_R_32F, ldc, stride_c, batch, self._compute_type, CUBLAS_GEMM_DEFAULT)
        if status:
            library.check(status, "cublasGemmStridedBatchedEx")

    def close(self) -> None:
        """Destroy the handle (idempotent)."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            library.check(self._lib.cublasDestroy_v2(handle), "cublasDestroy_v2")

    def __enter__(self) -> Cublas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


FIRST_USE_SIZE = 64  # first_use's product: 64×64 by 64×64, small enough to cost nothing to run
FIRST_USE_WORKSPACE = 1 << 20


def first_use() -> None:
    """cuBLAS's once-a-process start, on a handle, stream and memory of its own, all released
    after: the first handle of the process (cuBLAS's and cuBLASLt's own set-up on this GPU) and
    one product (the heuristics' first query, its kernel's load). What a run's first products
    pay otherwise; run on the command's start-up thread (graphtrain.__main__), where every call
    releases the Python lock, it goes on beside the caller's imports and data loading."""
    n = FIRST_USE_SIZE
    matrix = n * n * 4
    stream = cuda.Stream()
    try:
        with cuda.scratch(FIRST_USE_WORKSPACE + 3 * matrix) as workspace:
            a, b, c = (workspace + FIRST_USE_WORKSPACE + i * matrix for i in range(3))
            cuda.memset(a, 0, 2 * matrix, stream)  # zeros in, whatever the memory held
            blas = Cublas(stream, workspace, FIRST_USE_WORKSPACE)
            try:
                blas.gemm(False, True, n, n, n, 1.0, a, n, b, n, 0.0, c, n)
                cuda.wait_uncounted(stream)
            finally:
                blas.close()
    finally:
        stream.close()
