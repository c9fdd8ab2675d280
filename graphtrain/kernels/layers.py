"""Launchers for layers.cu: the elementwise parts of a linear + ReLU layer and the SGD update;
bias_relu and bias_grad train `models` > 1 models at once when asked (graphtrain.kernels' model
axis: every buffer per model, model_stride bytes apart)."""

from __future__ import annotations

from graphtrain.kernels import F32, I32, I64, PTR, KernelFile, ceil_div, kernel, model_grid, model_stride_arg

THREADS = 256  # one thread per element
BIAS_GRAD_THREADS = 128  # one block per column; its threads stride over the rows


class Layers(KernelFile):
    stem = "layers"
    headers = ("model_axis.cuh",)
    defines = {"BIAS_GRAD_THREADS": BIAS_GRAD_THREADS}
    _bias_relu = kernel("bias_relu", PTR, PTR, I32, I32, I32, I64)
    _relu_backward = kernel("relu_backward", PTR, PTR, I32)
    _bias_grad = kernel("bias_grad", PTR, PTR, I32, I32, I64)
    _sgd_update = kernel("sgd_update", PTR, PTR, F32, I32)

    def bias_relu(self, stream, y: int, b: int, rows: int, cols: int, relu: bool, models: int = 1,
                  model_stride: int = 0) -> None:
        """y = ReLU(y + b) (or y + b without relu), b broadcast over the rows; b = 0: no bias."""
        stride = model_stride_arg(models, model_stride)
        self._bias_relu(stream, model_grid(ceil_div(rows * cols, THREADS), models), THREADS, y, b, rows, cols, relu,
                        stride)

    def relu_backward(self, stream, dh: int, h: int, n: int) -> None:
        """dh *= (h > 0) over n elements."""
        self._relu_backward(stream, ceil_div(n, THREADS), THREADS, dh, h, n)

    def bias_grad(self, stream, dy: int, db: int, rows: int, cols: int, models: int = 1,
                  model_stride: int = 0) -> None:
        """db[j] = Σ_r dy[r, j], deterministic."""
        stride = model_stride_arg(models, model_stride)
        self._bias_grad(stream, model_grid(cols, models), BIAS_GRAD_THREADS, dy, db, rows, cols, stride)

    def sgd_update(self, stream, w: int, dw: int, lr: float, n: int) -> None:
        """w -= lr · dw over n elements."""
        self._sgd_update(stream, ceil_div(n, THREADS), THREADS, w, dw, lr, n)
