"""Where a speedrun step's GPU time goes: each launch of the step captured 50 times into a graph
of its own and timed with CUDA events (GPU time, no host in it), then the whole step replayed
as one graph, and the whole run (device loop) as the speedrun times it. With --models K, the step
of K models on one model axis (a sweep's pack, graphtrain.stages.cnn_pack's mode "axis"): each
launch trains all K; the per-launch and whole-step times only.
With --once, each launch of one step runs once, eagerly, after a warm-up step, and nothing is timed:
the run a kernel profiler attaches to (scripts/probes/cnn_step_ncu.sh).
Usage: python3 scripts/probes/cnn_step_profile.py [--precision tf32|fp32] [--body N] [--models K] [--min-blocks B] [--once]"""

import argparse
import shlex
import sys
import time

from graphtrain import config, data, environment, report
from graphtrain.libs import cuda, nvrtc
from graphtrain.recipe import normalised
from graphtrain.speedrun import SpeedrunCase
from graphtrain.stages.cnn_device import CnnDevice

parser = argparse.ArgumentParser()
parser.add_argument("--precision", default="tf32")
parser.add_argument("--body", type=int, default=5)
parser.add_argument("--cudnn", action="store_true", help="the conv layers through cuDNN, not convpool.cu")
parser.add_argument("--nchw", action="store_true", help="cuDNN's convolutions on NCHW tensors")
parser.add_argument("--models", type=int, default=1, help="models on one model axis (the fused conv kernels)")
parser.add_argument("--min-blocks", type=int, default=0,
                    help="convpool_tc.cu's TC_MIN_BLOCKS (blocks an SM its forward and weight gradient are built for; 0: the default)")
parser.add_argument("--once", action="store_true", help="run one step's launches once each, untimed (for ncu)")
args = parser.parse_args()
if args.min_blocks:
    from graphtrain.kernels import convpool_tc

    convpool_tc.MIN_BLOCKS = args.min_blocks
speedrun = config.preset("speedrun").replace(precision=args.precision)
case = SpeedrunCase.of(speedrun, data.load("mnist"))
plan, mnist = case.plan(speedrun, 0), case.data
initial = [a.copy() for layer in plan.initial for a in (layer.w, layer.b)]
model = CnnDevice(cuda.open_device(), config.cnn_spec(speedrun), case.recipe, normalised(mnist.train_images),
                  mnist.train_labels, normalised(mnist.test_images), mnist.test_labels, fused=not args.cudnn,
                  nhwc=not args.nchw, device_loop=True, models=args.models)
s = model.stream
for k in range(args.models):
    model.load(initial, plan.orders, model=k)
model.reset(s)
model.record_step(s)
s.synchronize()
start, end = cuda.Event(), cuda.Event()
if args.once:
    for _, op in model.step_ops(s):
        op()
    s.synchronize()
    sys.exit(0)


REPS = 50
env = {**environment.host(), **environment.gpu(model.device), "nvrtc": nvrtc.version()}
print(report.script_header(f"the speedrun cnn's step ({args.precision}, {args.models} model(s) a launch): GPU time by launch",
                           env, shlex.join(["python3", *sys.argv]),
                           [f"Each launch captured {REPS} times into a graph of its own and timed with CUDA events "
                            "(µs a launch, all models); then the whole step as one graph"]))
print("```")
print(f"{'launch':32} {'µs':>8}")
total = 0.0
for name, op in model.step_ops(s):
    us = cuda.replay_us(op, s, REPS)
    total += us
    print(f"{name:32} {us:8.2f}")
print(f"{'sum':32} {total:8.2f}")
print(f"{'one step graph, replayed':32} {cuda.replay_us(lambda: model.record_step(s), s, 20):8.2f}")
print(f"{'the evaluation, replayed':32} {cuda.replay_us(lambda: model.record_eval(s), s, 3):8.2f}"
      f"  ({model.num_test} test images in passes of {model.eval_rows})")
if args.models > 1:
    print(f"({args.models} models a launch)\n```")
    sys.exit(0)
print("```")
print("algorithms:", model.environment()["cudnn_algorithms"])
for i, conv_plan in enumerate(model.train_plans):
    for name, results in (conv_plan.timed.items() if conv_plan else ()):
        print(f"conv{i} {name} timed (algo, status, ms, bytes, deterministic, math):", results)
outer = cuda.Stream()
for rep in range(3):
    model.load(initial, plan.orders)
    t0 = time.perf_counter()
    graph = model.capture_run(case.steps, outer, per_body=args.body)
    t1 = time.perf_counter()
    start.record(outer)
    graph.launch(outer)
    end.record(outer)
    correct = int(model.correct.download(outer)[0])
    t2 = time.perf_counter()
    print(f"device loop (body {args.body}): capture {1e3 * (t1 - t0):.2f} ms, GPU {start.elapsed_ms(end):.2f} ms, "
          f"wall {1e3 * (t2 - t0):.2f} ms, {correct / 100:.2f}%")
    graph.close()
