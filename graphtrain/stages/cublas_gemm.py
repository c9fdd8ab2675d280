"""`cublas`: every matrix product through cublasGemmEx instead of the naive kernel.

The same row-major call as before; the binding maps it onto column-major cuBLAS by the
transpose trick (row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ). float32 compute, no TF32, so
the results stay within float32 rounding of the reference.
"""

from __future__ import annotations

import numpy as np

from graphtrain.libs import cublas
from graphtrain.libs.cublas import Cublas
from graphtrain.stages.fewer_syncs import FewerSyncsStage

WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommended workspace on Hopper; it comes from the arena


class CublasStage(FewerSyncsStage):
    name = "cublas"
    summary = "all matrix products through cublasGemmEx (row-major via the transpose trick)"
    uses = FewerSyncsStage.uses - {"matmul"} | {"cublas"}

    def reserve_extra(self, arena) -> None:
        super().reserve_extra(arena)
        self.workspace = arena.reserve("cublas_workspace", (WORKSPACE_BYTES,), np.uint8) if self.needs("cublas") else None

    def setup_extra(self) -> None:
        super().setup_extra()
        self.blas = None
        if self.needs("cublas"):
            self.blas = Cublas(self.stream, self.workspace.ptr, self.workspace.nbytes,
                               precision=self.cublas_precision())

    def cublas_precision(self) -> str:
        """cuBLAS's math mode: the row's precision (fp32, or tf32 with --precision tf32)."""
        return self.precision

    def gemm(self, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) -> None:
        self.blas.gemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def library_versions(self) -> dict:
        return {**super().library_versions(), **({"cublas": cublas.version()} if self.needs("cublas") else {})}

    def close(self) -> None:
        if getattr(self, "blas", None) is not None:
            self.blas.close()
        super().close()
