"""Which cuBLASLt algorithm suits the speedrun cnn's hidden-layer products both alone and on a
model axis: every strided batched product a K-model cnn plans, the heuristic's algorithms without
split-K (top HEURISTIC_RESULTS for batch counts 1, 4 and K, merged), each timed at batch 1 and K
(CUDA events over a graph of 50 calls). The chosen algorithm must be one
for every batch count (the packed models' bits are each model's alone), so the table shows what
each candidate costs at both ends.
Usage: python3 scripts/probes/lt_algo_choice.py [--models K] [--precision tf32|fp32]"""

import argparse
import ctypes

from graphtrain import config, data
from graphtrain.libs import cublaslt, cuda
from graphtrain.recipe import normalised
from graphtrain.speedrun import SpeedrunCase
from graphtrain.stages.cnn_device import CnnDevice

parser = argparse.ArgumentParser()
parser.add_argument("--models", type=int, default=64)
parser.add_argument("--precision", default="tf32")
args = parser.parse_args()

planned: list[tuple] = []
plan = cublaslt.LtGemms.plan


def recording_plan(self, *key):
    planned.append((self, key))
    return plan(self, *key)


cublaslt.LtGemms.plan = recording_plan
speedrun = config.preset("speedrun").replace(precision=args.precision)
case = SpeedrunCase.of(speedrun, data.load("mnist"))
mnist = case.data
model = CnnDevice(cuda.open_device(), config.cnn_spec(speedrun), case.recipe, normalised(mnist.train_images),
                  mnist.train_labels, normalised(mnist.test_images), mnist.test_labels, fused=True, nhwc=True,
                  device_loop=True, models=args.models)
s = model.stream
print(f"{len(planned)} products planned", flush=True)


def candidates(lt, shape):
    found_algos = []
    for batch in (1, 4, args.models):
        probe = cublaslt._Plan(lt)
        probe._describe_strided(shape, batch, shape.extents())
        pref = probe._create("cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceDestroy")
        probe._set("cublasLtMatmulPreferenceSetAttribute", pref,
                   [(cublaslt.PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(lt.workspace_bytes)),
                    (cublaslt.PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(0))])
        results, found = (cublaslt.HeuristicResult * 16)(), ctypes.c_int()
        cublaslt.library.check(lt.lib.cublasLtMatmulAlgoGetHeuristic(
            lt.handle, probe.desc, probe.layout_b, probe.layout_a, probe.layout_c, probe.layout_c, pref, 16,
            results, ctypes.byref(found)), "heuristic")
        for rank in range(found.value):
            algo = cublaslt.Algo.from_buffer_copy(results[rank].algo)
            key = bytes(algo)
            for entry in found_algos:
                if entry[0] == key:
                    entry[2].append(f"{batch}:{rank}")
                    break
            else:
                found_algos.append((key, algo, [f"{batch}:{rank}"]))
        probe.close()
    return found_algos


def config_of(lt, algo):
    return "id {} tile {} stages {}".format(*cublaslt.algo_config(lt, algo))


seen = set()
for gemms, key in planned:
    transa, transb, m, n, k, lda, sa, ldb, sb, ldc, sc, batch = key
    shape = cublaslt.GemmShape(transa, transb, m, n, k, lda, ldb, ldc, gemms.precision)
    if (shape, sa, sb, sc) in seen:
        continue
    seen.add((shape, sa, sb, sc))
    lt = gemms.lt
    chosen = bytes(gemms.algo(shape))
    bufs = []  # the run's strides (a model's whole arena apart), filled with 0x3c3c3c3c ≈ 0.0115
    for stride in (sa, sb, sc):
        ptr = cuda.malloc(4 * stride * args.models)
        cuda.memset(ptr, 0x3C, 4 * stride * args.models, s)
        bufs.append(ptr)
    print(f"\n{shape} strides {(sa, sb, sc)}")
    print(f"{'algorithm':42} {'ranks (batch:rank)':28} {'1 (µs)':>8} {f'{args.models} (µs)':>9}")
    for akey, algo, ranks in candidates(lt, shape):
        row = []
        for count in (1, args.models):
            try:
                mm = cublaslt.StridedLtMatmul(lt, shape, count, sa, sb, sc, algo)
            except cublaslt.AlgoNotApplicableError:
                row.append(float("nan"))
                continue
            row.append(cuda.replay_us(lambda: mm(*bufs, 1.0, 0.0, int(s.handle)), s))
            mm.close()
        mark = " *" if akey == chosen else ""
        print(f"{config_of(lt, algo) + mark:42} {' '.join(ranks):28} {row[0]:8.2f} {row[1]:9.2f}")
    for ptr in bufs:
        cuda.free(ptr)
