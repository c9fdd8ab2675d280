"""`cublas`: every matrix product through cublasGemmEx instead of the naive kernel.

The same row-major call as before; the binding maps it onto column-major cuBLAS by the
transpose trick (row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ). float32 compute, no TF32, so
the results stay within float32 rounding of the reference (`--precision tf32` puts the products
on TF32 tensor cores). The products part is CublasProducts: a handle bound to the rung's stream
and a workspace of its own in the arena, so that a captured product never allocates.
"""

from __future__ import annotations

import numpy as np

from graphtrain.libs import cublas
from graphtrain.libs.cublas import Cublas
from graphtrain.libs.memory import Arena
from graphtrain.stages.baseline import BaselineStage
from graphtrain.stages.chain_parts import ProductsPart
from graphtrain.stages.fewer_syncs import FewerSyncsStage

WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommended workspace on Hopper; it comes from the arena


class CublasProducts(ProductsPart):
    """Every product through cublasGemmEx, in the rung's precision (cuBLAS's math mode: fp32, or
    tf32 with --precision tf32)."""

    uses = frozenset({"cublas"})

    def reserve(self, arena: Arena) -> None:
        self.workspace = arena.reserve("cublas_workspace", (WORKSPACE_BYTES,), np.uint8)

    def open(self, stage: BaselineStage) -> None:
        self.blas = Cublas(stage.stream, self.workspace.ptr, self.workspace.nbytes, precision=stage.precision)

    def gemm(self, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) -> None:
        self.blas.gemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def library_versions(self) -> dict:
        return {"cublas": cublas.version()}

    def close(self) -> None:
        if getattr(self, "blas", None) is not None:
            self.blas.close()


class CublasStage(BaselineStage):
    name = "cublas"
    summary = "all matrix products through cublasGemmEx (row-major via the transpose trick)"
    parts = FewerSyncsStage.parts.but(products=CublasProducts)
