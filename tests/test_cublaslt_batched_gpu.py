"""cuBLASLt's strided batched products on the GPU, for the cnn's three products (its hidden layer
of 256 on 800 conv features, batch 256), in tf32 and fp32, with B per product and B shared:
K = 3 products in one call are, bit for bit, the same products one call each (outputs filled with
POISON first: an output left unwritten fails the float64 comparison), also where the batch of one and the batch of K were each planned by a cuBLASLt handle of
their own, as a run of one model and a run of K would plan them; and each against NumPy in
float64 by ‖out − ref‖ / ‖ref‖."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import Scratch, rel_err

K = 3
F32 = np.float32
POISON = 1e30  # finite: with beta = 0 a product that read C would still give its own result
WORKSPACE_BYTES = 32 << 20
# (transa, transb, m, n, k): row-major C (m×n) = op(A)·op(B), as the cnn's step computes them.
PRODUCTS = {"forward": (False, True, 256, 256, 800), "weight grad": (True, False, 256, 800, 256),
            "input grad": (False, False, 256, 800, 256)}
TOLERANCE = {"fp32": 1e-5, "tf32": 3e-3}  # ‖out − ref‖ / ‖ref‖ against float64


@pytest.fixture(scope="module")
def stream(gpu_device):
    from graphtrain.libs import cuda

    s = cuda.Stream()
    yield s
    s.close()


@pytest.fixture(scope="module")
def workspace(gpu_device):
    from graphtrain.libs import cuda

    ptr = cuda.malloc(WORKSPACE_BYTES)
    yield ptr
    cuda.free(ptr)


class Case:
    """K products' operands (seeded), their row-major leading dimensions and strides (elements;
    B's 0 where shared), and the float64 reference of product i."""

    def __init__(self, seed: int, precision: str, product: str, b_shared: bool):
        self.transa, self.transb, self.m, self.n, self.k = PRODUCTS[product]
        self.msg = f"{precision} {product}, B {'shared' if b_shared else 'per product'}, seed {seed}"
        rng = np.random.default_rng(seed)
        a_shape = (self.k, self.m) if self.transa else (self.m, self.k)
        b_shape = (self.n, self.k) if self.transb else (self.k, self.n)
        self.a = rng.standard_normal((K, *a_shape)).astype(F32)
        self.b = rng.standard_normal((1 if b_shared else K, *b_shape)).astype(F32)
        self.lda, self.ldb, self.ldc = a_shape[1], b_shape[1], self.n
        self.strides = (self.a[0].size, 0 if b_shared else self.b[0].size, self.m * self.n)

    def plan(self, gemms, batch: int, strides: tuple[int, int, int]):
        (sa, sb, sc) = strides
        return gemms.plan(self.transa, self.transb, self.m, self.n, self.k, self.lda, sa, self.ldb, sb, self.ldc, sc,
                          batch)

    def run(self, gemms, batch: int, strides: tuple[int, int, int], a: int, b: int, c: int) -> None:
        (sa, sb, sc) = strides
        gemms.gemm_strided_batched(self.transa, self.transb, self.m, self.n, self.k, 1.0, a, self.lda, sa, b,
                                   self.ldb, sb, 0.0, c, self.ldc, sc, batch)

    def run_each(self, gemms, strides: tuple[int, int, int], a: int, b: int, c: int) -> None:
        """Product i alone, a batch of one on its own operands (addresses: 4 bytes an element)."""
        sa, sb, sc = self.strides
        for i in range(K):
            self.run(gemms, 1, strides, a + 4 * i * sa, b + 4 * i * sb, c + 4 * i * sc)

    def reference(self, i: int) -> np.ndarray:
        a = self.a[i].astype(np.float64)
        b = self.b[0 if self.strides[1] == 0 else i].astype(np.float64)
        return (a.T if self.transa else a) @ (b.T if self.transb else b)

    def check(self, precision: str, batched: np.ndarray, alone: np.ndarray) -> None:
        for i in range(K):
            assert rel_err(batched[i], self.reference(i)) < TOLERANCE[precision], f"{self.msg}: product {i} vs float64"
            assert batched[i].tobytes() == alone[i].tobytes(), f"{self.msg}: product {i} batched vs alone"


def outputs(stream, case: Case) -> Scratch:
    poison = np.full((K, case.m, case.n), POISON, F32)
    return Scratch(stream, a=case.a, b=case.b, batched=poison, alone=poison)


CASES = pytest.mark.parametrize("precision,product,b_shared", [
    (precision, product, b_shared) for precision in TOLERANCE for product in PRODUCTS for b_shared in (False, True)],
    ids=lambda v: {False: "B per product", True: "B shared"}.get(v, v) if isinstance(v, bool) else v)


@CASES
def test_each_product_of_a_batch_is_that_product_alone_bit_for_bit(gpu_device, stream, workspace, seed, precision,
                                                                   product, b_shared):
    """One plan set: the batch of K and the batch of one, with the strides of the K products."""
    from graphtrain.libs.cublaslt import Lt, LtGemms

    case = Case(seed, precision, product, b_shared)
    lt = Lt(workspace, WORKSPACE_BYTES, arch=gpu_device.arch)
    gemms = LtGemms(lt, stream, precision)
    try:
        packed, one = case.plan(gemms, K, case.strides), case.plan(gemms, 1, case.strides)
        assert bytes(packed.algo) == bytes(one.algo), case.msg
        with outputs(stream, case) as s:
            case.run(gemms, K, case.strides, s["a"], s["b"], s["batched"])
            case.run_each(gemms, case.strides, s["a"], s["b"], s["alone"])
            batched, alone = s.get("batched"), s.get("alone")
    finally:
        gemms.close()
        lt.close()
    case.check(precision, batched, alone)


@CASES
def test_a_batch_of_one_planned_alone_is_a_batch_of_k_planned_alone(gpu_device, stream, workspace, seed, precision,
                                                                    product, b_shared):
    """Two handles, each choosing its algorithm: one plans only the batch of K, the other only the
    batch of one with every stride 0 (as a run of one model passes them)."""
    from graphtrain.libs.cublaslt import Lt, LtGemms

    case = Case(seed, precision, product, b_shared)
    lt_packed, lt_alone = (Lt(workspace, WORKSPACE_BYTES, arch=gpu_device.arch),
                           Lt(workspace, WORKSPACE_BYTES, arch=gpu_device.arch))
    packed, alone = LtGemms(lt_packed, stream, precision), LtGemms(lt_alone, stream, precision)
    try:
        # (The algorithm structs are not compared byte for byte: past the configuration, cuBLASLt
        # 13.1 keeps bytes of its own there that differ from handle to handle on an H100.)
        case.plan(packed, K, case.strides)
        case.plan(alone, 1, (0, 0, 0))
        with outputs(stream, case) as s:
            case.run(packed, K, case.strides, s["a"], s["b"], s["batched"])
            case.run_each(alone, (0, 0, 0), s["a"], s["b"], s["alone"])
            batched, alone_out = s.get("batched"), s.get("alone")
    finally:
        for closing in (packed, alone, lt_packed, lt_alone):
            closing.close()
    case.check(precision, batched, alone_out)


def test_the_preferred_configurations_are_among_the_heuristics_answers_here(gpu_device, workspace):
    """Each of PREFERRED_CONFIGS' entries for this GPU is chosen for its shape: the heuristic of
    this cuBLASLt still proposes it (where it no longer does, the table is stale and the rule's
    algorithm runs instead: measure again with scripts/probes/lt_algo_choice.py)."""
    from graphtrain.libs import cublaslt

    preferred = cublaslt.PREFERRED_CONFIGS.get(gpu_device.arch)
    if not preferred:
        pytest.skip(f"no preferred cuBLASLt configurations for {gpu_device.arch}")
    lt = cublaslt.Lt(workspace, WORKSPACE_BYTES, arch=gpu_device.arch)
    try:
        for shape, config in preferred.items():
            assert cublaslt.algo_config(lt, cublaslt.choose_algo(lt, shape)) == config, shape
    finally:
        lt.close()
