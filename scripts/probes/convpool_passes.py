"""GPU time of each pass of the speedrun's two fused conv layers, fp32 (convpool.cu) against
TF32 tensor cores (convpool_tc.cu) under a few launch shapes: each pass captured 50 times into
a graph and timed with CUDA events. Batch 256 (training) and 10000 (the test set's forward).
Usage: python3 scripts/probes/convpool_passes.py"""

import numpy as np

from graphtrain.kernels import convpool_tc
from graphtrain.kernels.convpool import ConvPool
from graphtrain.kernels.convpool_tc import ConvPoolTc
from graphtrain.libs import cuda
from graphtrain.libs.memory import Arena

LAYERS = [("conv1", 1, 28, 28, 24, 5), ("conv2", 24, 12, 12, 32, 3)]
REPS = 50
device = cuda.open_device()
s = cuda.Stream()


def passes(cp, c, h, w, outs, k, first, n_eval=10_000) -> dict:
    rng = np.random.default_rng(0)
    b, ho, wo = 256, (h - k + 1) // 2, (w - k + 1) // 2
    arena = Arena()
    bufs = {"x": ((n_eval, c, h, w), np.float32), "w": ((outs, c, k, k), np.float32), "b": ((outs,), np.float32),
            "out": ((n_eval, outs, ho, wo), np.float32), "arg": ((n_eval, outs, ho, wo), np.uint8),
            "dout": ((b, outs, ho, wo), np.float32), "dx": ((b, c, h, w), np.float32),
            "partial": ((outs * cp.chunks(b) * (cp.taps + 1),), np.float32), "dw": ((outs * cp.taps,), np.float32),
            "db": ((outs,), np.float32)}
    d = {name: arena.reserve(name, shape, dtype) for name, (shape, dtype) in bufs.items()}
    arena.allocate()
    for name in ("x", "w", "b", "dout"):
        d[name].upload(rng.standard_normal(d[name].shape).astype(np.float32) * 0.2, s)
    p = {key: buf.ptr for key, buf in d.items()}

    def us(enqueue) -> float:
        return cuda.replay_us(enqueue, s, REPS)

    times = {
        "forward 256": us(lambda: cp.forward(s, p["x"], p["w"], p["b"], p["out"], p["arg"], b, outs, h, w)),
        "weight+bias grad": us(lambda: cp.weight_grad(s, p["x"], p["dout"], p["arg"], p["partial"], p["dw"], p["db"],
                                                      b, outs, h, w)),
        "forward 10000": us(lambda: cp.forward(s, p["x"], p["w"], p["b"], p["out"], p["arg"], n_eval, outs, h, w)),
    }
    if not first:
        times["input grad"] = us(lambda: cp.backward_data(s, p["dout"], p["arg"], p["w"], p["dx"], b, outs, h, w))
    s.synchronize()
    arena.close()
    return times


def row(label, times):
    print(f"{label:40} " + "  ".join(f"{k} {v:7.2f}" for k, v in times.items()))


print("µs per pass")
for name, c, h, w, outs, k in LAYERS:
    first = name == "conv1"
    cp = ConvPool(device, c, k, 2, outs)
    row(f"{name} fp32 convpool.cu", passes(cp, c, h, w, outs, k, first))
    cp.close()
    for chunk in (1, 2, 4):
        for per_sm in (4,):
            convpool_tc.WEIGHT_GRAD_SAMPLES = convpool_tc.WEIGHT_GRAD_SAMPLES_ONE_CHANNEL = chunk
            convpool_tc.BLOCKS_PER_SM = per_sm
            cp = ConvPoolTc(device, c, h, w, k, 2, outs)
            row(f"{name} tf32 chunk {chunk} blocks/SM {per_sm}", passes(cp, c, h, w, outs, k, first))
            cp.close()
