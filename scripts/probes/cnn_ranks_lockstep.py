"""Which of two cnn runs drifts: one model at the combined batch C, or two data-parallel ranks
of C/2 rows stepped in lockstep on this GPU (their gradient spans summed on the host, one fp32
addition an element, as NCCL's all-reduce of two ranks does)? Both against the float64 NumPy
reference of the same steps, on real MNIST, across the tail batch into the second epoch.

    GRAPHTRAIN_DATA=DIR python3 scripts/probes/cnn_ranks_lockstep.py [--batch 2048] [--steps 32]
        [--seed 0] [--precision tf32|fp32] [--lr 0.05]

Prints, step by step: each run's batch loss (the loss sum's change) and the reference's, and each
run's weights against the reference's, ‖w − w_ref‖ / ‖w_ref − w0‖ (what training moved)."""

from __future__ import annotations

import argparse

import numpy as np

from graphtrain import data as data_mod
from graphtrain import reference_cnn
from graphtrain.config import cnn_spec, preset
from graphtrain.libs import cuda
from graphtrain.plan import RunPlan
from graphtrain.recipe import normalise, recipe_of
from graphtrain.stages.cnn_device import CnnDevice


def flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()

    data = data_mod.load("mnist")
    config = preset("speedrun").replace(batch=args.batch, steps=args.steps, seed=args.seed, optimizer="sgd",
                                        schedule="constant", lr=args.lr)
    plan = RunPlan.for_data(config, data)
    spec = cnn_spec(config)
    recipe = recipe_of(config, sum(plan.batches), plan.num_epochs, args.precision)
    train_x, test_x = normalise(data.train_images), normalise(data.test_images)
    train_y, test_y = data.train_labels.astype(np.int32), data.test_labels.astype(np.int32)
    device = cuda.open_device()
    build = (device, spec, recipe, train_x, train_y, test_x, test_y)
    one = CnnDevice(*build)
    ranks = [CnnDevice(*build, rank=r, ranks=2, all_reduce=lambda *a: None) for r in range(2)]
    initial = [a for layer in plan.initial for a in (layer.w, layer.b)]
    for m in (one, *ranks):
        m.load(initial, plan.orders)
        m.reset(m.stream)
    ref = [a.astype(np.float64) for a in initial]
    state = recipe.optimizer.init_state(ref)
    w0 = flat(initial)
    batches = [(e, lo, hi) for e, n in enumerate(plan.batches) for lo, hi in plan.epoch_bounds(e, n)]
    print(f"batch {args.batch}, {len(batches)} steps, seed {args.seed}, {args.precision}, sgd lr {args.lr}; "
          f"one fused={one.fused}")
    print(f"{'step':>4} {'ep':>2} {'rows':>5} {'loss one':>12} {'loss ranks':>12} {'loss ref':>12} "
          f"{'one-ranks':>10} {'one vs ref':>10} {'ranks vs ref':>12}")
    before = [0.0, 0.0, 0.0]
    for t, (epoch, lo, hi) in enumerate(batches):
        one.record_step(one.stream)
        ops = [m.step_ops(m.stream) for m in ranks]
        cut = [name for name, _ in ops[0]].index("all-reduce")
        for steps in ops:
            for _, op in steps[:cut]:
                op()
        total = sum(m.grads.download(m.stream) for m in ranks)
        for m in ranks:
            m.grads.upload(total, m.stream)
        for steps in ops:
            for _, op in steps[cut + 1:]:
                op()
        sums = [one.read_loss_sum(), ranks[0].read_loss_sum(), ranks[1].read_loss_sum()]
        loss_one = (sums[0] - before[0]) / (hi - lo)
        loss_ranks = (sums[1] + sums[2] - before[1] - before[2]) / (hi - lo)
        before = sums
        a, b = flat(one.weights()), flat(ranks[0].weights())
        if args.no_reference:
            ref_loss, d_one, d_ranks = float("nan"), float("nan"), float("nan")
        else:
            idx = plan.orders[epoch][lo:hi]
            ref_loss = reference_cnn.train_step(spec, ref, train_x[idx].astype(np.float64), train_y[idx],
                                                recipe.optimizer, state, t + 1, recipe.schedule.at(t))
            r = flat(ref)
            moved = np.linalg.norm(r - w0)
            d_one, d_ranks = np.linalg.norm(a - r) / moved, np.linalg.norm(b - r) / moved
        print(f"{t + 1:4d} {epoch:2d} {hi - lo:5d} {loss_one:12.7f} {loss_ranks:12.7f} {ref_loss:12.7f} "
              f"{np.linalg.norm(a - b) / np.linalg.norm(b - w0):10.2e} {d_one:10.2e} {d_ranks:12.2e}", flush=True)
    for m in (one, *ranks):
        m.close()


if __name__ == "__main__":
    main()
