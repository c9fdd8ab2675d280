"""Launchers for fused.cu: the loss step of a batch, the bf16 batch gather, the bias SGD."""

from __future__ import annotations

from graphtrain.kernels import KernelFile
from graphtrain.libs.nvrtc import F32, I32, I64, PTR, U64, kernel

LOSS_THREADS = 256  # one block: 8 warps, a row per warp at a time
GATHER_THREADS = 256  # per row copied
SGD_THREADS, SGD_BLOCKS = 256, 132  # a grid-stride pass over the packed parameters
MAX_CLASSES = 32  # a row's classes are the lanes of one warp


class Fused(KernelFile):
    stem = "fused"
    defines = {"LOSS_THREADS": LOSS_THREADS}
    _loss_args = (PTR, PTR, PTR, PTR, F32, I32, I32, PTR, I32, PTR, U64, PTR)
    _loss_step_f32 = kernel("loss_step_f32", *_loss_args)
    _loss_step_bf16 = kernel("loss_step_bf16", *_loss_args)
    _gather_batch_bf16 = kernel("gather_batch_bf16", PTR, PTR, PTR, PTR, I32, PTR, PTR)
    _sgd_bias_refresh = kernel("sgd_bias_refresh", PTR, PTR, PTR, I64, F32, PTR, PTR, I64)

    def loss_step(self, stream, logits: int, y: int, dlogits: int, bias: int, lr: float, rows: int, classes: int,
                  totals: int, measure: bool, cursor: int, bf16: bool = False, loop: int = 0,
                  steps_left: int = 0) -> None:
        """From the logits: dlogits = (softmax − onehot)/rows (fp32, or bf16), bias −= lr·Σ_r dlogits
        (bias = 0: none), totals += (Σ loss, #correct) when measuring, cursor += rows; inside a
        device loop (steps_left ≠ 0) also the loop's condition: one step fewer, go on while > 0."""
        launch = self._loss_step_bf16 if bf16 else self._loss_step_f32
        launch(stream, 1, LOSS_THREADS, logits, y, dlogits, bias, lr, rows, classes, totals, measure, cursor,
               loop, steps_left)

    def gather_batch_bf16(self, stream, images: int, labels: int, order: int, cursor: int, features: int,
                          rows: int, x: int, y: int) -> None:
        """x[r] = bf16(images[order[*cursor + r]]), y[r] = labels[order[*cursor + r]]."""
        self._gather_batch_bf16(stream, rows, GATHER_THREADS, images, labels, order, cursor, features, x, y)

    def sgd_bias_refresh(self, stream, bias: int, dbias: int, bias16: int, n_bias: int, lr: float,
                         weights: int, weights16: int, n_weights: int) -> None:
        """bias −= lr·dbias over n_bias packed floats (and bias16 = bf16(bias) unless 0), then
        weights16 = bf16(weights) over n_weights packed floats."""
        self._sgd_bias_refresh(stream, SGD_BLOCKS, SGD_THREADS, bias, dbias, bias16, n_bias, lr, weights,
                               weights16, n_weights)
