"""cuBLASLt through ctypes: matrix products with fused epilogues, planned once, queued per step.

graphtrain keeps matrices row-major; cuBLASLt is column-major. A row-major C (m×n) = op(A)·op(B)
is planned as the column-major Cᵀ (n×m) = op(B)ᵀ·op(A)ᵀ: B and A swap places, and so do m and n.
Read in row-major terms, the epilogues a `LtMatmul` offers are

    bias        C += b, b of length n (one per column: y = x·Wᵀ + b)
    relu        C = max(C, 0)
    relu_bias   C = max(C + b, 0)

(cuBLASLt's backward epilogues, DRELU and BGRAD, ran as kernels of their own after the product
for graphtrain's shapes on an H100: one node more each, so the fused rungs do that work in their
own kernels instead.)

A `LtMatmul` holds its descriptors, layouts and the heuristic's first algorithm without split-K
(one block owns each output: a single kernel, the same bits every run), all chosen at setup; a
call passes pointers and the two scalars to cublasLtMatmul and nothing else.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from graphtrain.libs.shared_lib import SharedLibrary

# cudaDataType_t and cublasComputeType_t (library_types.h, cublas_api.h)
R_32F, R_16BF = 0, 14
COMPUTE_32F = 68
# cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t (cublasLt.h)
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER, DESC_BIAS_DATA_TYPE = 3, 4, 7, 8, 26
PREF_MAX_WORKSPACE_BYTES, PREF_REDUCTION_SCHEME_MASK = 1, 3
OP_N, OP_T = 0, 1
# cublasLtEpilogue_t, by the row-major names above
EPILOGUES = {"none": 1, "relu": 2, "bias": 4, "relu_bias": 6}
BIAS_EPILOGUES = {"bias", "relu_bias"}
HEURISTIC_RESULTS = 8

_int, _ptr, _size, _u64, _i64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int64


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_out = ctypes.POINTER(_ptr)
library = SharedLibrary("cublasLt", "cuBLASLt (libcublasLt)", {
    "cublasLtGetStatusName": ([_int], ctypes.c_char_p),
    "cublasLtGetVersion": ([], _size),
    "cublasLtCreate": ([_out], _int),
    "cublasLtDestroy": ([_ptr], _int),
    "cublasLtMatmulDescCreate": ([_out, _int, _int], _int),
    "cublasLtMatmulDescDestroy": ([_ptr], _int),
    "cublasLtMatmulDescSetAttribute": ([_ptr, _int, _ptr, _size], _int),
    "cublasLtMatrixLayoutCreate": ([_out, _int, _u64, _u64, _i64], _int),
    "cublasLtMatrixLayoutDestroy": ([_ptr], _int),
    "cublasLtMatmulPreferenceCreate": ([_out], _int),
    "cublasLtMatmulPreferenceDestroy": ([_ptr], _int),
    "cublasLtMatmulPreferenceSetAttribute": ([_ptr, _int, _ptr, _size], _int),
    "cublasLtMatmulAlgoGetHeuristic": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int,
                                        ctypes.POINTER(HeuristicResult), ctypes.POINTER(_int)], _int),
    "cublasLtMatmul": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr,
                        ctypes.POINTER(Algo), _ptr, _size, _ptr], _int),
}, status_name="cublasLtGetStatusName")


def version() -> str:
    """cuBLASLt's version, e.g. "13.1.0" (CUBLASLT_VERSION = major·10000 + minor·100 + patch)."""
    v = library.load().cublasLtGetVersion()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


@dataclass(frozen=True)
class Product:
    """Row-major C (m×n) = op(A)·op(B), op(A) m×k and op(B) k×n; A and B of `ab_type`, C of
    `c_type`, fp32 accumulation; and its epilogue (`bias_type`: the type of the bias it adds)."""

    m: int
    n: int
    k: int
    transa: bool = False
    transb: bool = False
    ab_type: int = R_32F
    c_type: int = R_32F
    epilogue: str = "none"
    bias_type: int = R_32F

    def layouts(self) -> tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]]:
        """(type, rows, cols) of the column-major B', A' and D' that cuBLASLt sees: each row-major
        matrix as stored, read column-major (rows and columns swap)."""
        a_rows, a_cols = (self.k, self.m) if self.transa else (self.m, self.k)
        b_rows, b_cols = (self.n, self.k) if self.transb else (self.k, self.n)
        return (self.ab_type, b_cols, b_rows), (self.ab_type, a_cols, a_rows), (self.c_type, self.n, self.m)

    def attributes(self, bias: int) -> list[tuple[int, ctypes._SimpleCData]]:
        """The matmul descriptor's attributes, in the column-major view (B' first: transposes swap)."""
        attrs = [(DESC_TRANSA, ctypes.c_int32(OP_T if self.transb else OP_N)),
                 (DESC_TRANSB, ctypes.c_int32(OP_T if self.transa else OP_N)),
                 (DESC_EPILOGUE, ctypes.c_int32(EPILOGUES[self.epilogue]))]
        if self.epilogue in BIAS_EPILOGUES:
            attrs += [(DESC_BIAS_POINTER, ctypes.c_void_p(bias)), (DESC_BIAS_DATA_TYPE, ctypes.c_int32(self.bias_type))]
        return attrs


class Lt:
    """A cuBLASLt handle and the workspace every LtMatmul of a run shares (from the arena)."""

    def __init__(self, workspace: int, workspace_bytes: int):
        self.lib = library.load()
        self.workspace, self.workspace_bytes = workspace, workspace_bytes
        handle = ctypes.c_void_p()
        library.check(self.lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        self.handle = handle

    def close(self) -> None:
        if self.handle:
            handle, self.handle = self.handle, ctypes.c_void_p()
            library.check(self.lib.cublasLtDestroy(handle), "cublasLtDestroy")


class LtMatmul:
    """One planned product: `matmul(a, b, c, alpha, beta, stream)` queues C = alpha·op(A)·op(B) +
    beta·C with the epilogue. The bias belongs to the layer and is bound here."""

    def __init__(self, lt: Lt, product: Product, bias: int = 0):
        lib, check = lt.lib, library.check
        self.lt, self.product = lt, product
        self._owned: list[tuple[str, ctypes.c_void_p]] = []
        self.desc = self._create("cublasLtMatmulDescCreate", "cublasLtMatmulDescDestroy", COMPUTE_32F, R_32F)
        for attr, value in product.attributes(bias):
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                  f"cublasLtMatmulDescSetAttribute({attr})")
        self.layout_b, self.layout_a, self.layout_c = (
            self._create("cublasLtMatrixLayoutCreate", "cublasLtMatrixLayoutDestroy", dtype, rows, cols, rows)
            for dtype, rows, cols in product.layouts())
        pref = self._create("cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceDestroy")
        # Mask 0: only algorithms without a split-K reduction.
        for attr, value in ((PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(lt.workspace_bytes)),
                            (PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(0))):
            check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), ctypes.sizeof(value)),
                  f"cublasLtMatmulPreferenceSetAttribute({attr})")
        results, found = (HeuristicResult * HEURISTIC_RESULTS)(), ctypes.c_int()
        check(lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, self.desc, self.layout_b, self.layout_a, self.layout_c,
                                                 self.layout_c, pref, HEURISTIC_RESULTS, results, ctypes.byref(found)),
              f"cublasLtMatmulAlgoGetHeuristic({product})")
        if found.value == 0:  # the call succeeds with no result when nothing supports the product
            raise RuntimeError(f"cuBLASLt has no algorithm for {product}")
        self.algo = Algo.from_buffer_copy(results[0].algo)
        self._alpha, self._beta = ctypes.c_float(), ctypes.c_float()
        self._args = (ctypes.byref(self._alpha), ctypes.byref(self._beta), ctypes.byref(self.algo))
        self._matmul = lib.cublasLtMatmul

    def _create(self, create: str, destroy: str, *args) -> ctypes.c_void_p:
        obj = ctypes.c_void_p()
        library.check(getattr(self.lt.lib, create)(ctypes.byref(obj), *args), create)
        self._owned.append((destroy, obj))
        return obj

    def __call__(self, a: int, b: int, c: int, alpha: float, beta: float, stream: int) -> None:
        self._alpha.value, self._beta.value = alpha, beta
        alpha_ref, beta_ref, algo_ref = self._args
        status = self._matmul(self.lt.handle, self.desc, alpha_ref, b, self.layout_b, a, self.layout_a, beta_ref,
                              c, self.layout_c, c, self.layout_c, algo_ref, self.lt.workspace,
                              self.lt.workspace_bytes, stream)
        if status:
            library.check(status, "cublasLtMatmul")

    def close(self) -> None:
        while self._owned:
            destroy, obj = self._owned.pop()
            library.check(getattr(self.lt.lib, destroy)(obj), destroy)
