"""convpool_tc.cu's passes on a model axis, for compute-sanitizer: the speedrun's two conv layers,
MODELS models of N samples each (the forward's and backward data's blocks looping over rounds of
samples, the backward data at a pack's m-tiles an item, the weight gradient on TC_REDUCE_SLICES
blocks a model, each adding several chunks and copying its next sample ahead), on seeded random
inputs; prints each output's checksum. The first layer runs again through sample indices (each
model's batch read in one image set every model shares) and must give the gathered batch's bits.
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
              "dw": ((outs * cp.taps,), f32), "db": ((outs,), f32), "dx": ((n, c, h, h), f32),
              "samples": ((n,), np.int32)}
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
        def read(name: str, m: int) -> np.ndarray:
            shape, dtype = layout[name]
            return cuda.copy_to_host(base + m * stride + offset[name], np.empty(shape, dtype), stream)

        for name in ("out", "dw", "db") + (("dx",) if c > 1 else ()):
            total = sum(float(np.abs(read(name, m)).sum()) for m in (0, models - 1))
            print(f"{c}→{outs} {k}×{k}: {name} {total:.6g}")
        if c == 1:  # through sample indices: model m's batch is images[samples_m], images[samples_m] its x
            images = rng.standard_normal((3 * n, c, h, h)).astype(f32)
            images_at = cuda.malloc(images.nbytes)
            try:
                cuda.copy_to_device(images_at, images, stream)
                for m in range(models):
                    samples = rng.integers(0, len(images), n).astype(np.int32)
                    cuda.copy_to_device(base + m * stride + offset["samples"], samples, stream)
                    cuda.copy_to_device(base + m * stride + offset["x"], images[samples], stream)
                stream.synchronize()
                runs = []
                for x, through in ((images_at, {"samples": p["samples"]}), (p["x"], {})):
                    cp.forward(stream, x, p["w"], p["b"], p["out"], p["arg"], n, outs, h, h, **axis, **through)
                    cp.weight_grad(stream, x, p["dout"], p["arg"], p["partial"], p["dw"], p["db"], n, outs, h, h,
                                   **axis, **through)
                    runs.append([read(name, m).tobytes() for name in ("out", "arg", "dw", "db") for m in range(models)])
                if runs[0] != runs[1]:
                    raise SystemExit(f"{c}→{outs} {k}×{k}: through sample indices, not the gathered batch's bits")
                print(f"{c}→{outs} {k}×{k}: through sample indices, the gathered batch's bits")
            finally:
                stream.synchronize()
                cuda.free(images_at)
    finally:
        stream.synchronize()
        cuda.free(base)
        cp.close()
