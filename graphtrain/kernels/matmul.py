"""Launcher for matmul.cu: the baseline's untiled matrix product."""

from __future__ import annotations

from graphtrain.kernels import F32, I32, PTR, KernelFile, ceil_div, kernel

TILE = 16  # a TILE×TILE block of threads computes a TILE×TILE block of C, one element each


class Matmul(KernelFile):
    stem = "matmul"
    _gemm_naive = kernel("gemm_naive", I32, I32, I32, I32, I32, F32, PTR, I32, PTR, I32, F32, PTR, I32)

    def gemm(self, stream, transa: bool, transb: bool, m: int, n: int, k: int, alpha: float,
             a: int, lda: int, b: int, ldb: int, beta: float, c: int, ldc: int) -> None:
        """Row-major C (m×n) = alpha·op(A)·op(B) + beta·C: the same arguments as Cublas.gemm."""
        self._gemm_naive(stream, (ceil_div(n, TILE), ceil_div(m, TILE), 1), (TILE, TILE, 1),
                         transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
