"""Launchers for convpool.cu: one small conv layer with bias, max-pool and ReLU as fused kernels,
compiled once per layer shape (input channels, kernel, pool). With `models` > 1 the launchers
train that many models at once (graphtrain.kernels' model axis: every buffer per model,
model_stride bytes apart, but a forward's input where `shared_input` says every model reads the
same x)."""

from __future__ import annotations

from graphtrain.kernels import I32, I64, PTR, KernelFile, ceil_div, kernel, model_grid, model_stride_arg

THREADS = 256  # convpool_reduce
SAMPLE_THREADS = 512  # the kernels with a block per sample (a batch of 256 is ~2 blocks an SM: wide blocks)
REDUCE_THREADS = 256  # convpool_weight_grad_regs: a tree over the block
MAX_REGISTER_TAPS = 32  # up to this many taps the weight gradient keeps them in registers
REGS_CHUNK = 8  # samples per block of the register weight gradient (their inputs staged)
TAPS_CHUNK = 2  # samples per block of the per-tap weight gradient
MAX_OUTS = 64  # the per-tap weight gradient keeps one sum per output channel in registers
SHARED_LIMIT = 48 * 1024  # the default dynamic shared memory of a block
BACKWARD_DATA_SHARED = 96 * 1024  # convpool_backward_data: every filter and a padded conv gradient (raised once)
OUT_GROUPS = 4  # the per-tap weight gradient: threads (tap, group of output channels)


def fits(c: int, h: int, w: int, outs: int, k: int, stride: int, padding: int, pool: int, first: bool) -> bool:
    """Whether a layer can run as these kernels: stride 1, no padding, a whole pool window, and
    what each kernel stages within a block's default shared memory: one sample's input with every
    filter (forward), every filter with one sample's conv gradient (backward data, not needed by
    the `first` layer), the inputs of a chunk of samples (the weight gradient)."""
    if stride != 1 or padding != 0 or pool < 1 or h - k + 1 < pool or w - k + 1 < pool or outs > MAX_OUTS:
        return False
    conv = (h - k + 1) * (w - k + 1)
    plane = ((h - k + 1) // pool) * ((w - k + 1) // pool)
    filters, image, taps = outs * c * k * k, c * h * w, c * k * k
    weight_grad = REGS_CHUNK * image if taps <= MAX_REGISTER_TAPS else image + 2 * outs * plane
    return (4 * (image + filters) <= SHARED_LIMIT and 4 * weight_grad <= SHARED_LIMIT
            and (first or 4 * (filters + outs * (h + k - 1) * (w + k - 1)) <= BACKWARD_DATA_SHARED))


class ConvPool(KernelFile):
    stem = "convpool"
    headers = ("model_axis.cuh",)
    defines = {"CP_C": 24, "CP_K": 3, "CP_P": 2, "CP_OUTS": 32, "CP_REDUCE_THREADS": REDUCE_THREADS,
               "CP_OUT_GROUPS": OUT_GROUPS}
    note = "fp32 (convpool.cu's fused conv+bias+pool+ReLU kernels)"
    reads_samples = False  # its kernels read a gathered batch (convpool_tc's do not need one)
    _convpool_forward = kernel("convpool_forward", PTR, PTR, PTR, PTR, PTR, I32, I32, I32, I64, I64)
    _convpool_weight_grad_regs = kernel("convpool_weight_grad_regs", PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32,
                                        I64)
    _convpool_weight_grad_taps = kernel("convpool_weight_grad_taps", PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32,
                                        I64)
    _convpool_reduce = kernel("convpool_reduce", PTR, PTR, PTR, I32, I32, I64)
    _convpool_backward_data = kernel("convpool_backward_data", PTR, PTR, PTR, PTR, I32, I32, I32, I64,
                                     max_shared_bytes=BACKWARD_DATA_SHARED)

    def __init__(self, device, c: int, k: int, pool: int, outs: int):
        super().__init__(device, {"CP_C": c, "CP_K": k, "CP_P": pool, "CP_OUTS": outs})
        self.c, self.k, self.pool, self.outs = c, k, pool, outs
        self.taps = c * k * k
        self.chunk = REGS_CHUNK if self.taps <= MAX_REGISTER_TAPS else TAPS_CHUNK

    def chunks(self, n: int) -> int:
        """Blocks (chunks of samples) of the weight gradient: its partial sums are outs × chunks × (taps + 1)."""
        return ceil_div(n, self.chunk)

    def _plane(self, h: int, w: int) -> int:
        return ((h - self.k + 1) // self.pool) * ((w - self.k + 1) // self.pool)

    def forward(self, stream, x: int, w: int, b: int, out: int, arg: int, n: int, outs: int, h: int,
                wd: int, models: int = 1, model_stride: int = 0, shared_input: bool = False) -> None:
        """out = ReLU(maxpool(conv(x, w) + b)) and each window's argmax, n samples of c×h×wd;
        `shared_input`: every model reads the same x (the test images)."""
        stride = model_stride_arg(models, model_stride)
        shared = 4 * (self.c * h * wd + outs * self.taps)
        self._convpool_forward(stream, model_grid(n, models), SAMPLE_THREADS, x, w, b, out, arg, outs, h, wd,
                               0 if shared_input else stride, stride, shared_bytes=shared)

    def weight_grad(self, stream, x: int, dout: int, arg: int, partial: int, dw: int, db: int, n: int, outs: int,
                    h: int, wd: int, models: int = 1, model_stride: int = 0) -> None:
        """dw, db from the pooled gradient dout: per-chunk partial sums (partial: outs × chunks ×
        (taps + 1) floats), then their sum in order."""
        stride = model_stride_arg(models, model_stride)
        chunks, image = self.chunks(n), self.c * h * wd
        if self.taps <= MAX_REGISTER_TAPS:
            self._convpool_weight_grad_regs(stream, model_grid((outs, chunks, 1), models), REDUCE_THREADS, x, dout,
                                            arg, partial, n, outs, h, wd, self.chunk, stride,
                                            shared_bytes=4 * self.chunk * image)
        else:
            threads = ceil_div(self.taps + 1, 32) * 32 * OUT_GROUPS
            self._convpool_weight_grad_taps(stream, model_grid(chunks, models), threads, x, dout, arg, partial, n,
                                            outs, h, wd, self.chunk, stride,
                                            shared_bytes=4 * (image + 2 * outs * self._plane(h, wd)))
        self._convpool_reduce(stream, model_grid(ceil_div(outs * (self.taps + 1), THREADS), models), THREADS, partial,
                              dw, db, outs, chunks, stride)

    def backward_data(self, stream, dout: int, arg: int, w: int, dx: int, n: int, outs: int, h: int, wd: int,
                      models: int = 1, model_stride: int = 0) -> None:
        """dx (n×c×h×wd): the gradient of the layer's input from its pooled gradient."""
        stride = model_stride_arg(models, model_stride)
        shared = 4 * (outs * self.taps + outs * (h + self.k - 1) * (wd + self.k - 1))  # padded by k − 1
        self._convpool_backward_data(stream, model_grid(n, models), SAMPLE_THREADS, dout, arg, w, dx, outs, h, wd,
                                     stride, shared_bytes=shared)
