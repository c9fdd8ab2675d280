"""cuBLASLt's strided batched products without a GPU (graphtrain.libs.cublaslt), against a
cuBLASLt that records what it is given: the row-major product as the column-major one cuBLASLt
computes (operands swapped, each layout its matrix read column-major, with its leading dimension,
batch count and stride); one choice per shape, from the heuristic's answers for HEURISTIC_BATCH
and PACK_BATCH products, whatever batch and strides are planned; every plan run with that one
algorithm, checked first; the refusals. tests/test_cublaslt_batched_gpu.py runs them."""

from __future__ import annotations

import ctypes
import types

import pytest

from graphtrain.libs import cublaslt
from graphtrain.libs.cublas import GemmShapeError
from graphtrain.libs.cublaslt import (HEURISTIC_BATCH, PACK_BATCH, AlgoNotApplicableError, GemmShape, LtGemms, LtMatmul,
                                      NotPlannedError, Product)

OP_N, OP_T = 0, 1
WORKSPACE, WORKSPACE_BYTES, STREAM = 0x7000, 1 << 20, 0x5150
A, B, C = 0x10000, 0x20000, 0x30000  # device addresses, as the library would be given them


class RecordingLt:
    """The cuBLASLt functions the products call, each taking what its declared types take: each
    object it creates a number with its arguments and attributes, each call recorded; AlgoCheck answers `check_status`, the heuristic
    `algo_id` (or nothing where `found` is 0; where `ranked` is given, the ids it lists for the
    layouts' batch count, best first), the algorithm `splits` K splits."""

    def __init__(self):
        self.objects, self.destroyed, self.calls = {}, [], []
        self.algo_id, self.found, self.splits, self.check_status, self.check_workspace = 41, 1, 1, 0, 0
        self.ranked: dict[int, list[int]] | None = None
        for kind in ("MatmulDesc", "MatrixLayout", "MatmulPreference"):
            setattr(self, f"cublasLt{kind}Create", lambda ref, *args, kind=kind: self._create(ref, kind, args))
            setattr(self, f"cublasLt{kind}SetAttribute", self._set_attribute)
            setattr(self, f"cublasLt{kind}Destroy", lambda obj: self.destroyed.append(obj.value) or 0)
        for name, (argtypes, _) in cublaslt.library.functions.items():
            if hasattr(self, name):
                setattr(self, name, self._typed(name, argtypes, getattr(self, name)))

    @staticmethod
    def _typed(name, argtypes, function):
        """`function`, its arguments first converted as the library's declared types convert them."""
        def call(*args):
            assert len(args) == len(argtypes), name
            for argtype, arg in zip(argtypes, args):
                argtype.from_param(arg)  # a TypeError where ctypes would refuse the argument
            return function(*args)
        return call

    def _create(self, ref, kind, args):
        ref._obj.value = number = 100 + len(self.objects)
        self.objects[number] = {"kind": kind, "args": args, "attrs": {}}
        return 0

    def _set_attribute(self, obj, attr, ref, size):
        assert size == ctypes.sizeof(ref._obj)
        self.objects[obj.value]["attrs"][attr] = ref._obj.value
        return 0

    def described(self, obj) -> tuple:
        """What an object is: its arguments and its attributes, sorted."""
        entry = self.objects[obj.value if isinstance(obj, ctypes.c_void_p) else obj]
        return entry["args"], tuple(sorted(entry["attrs"].items()))

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, lb, la, lc, ld, pref, requested, results, found_ref):
        self.calls.append(("heuristic", [self.described(o) for o in (desc, lb, la, lc, ld, pref)]))
        ids = [self.algo_id] * self.found
        if self.ranked is not None:
            ids = self.ranked[dict(self.described(lb)[1])[cublaslt.LAYOUT_BATCH_COUNT]]
        assert len(ids) <= requested
        for i, algo_id in enumerate(ids):
            results[i].algo.data[0] = algo_id
        found_ref._obj.value = len(ids)
        return 0

    def cublasLtMatmulAlgoConfigGetAttribute(self, algo_ref, attr, buf_ref, size, written_ref):
        """K's splits, else the algorithm's config: (id, tile, stages) = (its number, 0, 0)."""
        assert size == 4
        configs = {cublaslt.ALGO_CONFIG_ID: algo_ref._obj.data[0], cublaslt.ALGO_CONFIG_TILE_ID: 0,
                   cublaslt.ALGO_CONFIG_STAGES_ID: 0, cublaslt.ALGO_CONFIG_SPLITK_NUM: self.splits}
        buf_ref._obj.value = configs[attr]
        return 0

    def cublasLtMatmulAlgoCheck(self, handle, desc, lb, la, lc, ld, algo_ref, result_ref):
        self.calls.append(("check", [self.described(o) for o in (desc, lb, la, lc, ld)], algo_ref._obj.data[0]))
        result_ref._obj.workspaceSize = self.check_workspace
        return self.check_status

    def cublasLtMatmul(self, handle, desc, alpha, b, lb, a, la, beta, c, lc, d, ld, algo, ws, ws_bytes, stream):
        self.calls.append(("matmul", dict(
            desc=self.described(desc), b=b, a=a, c=c, d=d, layouts=[self.described(o) for o in (lb, la, lc, ld)],
            alpha=alpha._obj.value, beta=beta._obj.value, algo=algo._obj.data[0], workspace=(ws, ws_bytes),
            stream=stream)))
        return 0

    def cublasLtGetStatusName(self, status):
        return {15: b"CUBLAS_STATUS_NOT_SUPPORTED"}.get(status, b"CUBLAS_STATUS_?")

    def named(self, name):
        return [call for call in self.calls if call[0] == name]


@pytest.fixture
def lib():
    return RecordingLt()


def recorded_lt(lib, arch="sm_90") -> cublaslt.Lt:
    lt = cublaslt.Lt.__new__(cublaslt.Lt)  # a handle's state, without cuBLASLt
    lt.lib, lt.handle, lt.workspace, lt.workspace_bytes = lib, ctypes.c_void_p(0x11), WORKSPACE, WORKSPACE_BYTES
    lt.arch = arch
    return lt


def gemms(lib, precision="tf32", arch="sm_90") -> LtGemms:
    return LtGemms(recorded_lt(lib, arch), types.SimpleNamespace(handle=STREAM), precision)


def layout(rows, cols, ld, batch, stride):
    """A layout as the recording sees it: fp32, rows × cols column-major, its batch."""
    return (cublaslt.R_32F, rows, cols, ld), ((cublaslt.LAYOUT_BATCH_COUNT, batch),
                                             (cublaslt.LAYOUT_STRIDED_BATCH_OFFSET, stride))


# The cnn's three products (batch 256, 800 conv features, a hidden layer of 256), and a small one
# with every leading dimension padded, each (transa, transb, m, n, k, lda, ldb, ldc).
CNN = {"forward": (False, True, 256, 256, 800, 800, 800, 256), "weight grad": (True, False, 256, 800, 256, 256, 800, 800),
       "input grad": (False, False, 256, 800, 256, 256, 800, 800)}
PADDED = {f"padded {ta:d}{tb:d}": (ta, tb, 6, 5, 4, (6 if ta else 4) + 1, (4 if tb else 5) + 2, 5 + 3)
          for ta in (False, True) for tb in (False, True)}


@pytest.mark.parametrize("precision,compute", [("fp32", 68), ("tf32", 77)])
@pytest.mark.parametrize("case", [*CNN, *PADDED])
def test_a_row_major_product_is_the_column_major_one_with_each_operands_batch(lib, case, precision, compute):
    """Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: B' first with B's transpose
    flag, then A'; each a row-major matrix as stored (r rows of leading dimension ld) read
    column-major (r columns); C' is also D'; cuBLAS's gemm's compute type for the precision."""
    transa, transb, m, n, k, lda, ldb, ldc = (CNN | PADDED)[case]
    (a_rows, a_cols), (b_rows, b_cols) = ((k, m) if transa else (m, k)), ((n, k) if transb else (k, n))
    stride_a, stride_c = a_rows * lda + 64, m * ldc + 128  # a gap after each matrix
    g = gemms(lib, precision)
    g.plan(transa, transb, m, n, k, lda, stride_a, ldb, 0, ldc, stride_c, 3)
    g.gemm_strided_batched(transa, transb, m, n, k, 0.5, A, lda, stride_a, B, ldb, 0, 2.0, C, ldc, stride_c, 3)
    (_, call), = lib.named("matmul")
    assert call["desc"] == ((compute, cublaslt.R_32F), ((cublaslt.DESC_TRANSA, OP_T if transb else OP_N),
                                                        (cublaslt.DESC_TRANSB, OP_T if transa else OP_N),
                                                        (cublaslt.DESC_EPILOGUE, cublaslt.EPILOGUES["none"])))
    assert (call["b"], call["a"], call["c"], call["d"]) == (B, A, C, C)
    assert call["layouts"] == [layout(b_cols, b_rows, ldb, 3, 0), layout(a_cols, a_rows, lda, 3, stride_a),
                               layout(n, m, ldc, 3, stride_c), layout(n, m, ldc, 3, stride_c)]
    assert (call["alpha"], call["beta"], call["workspace"], call["stream"]) == (0.5, 2.0, (WORKSPACE, WORKSPACE_BYTES),
                                                                                STREAM)


def test_the_algorithm_is_chosen_once_per_shape_for_the_representative_batches(lib):
    """One choice per shape, whatever the batches and strides planned: the heuristic asked for
    HEURISTIC_BATCH and for PACK_BATCH products, each operand its own matrix (stride: its rows ×
    leading dimension), no split-K reduction, the run's workspace; every plan of the shape checked
    and run with the answer."""
    transa, transb, m, n, k, lda, ldb, ldc = PADDED["padded 10"]  # A 4×6 (lda 7), B 4×5 (ldb 7), C 6×5 (ldc 8)
    g = gemms(lib)
    plans = [g.plan(transa, transb, m, n, k, lda, sa, ldb, sb, ldc, sc, batch)
             for sa, sb, sc, batch in [(0, 0, 0, 1), (100, 0, 200, 3), (100, 100, 200, 8)]]
    assert g.plan(transa, transb, m, n, k, lda, 0, ldb, 0, ldc, 0, 1) is plans[0]  # planned once
    asked = lib.named("heuristic")
    assert len(asked) == 2
    for (_, described), batch in zip(asked, (HEURISTIC_BATCH, PACK_BATCH)):
        desc, lb, la, lc, ld, pref = described
        assert desc[0] == (77, cublaslt.R_32F)
        assert [lb, la, lc, ld] == [layout(5, 4, 7, batch, 4 * 7), layout(6, 4, 7, batch, 4 * 7),
                                    layout(5, 6, 8, batch, 6 * 8), layout(5, 6, 8, batch, 6 * 8)]
        assert pref[1] == ((cublaslt.PREF_MAX_WORKSPACE_BYTES, WORKSPACE_BYTES),
                           (cublaslt.PREF_REDUCTION_SCHEME_MASK, 0))
    checks = lib.named("check")
    assert [algo for _, _, algo in checks] == [lib.algo_id] * 3
    assert [dict(b_layout[1])[cublaslt.LAYOUT_BATCH_COUNT] for _, (_, b_layout, *_), _ in checks] == [1, 3, 8]
    assert all(plan.algo.data[0] == lib.algo_id for plan in plans)
    # the heuristic's objects are gone; the plans' own stay until they are closed
    made = set(lib.objects)
    assert len(set(lib.destroyed)) == len(lib.destroyed) and set(lib.destroyed) < made
    g.close()
    assert sorted(lib.destroyed) == sorted(made)


@pytest.mark.parametrize("ranked,chosen", [
    ({HEURISTIC_BATCH: [7, 8, 9], PACK_BATCH: [5, 9, 8]}, 8),   # the first of the few's that the pack's has
    ({HEURISTIC_BATCH: [7, 8], PACK_BATCH: [5, 6]}, 7),         # none shared: the few's first
    ({HEURISTIC_BATCH: [7], PACK_BATCH: [7, 6]}, 7)])
def test_the_algorithm_is_the_first_for_a_few_products_that_the_heuristic_gives_a_pack(lib, ranked, chosen):
    lib.ranked = ranked
    transa, transb, m, n, k, lda, ldb, ldc = CNN["forward"]
    g = gemms(lib)
    plans = [g.plan(transa, transb, m, n, k, lda, sa, ldb, 0, ldc, sc, batch)
             for sa, sc, batch in [(0, 0, 1), (m * lda, m * ldc, 64)]]
    assert [plan.algo.data[0] for plan in plans] == [chosen, chosen]
    assert [algo for _, _, algo in lib.named("check")] == [chosen, chosen]


@pytest.mark.parametrize("ranked,arch,chosen,rule", [
    ({HEURISTIC_BATCH: [7, 8, 9], PACK_BATCH: [5, 9, 8]}, "sm_90", 5, 8),   # preferred, among the pack's answers
    ({HEURISTIC_BATCH: [7, 5, 9], PACK_BATCH: [9, 8]}, "sm_90", 5, 9),      # preferred, among the few's
    ({HEURISTIC_BATCH: [7, 8, 9], PACK_BATCH: [6, 9, 8]}, "sm_90", 8, 8),   # not proposed: the rule's
    ({HEURISTIC_BATCH: [7, 8, 9], PACK_BATCH: [5, 9, 8]}, "sm_80", 8, 8)])  # another GPU: the rule's
def test_a_preferred_configuration_is_chosen_where_the_heuristic_proposes_it(lib, monkeypatch, ranked, arch, chosen,
                                                                             rule):
    """PREFERRED_CONFIGS names an algorithm by (id, tile, stages) for a GPU and a shape: chosen for
    every batch count where the heuristic proposes it for HEURISTIC_BATCH or PACK_BATCH products."""
    lib.ranked = ranked
    transa, transb, m, n, k, lda, ldb, ldc = CNN["input grad"]
    shape = GemmShape(transa, transb, m, n, k, lda, ldb, ldc, "tf32")
    monkeypatch.setattr(cublaslt, "PREFERRED_CONFIGS", {"sm_90": {shape: (5, 0, 0)}})
    g = gemms(lib, arch=arch)
    plans = [g.plan(transa, transb, m, n, k, lda, sa, ldb, 0, ldc, sc, batch)
             for sa, sc, batch in [(0, 0, 1), (m * lda, m * ldc, 64)]]
    assert [plan.algo.data[0] for plan in plans] == [chosen, chosen]
    other = gemms(RecordingLt(), precision="fp32", arch=arch)  # another shape: the rule's, whatever the table
    other.lt.lib.ranked = ranked
    assert other.plan(transa, transb, m, n, k, lda, 0, ldb, 0, ldc, 0, 1).algo.data[0] == rule


def test_the_preferred_configurations_name_shapes_the_speedrun_cnn_plans():
    """A preferred configuration is measured for a product some model plans: the speedrun cnn's
    hidden layer (a table entry that no longer matches a planned shape is stale)."""
    for shape in cublaslt.PREFERRED_CONFIGS["sm_90"]:
        assert (shape.transa, shape.transb, shape.m, shape.n, shape.k, shape.lda, shape.ldb, shape.ldc) in CNN.values()
        assert shape.precision == "tf32"


def test_batch_one_alone_asks_the_heuristic_what_batch_k_asks(lib):
    """A run of one product and a run of K choose their algorithm from the same question."""
    shape = CNN["forward"]
    transa, transb, m, n, k, lda, ldb, ldc = shape
    alone, packed = RecordingLt(), RecordingLt()
    gemms(alone).plan(transa, transb, m, n, k, lda, 0, ldb, 0, ldc, 0, 1)
    gemms(packed).plan(transa, transb, m, n, k, lda, m * lda, ldb, 0, ldc, m * ldc, 5)
    assert alone.named("heuristic") == packed.named("heuristic")
    (_, one, one_algo), = alone.named("check")
    (_, five, five_algo), = packed.named("check")
    # the same descriptor and algorithm, the same matrices: only the batch counts and strides differ
    assert one[0] == five[0] and one_algo == five_algo
    assert [args for args, _ in one[1:]] == [args for args, _ in five[1:]]


def test_a_product_queued_without_its_plan_is_refused(lib):
    g = gemms(lib)
    transa, transb, m, n, k, lda, ldb, ldc = CNN["input grad"]
    g.plan(transa, transb, m, n, k, lda, 0, ldb, 0, ldc, 0, 1)
    with pytest.raises(NotPlannedError, match="batch=2"):
        g.gemm_strided_batched(transa, transb, m, n, k, 1.0, A, lda, 0, B, ldb, 0, 0.0, C, ldc, m * ldc, 2)
    assert not lib.named("matmul")


def test_an_algorithm_the_check_refuses_is_a_typed_error_and_nothing_is_left(lib):
    lib.check_status = 15
    g = gemms(lib)
    transa, transb, m, n, k, lda, ldb, ldc = CNN["weight grad"]
    with pytest.raises(AlgoNotApplicableError, match="CUBLAS_STATUS_NOT_SUPPORTED"):
        g.plan(transa, transb, m, n, k, lda, 0, ldb, 0, ldc, 0, 1)
    assert sorted(lib.destroyed) == sorted(lib.objects)


def test_an_algorithm_needing_more_workspace_than_the_run_has_is_refused(lib):
    lib.check_workspace = WORKSPACE_BYTES + 1
    with pytest.raises(AlgoNotApplicableError, match="workspace"):
        gemms(lib).plan(*CNN["forward"][:5], 800, 0, 800, 0, 256, 0, 1)
    assert sorted(lib.destroyed) == sorted(lib.objects)


def test_an_algorithm_that_splits_k_or_none_at_all_is_refused(lib):
    lib.splits = 2
    with pytest.raises(AlgoNotApplicableError, match="splits K in 2"):
        gemms(lib).plan(*CNN["forward"][:5], 800, 0, 800, 0, 256, 0, 1)
    lib.splits, lib.found = 1, 0
    with pytest.raises(RuntimeError, match="no algorithm"):
        gemms(lib).plan(*CNN["forward"][:5], 800, 0, 800, 0, 256, 0, 1)
    assert sorted(lib.destroyed) == sorted(lib.objects) and not lib.named("check")


@pytest.mark.parametrize("bad", [dict(lda=799), dict(ldc=255), dict(m=0), dict(batch=0), dict(stride_a=-1),
                                 dict(stride_c=256 * 256 - 1)])
def test_a_shape_or_strides_that_cannot_fit_are_refused_before_cuBLASLt_sees_them(lib, bad):
    args = {**dict(transa=False, transb=True, m=256, n=256, k=800, lda=800, stride_a=0, ldb=800, stride_b=0, ldc=256,
                   stride_c=256 * 256, batch=2), **bad}
    with pytest.raises(GemmShapeError):
        gemms(lib).plan(**args)
    assert not lib.objects


def test_only_the_two_precisions_are_taken(lib):
    with pytest.raises(ValueError, match="bf16"):
        gemms(lib, "bf16")
    with pytest.raises(ValueError, match="bf16"):
        GemmShape(False, False, 2, 2, 2, 2, 2, 2, "bf16")


def test_ltmatmul_is_planned_as_before(lib):
    """The epilogue products: compute 32F, each layout packed (ld = rows), no batch, the heuristic
    asked for the product itself."""
    plan = LtMatmul(recorded_lt(lib), Product(6, 5, 4, transb=True, epilogue="relu"))
    (_, (desc, lb, la, lc, ld, pref)), = lib.named("heuristic")
    assert desc == ((cublaslt.COMPUTE_32F, cublaslt.R_32F),
                    ((cublaslt.DESC_TRANSA, OP_T), (cublaslt.DESC_TRANSB, OP_N), (cublaslt.DESC_EPILOGUE, 2)))
    assert [lb, la, lc] == [((cublaslt.R_32F, 4, 5, 4), ()), ((cublaslt.R_32F, 4, 6, 4), ()),
                            ((cublaslt.R_32F, 5, 6, 5), ())]
    plan(A, B, C, 1.0, 0.0, STREAM)
    (_, call), = lib.named("matmul")
    assert (call["b"], call["a"], call["c"], call["algo"]) == (B, A, C, lib.algo_id)
    plan.close()
    assert sorted(lib.destroyed) == sorted(lib.objects)
