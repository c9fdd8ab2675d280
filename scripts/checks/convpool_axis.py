"""convpool_tc.cu's passes on a model axis, for compute-sanitizer: the speedrun's two conv layers,
MODELS models of N samples each (the forward's and backward data's blocks looping over rounds of
samples, the backward data at a pack's m-tiles an item, the weight gradient on TC_REDUCE_SLICES
blocks a model, each adding several chunks and copying its next sample ahead), on seeded random
inputs; prints each output's checksum.
Usage: python3 scripts/checks/convpool_axis.py [MODELS] [N]"""

import sys

import numpy as np

from graphtrain.kernels import MODEL_STRIDE_ALIGNMENT, ceil_div
from graphtrain.kernels.convpool_tc import ConvPoolTc
from graphtrain.libs import cuda

models = int(sys.argv[1]) if len(sys.argv) > 1 else 34
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
device = cuda.open_device()
stream = cuda.Stream()
rng = np.random.default_rng(0)
f32 = np.float32
for c, h, k, outs in ((1, 28, 5, 24), (24, 12, 3, 32)):
    cp = ConvPoolTc(device, c, h, h, k, 2, outs, models=models)
    if cp.weight_grad_blocks(n, models) == cp.chunks(n):
        raise SystemExit(f"{models} models of {n} samples: the weight gradient would not loop over chunks")
    ho = (h - k + 1) // 2
    # one model's buffers, each 256-byte aligned; model m's at m·stride (the model axis's layout)
    layout = {"x": ((n, c, h, h), f32), "w": ((outs, c, k, k), f32), "b": ((outs,), f32),
              "out": ((n, outs, ho, ho), f32), "arg": ((n, outs, ho, ho), np.uint8),
              "dout": ((n, outs, ho, ho), f32), "partial": ((outs * cp.chunks(n) * (cp.taps + 1),), f32),
              "dw": ((outs * cp.taps,), f32), "db": ((outs,), f32), "dx": ((n, c, h, h), f32)}
    offset, at = {}, 0
    for name, (shape, dtype) in layout.items():
        offset[name] = at
        at += ceil_div(int(np.prod(shape)) * np.dtype(dtype).itemsize, MODEL_STRIDE_ALIGNMENT) * MODEL_STRIDE_ALIGNMENT
    stride = at
    base = cuda.malloc(models * stride)
    try:
        for m in range(models):
            for name in ("x", "w", "b", "dout"):
                shape, dtype = layout[name]
                cuda.copy_to_device(base + m * stride + offset[name], rng.standard_normal(shape).astype(dtype), stream)
        p = {name: base + offset[name] for name in layout}
        axis = {"models": models, "model_stride": stride}
        cp.forward(stream, p["x"], p["w"], p["b"], p["out"], p["arg"], n, outs, h, h, **axis)
        cp.weight_grad(stream, p["x"], p["dout"], p["arg"], p["partial"], p["dw"], p["db"], n, outs, h, h, **axis)
        if c > 1:
            cp.backward_data(stream, p["dout"], p["arg"], p["w"], p["dx"], n, outs, h, h, **axis)
        for name in ("out", "dw", "db") + (("dx",) if c > 1 else ()):
            shape, dtype = layout[name]
            total = sum(float(np.abs(cuda.copy_to_host(base + m * stride + offset[name], np.empty(shape, dtype),
                                                       stream)).sum()) for m in (0, models - 1))
            print(f"{c}→{outs} {k}×{k}: {name} {total:.6g}")
    finally:
        stream.synchronize()
        cuda.free(base)
        cp.close()
