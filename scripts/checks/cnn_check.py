"""A small cnn run through every new kernel (the fused conv layers: on the tensor cores at tf32,
convpool.cu's fp32 ones with `fp32`; pool, loss step, bias gradients, optimizer, count), cuDNN's
passes and both captured forms (the step graph replayed, the device loop), for
compute-sanitizer: synthetic data, 600 training samples (a tail batch), 300 test samples.
Usage: python3 scripts/checks/cnn_check.py [optimizer] [cudnn] [fp32] [no-loop]"""

import sys

import numpy as np

from graphtrain import reference_cnn as R
from graphtrain.config import preset
from graphtrain.libs import cuda
from graphtrain.plan import RunPlan
from graphtrain.recipe import Recipe
from graphtrain.stages.cnn_device import CnnDevice

kind = sys.argv[1] if len(sys.argv) > 1 else "adam"
fused, loop = "cudnn" not in sys.argv, "no-loop" not in sys.argv
rng = np.random.default_rng(0)
means = rng.standard_normal((10, 784))
ytr, yte = rng.integers(0, 10, 600), rng.integers(0, 10, 300)
xtr = (means[ytr] + rng.standard_normal((600, 784))).astype(np.float32)
xte = (means[yte] + rng.standard_normal((300, 784))).astype(np.float32)
spec = R.CnnSpec((R.ConvLayer(24, 5), R.ConvLayer(32, 3)), (256,))
recipe = Recipe(batch=128, optimizer=R.Optimizer(kind, betas=(0.7, 0.9)), schedule=R.Schedule("one-cycle", 0.01, 5),
                precision="fp32" if "fp32" in sys.argv else "tf32")
plan = RunPlan.build(preset("speedrun").replace(conv=((24, 5), (32, 3)), hidden=(256,), batch=128, epochs=1, seed=0),
                     600, 300, 784, 10)
initial = [a.copy() for layer in plan.initial for a in (layer.w, layer.b)]
steps = recipe.steps(600)
model = CnnDevice(cuda.open_device(), spec, recipe, xtr, ytr.astype(np.int32), xte, yte.astype(np.int32), fused=fused,
                  device_loop=loop)
outer = cuda.Stream()
if loop:
    model.load(initial, plan.orders)
    graph = model.capture_run(steps, outer, per_body=2)
    graph.launch(outer)
    print("device loop:", int(model.correct.download(outer)[0]), "of 300")
    graph.close()
model.load(initial, plan.orders)
model.reset(model.stream)
with cuda.Graph.capture(model.stream) as step:
    model.record_step(model.stream)
for _ in range(steps):
    step.launch(model.stream)
model.record_eval(model.stream)
print("step graph:", model.read_correct(), "of 300")
step.close()
outer.close()
model.close()
