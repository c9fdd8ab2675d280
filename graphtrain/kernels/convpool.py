"""Launchers for convpool.cu: one small conv layer with bias, max-pool and ReLU as fused kernels,
compiled once per layer shape (input channels, kernel, pool)."""

from __future__ import annotations

from graphtrain.kernels import I32, PTR, KernelFile, ceil_div, kernel

THREADS = 256
REDUCE_THREADS = 256  # convpool_weight_grad_regs: a tree over the block
MAX_REGISTER_TAPS = 32  # up to this many taps the weight gradient keeps them in registers
CHUNK = 8  # samples per block of the weight gradient
SHARED_LIMIT = 48 * 1024  # the default dynamic shared memory of a block


def fits(c: int, h: int, w: int, outs: int, k: int, stride: int, padding: int, pool: int) -> bool:
    """Whether a layer can run as these kernels: stride 1, no padding, a whole pool window, and
    one sample's input with every filter (forward), or every filter with one sample's pooled
    gradient (backward data), in a block's default shared memory."""
    if stride != 1 or padding != 0 or pool < 1 or h - k + 1 < pool or w - k + 1 < pool:
        return False
    plane = ((h - k + 1) // pool) * ((w - k + 1) // pool)
    filters = outs * c * k * k
    return 4 * (c * h * w + filters) <= SHARED_LIMIT and 4 * (filters + 2 * outs * plane) <= SHARED_LIMIT


class ConvPool(KernelFile):
    stem = "convpool"
    defines = {"CP_C": 24, "CP_K": 3, "CP_P": 2, "CP_REDUCE_THREADS": REDUCE_THREADS}
    _forward = kernel("convpool_forward", PTR, PTR, PTR, PTR, PTR, I32, I32, I32)
    _weight_grad_regs = kernel("convpool_weight_grad_regs", PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32)
    _weight_grad_taps = kernel("convpool_weight_grad_taps", PTR, PTR, PTR, PTR, I32, I32, I32, I32, I32)
    _reduce = kernel("convpool_reduce", PTR, PTR, PTR, I32, I32)
    _backward_data = kernel("convpool_backward_data", PTR, PTR, PTR, PTR, I32, I32, I32)

    def __init__(self, device, c: int, k: int, pool: int):
        super().__init__(device, {"CP_C": c, "CP_K": k, "CP_P": pool})
        self.c, self.k, self.pool = c, k, pool
        self.taps = c * k * k

    @staticmethod
    def chunks(n: int) -> int:
        return ceil_div(n, CHUNK)

    def _plane(self, h: int, w: int) -> int:
        return ((h - self.k + 1) // self.pool) * ((w - self.k + 1) // self.pool)

    def forward(self, stream, x: int, w: int, b: int, out: int, arg: int, n: int, outs: int, h: int,
                wd: int) -> None:
        """out = ReLU(maxpool(conv(x, w) + b)) and each window's argmax, n samples of c×h×wd."""
        shared = 4 * (self.c * h * wd + outs * self.taps)
        self._forward(stream, n, THREADS, x, w, b, out, arg, outs, h, wd, shared_bytes=shared)

    def weight_grad(self, stream, x: int, dout: int, arg: int, partial: int, dw: int, db: int, n: int, outs: int,
                    h: int, wd: int) -> None:
        """dw, db from the pooled gradient dout: per-chunk partial sums (partial: outs × chunks ×
        (taps + 1) floats), then their sum in order."""
        chunks = self.chunks(n)
        if self.taps <= MAX_REGISTER_TAPS:
            self._weight_grad_regs(stream, (outs, chunks, 1), REDUCE_THREADS, x, dout, arg, partial, n, outs, h, wd,
                                   CHUNK)
        else:
            threads = ceil_div(self.taps + 1, 32) * 32
            self._weight_grad_taps(stream, (outs, chunks, 1), threads, x, dout, arg, partial, n, outs, h, wd, CHUNK,
                                   shared_bytes=8 * self._plane(h, wd))
        self._reduce(stream, ceil_div(outs * (self.taps + 1), THREADS), THREADS, partial, dw, db, outs, chunks)

    def backward_data(self, stream, dout: int, arg: int, w: int, dx: int, n: int, outs: int, h: int, wd: int) -> None:
        """dx (n×c×h×wd): the gradient of the layer's input from its pooled gradient."""
        shared = 4 * (outs * self.taps + 2 * outs * self._plane(h, wd))
        self._backward_data(stream, n, THREADS, dout, arg, w, dx, outs, h, wd, shared_bytes=shared)
