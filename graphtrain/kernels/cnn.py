"""Launchers for cnn.cu: bias + max-pool + ReLU and its backward pass, the conv bias gradient,
the loss step of a batch whose valid rows the device knows, the count of correct predictions."""

from __future__ import annotations

from graphtrain.kernels import I32, PTR, KernelFile, ceil_div, kernel

THREADS = 256  # the elementwise kernels: one thread per element
REDUCE_THREADS = 256  # channel_bias_grad and softmax_xent_step: one block, a fixed-order tree


FIRST_THREADS = 256
FIRST_CHUNK = 16  # samples per block of first_conv_weight_grad
MAX_FIRST_TAPS = 32  # C·k·k accumulators in registers
MAX_FIRST_SHARED = 48 * 1024  # one image and every filter, within the default shared memory


def first_layer_fits(c: int, h: int, w: int, outs: int, k: int, stride: int, padding: int) -> bool:
    """Whether the first conv layer can run as first_conv_* (else it goes through cuDNN)."""
    return (stride == 1 and padding == 0 and c * k * k <= MAX_FIRST_TAPS
            and 4 * (c * h * w + outs * c * k * k) <= MAX_FIRST_SHARED)


class Cnn(KernelFile):
    stem = "cnn"
    defines = {"CNN_REDUCE_THREADS": REDUCE_THREADS, "FIRST_C": 1, "FIRST_K": 5, "FIRST_POOL": 2}
    _pool_bias_relu = kernel("pool_bias_relu", PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32, I32, I32)
    _pool_relu_backward = kernel("pool_relu_backward", PTR, PTR, PTR, I32, I32, I32, I32, I32, I32, I32)
    _channel_bias_grad = kernel("channel_bias_grad", PTR, PTR, PTR, I32, I32, I32, I32)
    _softmax_xent_step = kernel("softmax_xent_step", PTR, PTR, PTR, PTR, I32, I32, I32, PTR)
    _count_correct = kernel("count_correct", PTR, PTR, I32, I32, PTR)
    _first_conv_pool_forward = kernel("first_conv_pool_forward", PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32)
    _first_conv_weight_grad = kernel("first_conv_weight_grad", PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32, I32,
                                     I32)
    _first_conv_reduce = kernel("first_conv_reduce", PTR, PTR, PTR, I32, I32)

    def __init__(self, device, first_layer: tuple[int, int, int] = (1, 5, 2)):
        """`first_layer`: (input channels, kernel size, pool) of the layer first_conv_* compile for."""
        super().__init__(device, dict(zip(("FIRST_C", "FIRST_K", "FIRST_POOL"), first_layer)))
        self.first_c, self.first_k, self.first_pool = first_layer

    @staticmethod
    def first_chunks(n: int) -> int:
        return ceil_div(n, FIRST_CHUNK)

    def first_conv_pool_forward(self, stream, x: int, w: int, b: int, out: int, arg: int, n: int, outs: int, h: int,
                                wd: int, pool: int, out_nhwc: bool) -> None:
        """out = ReLU(maxpool(conv(x, w) + b)) with each window's argmax, the conv never stored."""
        if pool != self.first_pool:
            raise ValueError(f"first_conv_* are compiled for a {self.first_pool}x{self.first_pool} pool, not {pool}")
        shared = 4 * (self.first_c * h * wd + outs * self.first_c * self.first_k ** 2)
        self._first_conv_pool_forward(stream, n, FIRST_THREADS, x, w, b, out, arg, outs, h, wd, pool, out_nhwc,
                                      shared_bytes=shared)

    def first_conv_weight_grad(self, stream, x: int, dout: int, arg: int, partial: int, dw: int, db: int, n: int,
                               outs: int, h: int, wd: int, pool: int, nhwc: bool) -> None:
        """dw, db of that layer from its pooled gradient: per-chunk partial sums, then their sum."""
        chunks = self.first_chunks(n)
        self._first_conv_weight_grad(stream, (outs, chunks, 1), REDUCE_THREADS, x, dout, arg, partial, n, outs, h,
                                     wd, pool, FIRST_CHUNK, nhwc)
        taps = self.first_c * self.first_k ** 2 + 1
        self._first_conv_reduce(stream, ceil_div(outs * taps, THREADS), THREADS, partial, dw, db, outs, chunks)

    def pool_bias_relu(self, stream, conv: int, bias: int, out: int, arg: int, n: int, c: int, h: int, w: int,
                       pool: int, conv_nhwc: bool, out_nhwc: bool) -> None:
        """out = ReLU(maxpool(conv + b)) (n×c×h×w → n×c×h/pool×w/pool), arg = each window's argmax
        or 255 where the ReLU zeroed it; each tensor NHWC or NCHW as its flag says."""
        count = n * c * (h // pool) * (w // pool)
        self._pool_bias_relu(stream, ceil_div(count, THREADS), THREADS, conv, bias, out, arg, n, c, h, w, pool,
                             conv_nhwc, out_nhwc)

    def pool_relu_backward(self, stream, dout: int, arg: int, dconv: int, n: int, c: int, h: int, w: int,
                           pool: int, conv_nhwc: bool, out_nhwc: bool) -> None:
        """dconv (n×c×h×w) = dout routed to each window's argmax where the ReLU passed, 0 elsewhere."""
        self._pool_relu_backward(stream, ceil_div(n * c * h * w, THREADS), THREADS, dout, arg, dconv, n, c, h, w, pool,
                                 conv_nhwc, out_nhwc)

    def channel_bias_grad(self, stream, dout: int, arg: int, db: int, n: int, c: int, hw: int, nhwc: bool) -> None:
        """db[c] = Σ over samples and pooled positions of dout where the ReLU passed."""
        self._channel_bias_grad(stream, c, REDUCE_THREADS, dout, arg, db, n, c, hw, nhwc)

    def softmax_xent_step(self, stream, logits: int, y: int, dlogits: int, cursor: int, batch: int,
                          epoch_samples: int, classes: int, loss_sum: int = 0) -> None:
        """dlogits of the batch's valid rows (zero for the rows past the epoch's end), the cursor
        advanced by the valid rows, Σ loss added to loss_sum unless 0."""
        self._softmax_xent_step(stream, 1, REDUCE_THREADS, logits, y, dlogits, cursor, batch, epoch_samples, classes,
                                loss_sum)

    def count_correct(self, stream, logits: int, labels: int, rows: int, classes: int, correct: int) -> None:
        """*correct += the rows whose first largest logit is their label."""
        self._count_correct(stream, ceil_div(rows, THREADS), THREADS, logits, labels, rows, classes, correct)
