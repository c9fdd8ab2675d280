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

Strided batched products (`StridedLtMatmul`, and `LtGemms`, cuBLAS's `gemm_strided_batched` made
of them) do the same for `batch` products in one call: product i reads A at a + i·stride_a, B at
b + i·stride_b and writes C at c + i·stride_c (a stride of 0: every product reads one matrix).
cuBLAS's own heuristic picks a kernel per call, and for one product it picks another than for
several (split-K-like, its bits differ), so one product alone would not be the same numbers as
that product in a batch. Here the algorithm is chosen once per shape (`choose_algo`: among the
heuristic's answers without split-K for HEURISTIC_BATCH products, each operand its own matrix, the
first that it also proposes for PACK_BATCH products, or one of its answers measured to suit both
ends better: PREFERRED_CONFIGS), whatever the batch count and the strides,
and every batch count runs that one algorithm (checked by
cublasLtMatmulAlgoCheck; refused where it does not apply): each product of a batch of K is then
computed by the same kernel, tile by tile in the same order, as that product alone.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from graphtrain.libs import cublas
from graphtrain.libs.cublas import check_gemm_batch, check_gemm_shape
from graphtrain.libs.shared_lib import SharedLibrary

# cudaDataType_t and cublasComputeType_t (library_types.h, cublas_api.h)
R_32F, R_16BF = 0, 14
COMPUTE_32F = 68
# The strided batched products' compute type per precision: cuBLAS's gemm's (tf32:
# CUBLAS_COMPUTE_32F_FAST_TF32; fp32: COMPUTE_32F, never rounded to TF32).
COMPUTE_TYPES = {precision: compute for precision, (compute, _) in cublas.PRECISIONS.items()}
# cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t (cublasLt.h)
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER, DESC_BIAS_DATA_TYPE = 3, 4, 7, 8, 26
PREF_MAX_WORKSPACE_BYTES, PREF_REDUCTION_SCHEME_MASK = 1, 3
# cublasLtMatrixLayoutAttribute_t, cublasLtMatmulAlgoConfigAttributes_t
LAYOUT_BATCH_COUNT, LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
ALGO_CONFIG_ID, ALGO_CONFIG_TILE_ID, ALGO_CONFIG_SPLITK_NUM, ALGO_CONFIG_STAGES_ID = 0, 1, 2, 6
# cublasStatus_t: what cublasLtMatmulAlgoCheck answers for an algorithm that does not apply
# (INVALID_VALUE: the layouts do not match it; ARCH_MISMATCH, NOT_SUPPORTED: not on this GPU).
ALGO_REFUSED_STATUSES = {7, 8, 15}
OP_N, OP_T = 0, 1
# cublasLtEpilogue_t, by the row-major names above
EPILOGUES = {"none": 1, "relu": 2, "bias": 4, "relu_bias": 6}
BIAS_EPILOGUES = {"bias", "relu_bias"}
HEURISTIC_RESULTS = 8
# The batch counts the strided batched products' algorithm is chosen for: any fixed counts would do,
# what matters is that the choice never depends on the batch a product runs with. The heuristic's
# first for 4 products suits one model (the speedrun) but not a pack of 64; its first for 64 the
# reverse (the speedrun cnn's three hidden-layer products on an H200, scripts/probes/cnn_step_profile.py:
# 64 models' 133 µs against 211, one model's 30 µs against 19). An algorithm the heuristic proposes
# for both counts suits both: its answers for 4 products in order, the first that is among its
# answers for 64 (scripts/probes/lt_algo_choice.py times each candidate at 1 and 64 products).
HEURISTIC_BATCH = 4
PACK_BATCH = 64

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
    "cublasLtMatrixLayoutSetAttribute": ([_ptr, _int, _ptr, _size], _int),
    "cublasLtMatmulPreferenceCreate": ([_out], _int),
    "cublasLtMatmulPreferenceDestroy": ([_ptr], _int),
    "cublasLtMatmulPreferenceSetAttribute": ([_ptr, _int, _ptr, _size], _int),
    "cublasLtMatmulAlgoGetHeuristic": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int,
                                        ctypes.POINTER(HeuristicResult), ctypes.POINTER(_int)], _int),
    "cublasLtMatmulAlgoCheck": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.POINTER(Algo),
                                 ctypes.POINTER(HeuristicResult)], _int),
    "cublasLtMatmulAlgoConfigGetAttribute": ([ctypes.POINTER(Algo), _int, _ptr, _size, ctypes.POINTER(_size)], _int),
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

    def __init__(self, workspace: int, workspace_bytes: int, arch: str = ""):
        self.lib = library.load()
        self.workspace, self.workspace_bytes = workspace, workspace_bytes
        self.arch = arch  # the GPU's, e.g. "sm_90": which of PREFERRED_CONFIGS apply ("": none)
        handle = ctypes.c_void_p()
        library.check(self.lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        self.handle = handle

    def close(self) -> None:
        if self.handle:
            handle, self.handle = self.handle, ctypes.c_void_p()
            library.check(self.lib.cublasLtDestroy(handle), "cublasLtDestroy")


class AlgoNotApplicableError(RuntimeError):
    """The one algorithm chosen for a product's shape cannot give a batched layout of it the bits
    of each product alone: cublasLtMatmulAlgoCheck refused it there, it needs more workspace than
    the run has, or it splits K. Refused, never replaced by another algorithm."""


class _Plan:
    """The cuBLASLt objects of one planned product, destroyed together by `close`, and its call:
    `plan(a, b, c, alpha, beta, stream)` queues C = alpha·op(A)·op(B) + beta·C (C is D: in place)."""

    def __init__(self, lt: Lt):
        self.lt = lt
        self._owned: list[tuple[str, ctypes.c_void_p]] = []

    def _create(self, create: str, destroy: str, *args) -> ctypes.c_void_p:
        obj = ctypes.c_void_p()
        library.check(getattr(self.lt.lib, create)(ctypes.byref(obj), *args), create)
        self._owned.append((destroy, obj))
        return obj

    def _set(self, setter: str, obj: ctypes.c_void_p, attributes) -> None:
        for attr, value in attributes:
            library.check(getattr(self.lt.lib, setter)(obj, attr, ctypes.byref(value), ctypes.sizeof(value)),
                          f"{setter}({attr})")

    def _describe(self, compute: int, attributes, layouts) -> None:
        """The matmul descriptor and the column-major B', A', C' layouts ((type, rows, cols, ld),
        then the batch count and the stride where `batch` is given: (count, stride) or None)."""
        self.desc = self._create("cublasLtMatmulDescCreate", "cublasLtMatmulDescDestroy", compute, R_32F)
        self._set("cublasLtMatmulDescSetAttribute", self.desc, attributes)
        made = []
        for (dtype, rows, cols, ld), batch in layouts:
            layout = self._create("cublasLtMatrixLayoutCreate", "cublasLtMatrixLayoutDestroy", dtype, rows, cols, ld)
            if batch is not None:
                count, stride = batch
                self._set("cublasLtMatrixLayoutSetAttribute", layout,
                          [(LAYOUT_BATCH_COUNT, ctypes.c_int32(count)), (LAYOUT_STRIDED_BATCH_OFFSET, _i64(stride))])
            made.append(layout)
        self.layout_b, self.layout_a, self.layout_c = made

    def _describe_strided(self, shape: GemmShape, batch: int, strides: tuple[int, int, int]) -> None:
        """`_describe` for `batch` products of `shape` (its compute type, no epilogue), `strides`
        in the layouts' order: B', A', C'."""
        self._describe(COMPUTE_TYPES[shape.precision], shape.product.attributes(0),
                       [(layout, (batch, stride)) for layout, stride in zip(shape.layouts(), strides)])

    def _first_algo(self, what: object) -> Algo:
        """The heuristic's first algorithm for the descriptor and layouts within the workspace,
        among those without a split-K reduction (mask 0)."""
        return self._ranked_algos(what)[0]

    def _ranked_algos(self, what: object) -> list[Algo]:
        """The heuristic's algorithms (at most HEURISTIC_RESULTS, best first) for the descriptor and
        layouts within the workspace, among those without a split-K reduction (mask 0)."""
        lt, check = self.lt, library.check
        pref = self._create("cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceDestroy")
        self._set("cublasLtMatmulPreferenceSetAttribute", pref,
                  [(PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(lt.workspace_bytes)),
                   (PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(0))])
        results, found = (HeuristicResult * HEURISTIC_RESULTS)(), ctypes.c_int()
        check(lt.lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, self.desc, self.layout_b, self.layout_a, self.layout_c,
                                                    self.layout_c, pref, HEURISTIC_RESULTS, results,
                                                    ctypes.byref(found)),
              f"cublasLtMatmulAlgoGetHeuristic({what})")
        if found.value == 0:  # the call succeeds with no result when nothing supports the product
            raise RuntimeError(f"cuBLASLt has no algorithm for {what}")
        return [Algo.from_buffer_copy(results[i].algo) for i in range(found.value)]

    def _ready(self, algo: Algo) -> None:
        self.algo = algo
        self._alpha, self._beta = ctypes.c_float(), ctypes.c_float()
        self._args = (ctypes.byref(self._alpha), ctypes.byref(self._beta), ctypes.byref(self.algo))
        self._matmul = self.lt.lib.cublasLtMatmul

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


class LtMatmul(_Plan):
    """One planned product: `matmul(a, b, c, alpha, beta, stream)` queues C = alpha·op(A)·op(B) +
    beta·C with the epilogue. The bias belongs to the layer and is bound here."""

    def __init__(self, lt: Lt, product: Product, bias: int = 0):
        super().__init__(lt)
        self.product = product
        self._describe(COMPUTE_32F, product.attributes(bias),
                       [((dtype, rows, cols, rows), None) for dtype, rows, cols in product.layouts()])
        self._ready(self._first_algo(product))


def check_precision(precision: str) -> None:
    if precision not in COMPUTE_TYPES:
        raise ValueError(f"cuBLASLt precision must be one of {sorted(COMPUTE_TYPES)}, not {precision!r}")


@dataclass(frozen=True)
class GemmShape:
    """Row-major C (m×n, leading dimension ldc) = op(A)·op(B), A m×k (k×m if transa, leading
    dimension lda), B k×n (n×k if transb, ldb), all fp32, in `precision` ("fp32", "tf32"): what a
    strided batched product's algorithm is chosen for."""

    transa: bool
    transb: bool
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    precision: str = "fp32"

    def __post_init__(self) -> None:
        check_precision(self.precision)
        check_gemm_shape(self.transa, self.transb, self.m, self.n, self.k, self.lda, self.ldb, self.ldc)

    @property
    def product(self) -> Product:
        return Product(self.m, self.n, self.k, self.transa, self.transb)

    def layouts(self) -> tuple[tuple[int, int, int, int], ...]:
        """(type, rows, cols, ld) of the column-major B', A' and C' cuBLASLt sees (Product.layouts
        with the leading dimensions)."""
        return tuple((*layout, ld) for layout, ld in zip(self.product.layouts(), (self.ldb, self.lda, self.ldc)))

    def extents(self) -> tuple[int, int, int]:
        """Elements each of B, A and C spans (its row-major rows × leading dimension): the strides
        of matrices packed one after another."""
        return tuple(cols * ld for _, _, cols, ld in self.layouts())


# Where the rule's algorithm is measured to cost a pack far more than another of the heuristic's
# answers costs one model alone, that other: (algorithm id, tile id, stages id) by GPU architecture
# and shape, taken where the heuristic proposes it for HEURISTIC_BATCH or PACK_BATCH products (the
# first such answer; the rule's where it proposes none). The speedrun cnn's hidden layer on an H200,
# cuBLAS 13.1 (scripts/probes/lt_algo_choice.py, µs at 1 and 64 products; the rule's in brackets):
#   weight gradient (TN 256×800×256)  6.31, 55.85  [4.93, 67.45]
#   input gradient  (NN 256×800×256)  6.03, 45.59  [4.92, 65.21]
# (its forward product, NT 256×256×800, keeps the rule's: 5.89, 40.02).
PREFERRED_CONFIGS: dict[str, dict[GemmShape, tuple[int, int, int]]] = {
    "sm_90": {
        GemmShape(True, False, 256, 800, 256, 256, 800, 800, "tf32"): (21, 17, 9),
        GemmShape(False, False, 256, 800, 256, 256, 800, 800, "tf32"): (43, 18, 34),
    },
}


def _status_name(lt: Lt, status: int) -> str:
    text = lt.lib.cublasLtGetStatusName(int(status))
    return text.decode(errors="replace") if text else f"status {int(status)}"


class StridedLtMatmul(_Plan):
    """`batch` products of `shape` in one cublasLtMatmul with the given algorithm (choose_algo's
    for the shape): product i reads A at a + i·stride_a, B at b + i·stride_b and writes C at
    c + i·stride_c, strides in elements (0: every product reads the same matrix). Called as
    LtMatmul is; AlgoNotApplicableError where the algorithm does not apply to this layout."""

    def __init__(self, lt: Lt, shape: GemmShape, batch: int, stride_a: int, stride_b: int, stride_c: int,
                 algo: Algo):
        check_gemm_batch(shape.m, shape.ldc, batch, stride_a, stride_b, stride_c)
        super().__init__(lt)
        self.shape, self.batch, self.strides = shape, batch, (stride_a, stride_b, stride_c)
        try:
            self._describe_strided(shape, batch, (stride_b, stride_a, stride_c))
            self._ready(Algo.from_buffer_copy(algo))
            self._check_algo()
        except BaseException:
            self.close()
            raise

    def _check_algo(self) -> None:
        lt, result = self.lt, HeuristicResult()
        what = f"{self.batch} products of {self.shape} with strides (a, b, c) = {self.strides}"
        status = lt.lib.cublasLtMatmulAlgoCheck(lt.handle, self.desc, self.layout_b, self.layout_a, self.layout_c,
                                                self.layout_c, ctypes.byref(self.algo), ctypes.byref(result))
        if status in ALGO_REFUSED_STATUSES:
            raise AlgoNotApplicableError(f"the shape's cuBLASLt algorithm does not apply to {what}: "
                                         f"cublasLtMatmulAlgoCheck answered {_status_name(lt, status)}")
        library.check(status, "cublasLtMatmulAlgoCheck")
        if result.workspaceSize > lt.workspace_bytes:
            raise AlgoNotApplicableError(f"the shape's cuBLASLt algorithm needs {result.workspaceSize} bytes of "
                                         f"workspace for {what}; the run has {lt.workspace_bytes}")


def _ranked_for(lt: Lt, shape: GemmShape, batch: int) -> list[Algo]:
    """The heuristic's algorithms without split-K for `batch` products of `shape`, each operand its
    own matrix (strides: the extents), best first."""
    probe = _Plan(lt)
    try:
        probe._describe_strided(shape, batch, shape.extents())
        return probe._ranked_algos(f"{batch} products of {shape}")
    finally:
        probe.close()


def _config_attribute(lt: Lt, algo: Algo, attr: int) -> int:
    """One of `algo`'s configuration attributes (each a 32-bit value)."""
    value, written = ctypes.c_uint32(), ctypes.c_size_t()
    library.check(lt.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                               ctypes.sizeof(value), ctypes.byref(written)),
                  f"cublasLtMatmulAlgoConfigGetAttribute({attr})")
    return value.value


def algo_config(lt: Lt, algo: Algo) -> tuple[int, int, int]:
    """(algorithm id, tile id, stages id) of `algo`: what PREFERRED_CONFIGS names."""
    return tuple(_config_attribute(lt, algo, attr)
                 for attr in (ALGO_CONFIG_ID, ALGO_CONFIG_TILE_ID, ALGO_CONFIG_STAGES_ID))


def choose_algo(lt: Lt, shape: GemmShape) -> Algo:
    """The algorithm every strided batched product of `shape` runs, whatever its batch count and
    strides: PREFERRED_CONFIGS' for the GPU and shape where the heuristic proposes it for
    HEURISTIC_BATCH or PACK_BATCH products; else, of its answers for HEURISTIC_BATCH products, the
    first that it also gives for PACK_BATCH products (the first for HEURISTIC_BATCH where they share
    none). It depends on the shape, the workspace's size, cuBLASLt's version and the GPU, and on
    nothing a run's packing changes."""
    ranked, for_pack = _ranked_for(lt, shape, HEURISTIC_BATCH), _ranked_for(lt, shape, PACK_BATCH)
    preferred = PREFERRED_CONFIGS.get(lt.arch, {}).get(shape)
    algo = preferred and next((algo for algo in ranked + for_pack if algo_config(lt, algo) == preferred), None)
    if algo is None:
        packed = {bytes(algo) for algo in for_pack}
        algo = next((algo for algo in ranked if bytes(algo) in packed), ranked[0])
    # Mask 0 admits only algorithms without a reduction, so one split; checked, as the bits rest on it.
    splits = _config_attribute(lt, algo, ALGO_CONFIG_SPLITK_NUM)
    if splits != 1:
        raise AlgoNotApplicableError(f"cuBLASLt's algorithm for {shape} splits K in {splits} despite "
                                     f"a reduction mask of none")
    return algo


class NotPlannedError(LookupError):
    """A strided batched product queued with arguments `LtGemms.plan` was not given: a bug in the caller."""


class LtGemms:
    """Row-major strided batched products on one stream in one precision, as cuBLAS's
    `Cublas.gemm_strided_batched` takes them, each run by its shape's one algorithm: `plan` at
    setup (the shape, the strides and the batch), `gemm_strided_batched` per step with the same
    arguments and the pointers and scalars, which only queues the planned product."""

    def __init__(self, lt: Lt, stream, precision: str = "fp32"):
        check_precision(precision)
        self.lt, self.precision = lt, precision
        self._stream = int(stream.handle)  # cuBLASLt takes the stream's raw address
        self._algos: dict[GemmShape, Algo] = {}
        self._plans: dict[tuple, StridedLtMatmul] = {}

    def algo(self, shape: GemmShape) -> Algo:
        """`shape`'s algorithm, chosen on its first use (choose_algo) and kept."""
        if shape not in self._algos:
            self._algos[shape] = choose_algo(self.lt, shape)
        return self._algos[shape]

    def plan(self, transa: bool, transb: bool, m: int, n: int, k: int, lda: int, stride_a: int, ldb: int,
             stride_b: int, ldc: int, stride_c: int, batch: int) -> StridedLtMatmul:
        """Plan `batch` products of this shape and these strides (once: planning them again
        returns the same plan)."""
        key = (transa, transb, m, n, k, lda, stride_a, ldb, stride_b, ldc, stride_c, batch)
        if key not in self._plans:
            shape = GemmShape(transa, transb, m, n, k, lda, ldb, ldc, self.precision)
            check_gemm_batch(m, ldc, batch, stride_a, stride_b, stride_c)  # before the heuristic is asked
            self._plans[key] = StridedLtMatmul(self.lt, shape, batch, stride_a, stride_b, stride_c, self.algo(shape))
        return self._plans[key]

    def gemm_strided_batched(self, transa: bool, transb: bool, m: int, n: int, k: int, alpha: float,
                             a_ptr: int, lda: int, stride_a: int, b_ptr: int, ldb: int, stride_b: int, beta: float,
                             c_ptr: int, ldc: int, stride_c: int, batch: int) -> None:
        """Queue C_i = alpha·op(A_i)·op(B_i) + beta·C_i for i < batch, planned by `plan`."""
        planned = self._plans.get((transa, transb, m, n, k, lda, stride_a, ldb, stride_b, ldc, stride_c, batch))
        if planned is None:
            raise NotPlannedError(f"gemm_strided_batched(transa={transa}, transb={transb}, m={m}, n={n}, k={k}, "
                                  f"lda={lda}, stride_a={stride_a}, ldb={ldb}, stride_b={stride_b}, ldc={ldc}, "
                                  f"stride_c={stride_c}, batch={batch}) was not planned")
        planned(a_ptr, b_ptr, c_ptr, alpha, beta, self._stream)

    def close(self) -> None:
        """Destroy every plan's cuBLASLt objects (idempotent; the handle is the Lt's)."""
        while self._plans:
            self._plans.popitem()[1].close()
