"""`bf16`: the fused step on tensor cores, bf16 operands with fp32 accumulation and master weights.

fp32 products run on the GPU's CUDA cores; bf16 ones on its tensor cores, many times faster.
Every hidden layer's product here reads bf16 operands and accumulates in fp32:

    the batch      gathered straight into bf16
    activations    the hidden layers write bf16 (the bias from a bf16 copy, as cuBLASLt wants
                   for a bf16 output); the head reads them and keeps fp32: logits, softmax,
                   loss and dlogits
    dX             bf16, masked by the ReLU, its bias gradient summed in fp32
    weights        fp32 masters, which the fused SGD products update in place (bf16 A and B,
                   fp32 C with β = 1); the forward and dX products read bf16 copies, refreshed
                   with the bf16 biases by the kernel that updates the biases, at the end of a step

The rounding is bf16's 8 bits of mantissa on the operands only: sums and weights keep fp32, so
the loss curve follows the fp32 rungs' (the test accuracy is measured with the fp32 master
weights). Softmax regression has no product wide enough for tensor cores (its head is the whole
model, fp32 in the fused kernels), so there this rung is the fused one; the nodes per step are
the fused rung's.
"""

from __future__ import annotations

import numpy as np

from graphtrain.libs.cublaslt import R_16BF
from graphtrain.stages.fused import FusedStage

BF16 = np.uint16  # the arena holds bf16 values as their 16 bits


class Bf16Stage(FusedStage):
    name = "bf16"
    summary = "bf16 tensor-core operands, fp32 accumulation and fp32 master weights"
    AB, ACT = R_16BF, R_16BF

    @classmethod
    def precision_run(cls, config, chosen: str) -> str:
        # bf16 operands are read only by the hidden layers' products (AB); softmax regression is
        # all head, the fused rung's fp32 kernels (reserve_extra and end_step skip it).
        return chosen if config.hidden else "fp32"

    def reserve_extra(self, arena) -> None:
        super().reserve_extra(arena)
        cfg, rows = self.config, self.config.batch
        self.x16 = self.w16 = self.b16 = None
        self.h16 = [arena.reserve(f"h{i}_16", (rows, d), BF16) for i, d in enumerate(cfg.dims[1:-1], 1)]
        self.dh16 = [arena.reserve(f"dh{i}_16", (rows, d), BF16) for i, d in enumerate(cfg.dims[1:-1], 1)]
        if not self.h16:
            return  # softmax regression: the fp32 head gathers its own batch, no bf16 operand
        self.x16 = arena.reserve("x16", (rows, cfg.in_features), BF16)
        # Copies of the hidden layers' weights and biases, laid out like the fp32 spans (one index
        # serves both).
        self.w16 = arena.reserve("w16", (self.span(self.w[:-1]),), BF16)
        self.b16 = arena.reserve("b16", (self.span(self.b[:-1]),), BF16) if cfg.bias else None

    def forward_bias(self, i: int) -> int:
        return self.b16.at((self.b[i].offset - self.b[0].offset) // 4)

    def layer_input(self, i: int) -> int:
        return self.x16.ptr if i == 0 else self.h16[i - 1].ptr

    def layer_grad(self, i: int) -> int:
        return self.dh16[i - 1].ptr

    def product_weight(self, i: int) -> int:
        return self.w16.at((self.w[i].offset - self.w[0].offset) // 4)

    def load_batch(self, offset: int, rows: int) -> None:
        self.fused_cu.gather_batch_bf16(self.stream, self.train_images.ptr, self.train_labels.ptr, self.order.ptr,
                                        self.cursor.ptr, self.config.in_features, rows, self.x16.ptr, self.y.ptr)

    def end_step(self, lr: float | None = None) -> None:
        """Hidden biases −= lr·db, then the bf16 copies of their weights and biases, in one kernel.
        With another recipe the optimizer updates every parameter first, and the kernel (lr 0)
        only refreshes the copies."""
        cfg = self.config
        if self.device_optimizer is not None and lr is None:
            self.device_optimizer.step(self.stream)
            lr = 0.0  # b − 0·db = b: the biases moved with the rest
        if len(self.w) == 1:
            return  # softmax regression: nothing but the head, which keeps fp32
        self.fused_cu.sgd_bias_refresh(
            self.stream, self.b[0].ptr if cfg.bias else 0, self.db[0].ptr if cfg.bias else 0,
            self.b16.ptr if cfg.bias else 0, self.span(self.b[:-1]) if cfg.bias else 0,
            cfg.lr if lr is None else lr, self.w[0].ptr, self.w16.ptr, self.span(self.w[:-1]))

    def upload_initial_weights(self) -> None:
        super().upload_initial_weights()
        if self.config.bias:
            for buf in self.db:
                buf.zero(self.stream)
        self.end_step(lr=0.0)  # the copies of the initial weights; db is zero, so b stays
