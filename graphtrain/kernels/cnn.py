"""Launchers for cnn.cu: bias + max-pool + ReLU and its backward pass, the conv bias gradient,
the loss step of a batch whose valid rows the device knows, the count of correct predictions.
The last two train or count `models` > 1 models at once when asked (graphtrain.kernels' model
axis: per-model buffers model_stride bytes apart, the test labels shared)."""

from __future__ import annotations

from graphtrain.kernels import I32, I64, PTR, KernelFile, ceil_div, kernel, model_grid, model_stride_arg

THREADS = 256  # the elementwise kernels: one thread per element
REDUCE_THREADS = 256  # channel_bias_grad and softmax_xent_step: one block, a fixed-order tree


class Cnn(KernelFile):
    stem = "cnn"
    headers = ("logits_loss.cuh", "batch_slice.cuh", "model_axis.cuh")
    defines = {"CNN_REDUCE_THREADS": REDUCE_THREADS}
    _pool_bias_relu = kernel("pool_bias_relu", PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32, I32, I32)
    _pool_relu_backward = kernel("pool_relu_backward", PTR, PTR, PTR, I32, I32, I32, I32, I32, I32, I32)
    _channel_bias_grad = kernel("channel_bias_grad", PTR, PTR, PTR, I32, I32, I32, I32)
    _softmax_xent_step = kernel("softmax_xent_step", PTR, PTR, PTR, PTR, I32, I32, I32, PTR, I32, I64)
    _count_correct = kernel("count_correct", PTR, PTR, I32, I32, PTR, I64)

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
                          epoch_samples: int, classes: int, loss_sum: int = 0, ranks: int = 1, models: int = 1,
                          model_stride: int = 0) -> None:
        """dlogits of the batch's valid rows (zero for the rows past the epoch's end), the cursor
        advanced by the valid rows, Σ loss added to loss_sum unless 0. With ranks > 1, `batch`
        is the combined batch and this rank's batch / ranks rows hold its slice (see cnn.cu)."""
        if batch % ranks:
            raise ValueError(f"a combined batch of {batch} rows does not split over {ranks} ranks")
        stride = model_stride_arg(models, model_stride)
        self._softmax_xent_step(stream, model_grid(1, models), REDUCE_THREADS, logits, y, dlogits, cursor, batch,
                                epoch_samples, classes, loss_sum, ranks, stride)

    def count_correct(self, stream, logits: int, labels: int, rows: int, classes: int, correct: int,
                      models: int = 1, model_stride: int = 0) -> None:
        """*correct += the rows whose first largest logit is their label; the labels every model's."""
        stride = model_stride_arg(models, model_stride)
        self._count_correct(stream, model_grid(ceil_div(rows, THREADS), models), THREADS, logits, labels, rows,
                            classes, correct, stride)
