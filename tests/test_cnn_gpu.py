"""The cnn on the GPU against the float64 reference: cuDNN's convolution passes, the pooling
kernels, the optimizer kernel and its schedules, whole training steps, the captured runs."""

from dataclasses import dataclass

import numpy as np
import pytest

from graphtrain import reference_cnn as R
from tests.helpers import Scratch, rel_err

pytestmark = pytest.mark.gpu

# (name, n, c, h, w, k, kernel, stride, padding): the speedrun's two layers, and one with both.
CONV_CASES = [
    ("speedrun conv1", 16, 1, 28, 28, 24, 5, 1, 0),
    ("speedrun conv2", 16, 24, 12, 12, 32, 3, 1, 0),
    ("padding 1 stride 2", 8, 3, 13, 11, 8, 3, 2, 1),
]


@pytest.fixture
def stream(gpu_device):
    from graphtrain.libs import cuda

    s = cuda.Stream()
    yield s
    s.close()


# fp32: cuDNN may pick an FFT or Winograd algorithm, which rounds more than a direct sum does.
@pytest.mark.parametrize("precision,tol", [("fp32", 2e-3), ("tf32", 5e-3)])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_conv_passes_match_reference(stream, case, precision, tol, layout):
    from graphtrain.libs.cudnn import ConvPlan, Cudnn

    name, n, c, h, w, k, kernel, stride, padding = case
    seed = 11
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w))
    wt = rng.standard_normal((k, c, kernel, kernel)) / np.sqrt(c * kernel * kernel)
    dnn = Cudnn(stream)
    try:
        plan = ConvPlan(dnn, n, c, h, w, k, kernel, stride, padding, precision, layout=layout)
        out_shape = plan.out_shape
        dy = rng.standard_normal(out_shape)
        # NHWC tensors and KHWC filters on the device; the reference keeps NCHW and KCHW.
        to_dev = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1))) if layout == "nhwc" else np.ascontiguousarray
        from_dev = (lambda a: a.transpose(0, 3, 1, 2)) if layout == "nhwc" else (lambda a: a)
        with Scratch(stream, x=to_dev(x).astype(np.float32), w=to_dev(wt).astype(np.float32),
                     y=to_dev(np.zeros(out_shape, np.float32)), dy=to_dev(dy).astype(np.float32),
                     dx=to_dev(np.zeros(x.shape, np.float32)), dw=to_dev(np.zeros(wt.shape, np.float32)),
                     ws=np.zeros(max(plan.workspace_bytes, 1), np.uint8)) as s:
            # choose() overwrites its buffers: give it scratch copies, then upload the inputs again.
            plan.choose(s["dx"], s["dw"], s["y"], s["ws"], plan.workspace_bytes)
            plan.forward(s["x"], s["w"], s["y"])
            plan.backward_data(s["w"], s["dy"], s["dx"])
            plan.backward_filter(s["x"], s["dy"], s["dw"])
            y, dx, dw = (from_dev(s.get(name)) for name in ("y", "dx", "dw"))
    finally:
        dnn.close()
    ref_y = R.conv_forward(x, wt, stride, padding)
    assert out_shape == ref_y.shape
    msg = f"{name}, {precision}, {layout}, seed {seed}"
    assert rel_err(y, ref_y) < tol, msg
    assert rel_err(dx, R.conv_backward_data(dy, wt, x.shape, stride, padding)) < tol, msg
    assert rel_err(dw, R.conv_backward_filter(x, dy, kernel, stride, padding)) < tol, msg


@pytest.mark.parametrize("conv_nhwc,out_nhwc", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("pool", [2, 3])
def test_pool_kernels_match_reference(stream, gpu_device, pool, conv_nhwc, out_nhwc):
    from graphtrain.kernels.cnn import Cnn

    seed = 5
    rng = np.random.default_rng(seed)
    n, c, h, w = 6, 5, 10, 11
    conv = rng.standard_normal((n, c, h, w)).astype(np.float32)
    bias = rng.standard_normal(c).astype(np.float32) * 0.3
    ho, wo = h // pool, w // pool
    dout = rng.standard_normal((n, c, ho, wo)).astype(np.float32)
    cu = Cnn(gpu_device)
    try:
        def nhwc(a, flag):
            return np.ascontiguousarray(a.transpose(0, 2, 3, 1) if flag else a)

        def nchw(a, flag):
            return a.transpose(0, 3, 1, 2) if flag else a

        with Scratch(stream, conv=nhwc(conv, conv_nhwc), bias=bias, out=np.zeros(dout.size, np.float32),
                     arg=np.zeros(dout.size, np.uint8), dout=nhwc(dout, out_nhwc),
                     dconv=np.full(conv.size, 7, np.float32), db=np.zeros(c, np.float32)) as s:
            cu.pool_bias_relu(stream, s["conv"], s["bias"], s["out"], s["arg"], n, c, h, w, pool, conv_nhwc, out_nhwc)
            cu.pool_relu_backward(stream, s["dout"], s["arg"], s["dconv"], n, c, h, w, pool, conv_nhwc, out_nhwc)
            cu.channel_bias_grad(stream, s["dout"], s["arg"], s["db"], n, c, ho * wo, out_nhwc)
            pooled_shape = (n, ho, wo, c) if out_nhwc else (n, c, ho, wo)
            out = nchw(s.get("out").reshape(pooled_shape), out_nhwc)
            dconv = nchw(s.get("dconv").reshape((n, h, w, c) if conv_nhwc else conv.shape), conv_nhwc)
            db = s.get("db")
    finally:
        cu.close()
    c64 = conv.astype(np.float64) + bias[None, :, None, None]
    p, arg = R.maxpool_forward(c64, pool)
    a = np.maximum(p, 0)
    ref_dconv = R.maxpool_backward(dout * (a > 0), arg, pool, c64.shape)
    assert rel_err(out, a) < 1e-7, f"seed {seed}"
    assert np.array_equal(dconv, ref_dconv.astype(np.float32)), f"seed {seed}"
    assert rel_err(db, ref_dconv.sum(axis=(0, 2, 3))) < 1e-6, f"seed {seed}"


OPTIMIZER_CASES = [
    R.Optimizer("sgd", weight_decay=0.01),
    R.Optimizer("momentum", momentum=0.9),
    R.Optimizer("nesterov", momentum=0.8, weight_decay=0.001),
    R.Optimizer("adam", betas=(0.7, 0.9)),
    R.Optimizer("adam", betas=(0.9, 0.999), weight_decay=0.01),
    R.Optimizer("adamw", betas=(0.9, 0.99), weight_decay=0.1),
]
SCHEDULE_CASES = [
    R.Schedule("constant", 0.05, 40),
    R.Schedule("warmup", 0.05, 40, warmup_steps=7),
    R.Schedule("one-cycle", 0.05, 40),
    R.Schedule("cosine", 0.05, 40),
]


@pytest.mark.parametrize("steps", [1, 12])
@pytest.mark.parametrize("optimizer", OPTIMIZER_CASES, ids=lambda o: f"{o.kind}-wd{o.weight_decay}")
def test_optimizer_kernel_matches_reference(stream, gpu_device, optimizer, steps):
    from graphtrain.kernels.optim import STATE_INTS, Optim, constants_of

    seed = 3
    rng = np.random.default_rng(seed)
    n = 3000
    p0 = rng.standard_normal(n)
    grads = [rng.standard_normal(n) for _ in range(steps)]
    schedule = R.Schedule("one-cycle", 0.05, steps + 3)
    ref = [p0.copy()]
    state = optimizer.init_state(ref)
    for t in range(steps):
        optimizer.step(ref, [grads[t]], state, t + 1, schedule.at(t))
    cu = Optim(gpu_device)
    try:
        with Scratch(stream, p=p0.astype(np.float32), g=np.zeros(n, np.float32), s1=np.zeros(n, np.float32),
                     s2=np.zeros(n, np.float32), st=np.zeros(STATE_INTS, np.int32), lr=np.zeros(1, np.float32),
                     constants=constants_of(optimizer, schedule)) as s:
            for t in range(steps):
                s.bufs["g"].upload(grads[t].astype(np.float32), stream)
                cu.step(stream, s["p"], s["g"], s["s1"], s["s2"], n, s["st"], s["lr"], s["constants"])
            p, st, lr = s.get("p"), s.get("st"), s.get("lr")
    finally:
        cu.close()
    msg = f"{optimizer}, {steps} steps, seed {seed}"
    assert rel_err(p - p0, ref[0] - p0) < 5e-5, msg  # the change, so the update's error is seen
    assert list(st) == [steps, 0], msg
    assert abs(lr[0] - schedule.at(steps - 1)) <= 1e-6 * schedule.lr, msg


def test_optimizer_kernel_four_at_a_time_and_one_at_a_time_give_the_same_bits(stream, gpu_device):
    """The update takes aligned spans four floats at a time (the tail one at a time) and
    misaligned ones one at a time: the same arithmetic, so the same bits, both the reference's."""
    from graphtrain.kernels.optim import STATE_INTS, Optim, constants_of

    seed = 5
    rng = np.random.default_rng(seed)
    n, steps = 3003, 3  # a tail of 3 past the quads
    optimizer, schedule = R.Optimizer("adam", weight_decay=0.01), R.Schedule("one-cycle", 0.05, 6)
    p0, grads = rng.standard_normal(n), [rng.standard_normal(n) for _ in range(steps)]
    ref = [p0.copy()]
    state = optimizer.init_state(ref)
    for t in range(steps):
        optimizer.step(ref, [grads[t]], state, t + 1, schedule.at(t))
    cu = Optim(gpu_device)
    results = []
    try:
        for shift in (0, 1):  # floats: 1 puts every span 4 bytes past a 16-byte boundary
            z = np.zeros(n + 1, np.float32)
            with Scratch(stream, p=np.concatenate([np.zeros(shift), p0, np.zeros(1 - shift)]).astype(np.float32),
                         g=z, s1=z, s2=z, st=np.zeros(STATE_INTS, np.int32), lr=np.zeros(1, np.float32),
                         constants=constants_of(optimizer, schedule)) as s:
                at = lambda name: s[name] + 4 * shift  # noqa: E731
                for t in range(steps):
                    s.bufs["g"].upload(np.concatenate([np.zeros(shift), grads[t], np.zeros(1 - shift)]).astype(np.float32),
                                       stream)
                    cu.step(stream, at("p"), at("g"), at("s1"), at("s2"), n, s["st"], s["lr"], s["constants"])
                results.append([s.get(name)[shift:shift + n] for name in ("p", "s1", "s2")])
    finally:
        cu.close()
    msg = f"adam, {steps} steps, n {n}, seed {seed}"
    for quads, single in zip(*results):
        assert np.array_equal(quads.view(np.uint32), single.view(np.uint32)), msg
    assert rel_err(results[0][0] - p0, ref[0] - p0) < 5e-5, msg


@pytest.mark.parametrize("schedule", SCHEDULE_CASES, ids=lambda s: s.kind)
def test_schedule_rates_match_reference(stream, gpu_device, schedule):
    from graphtrain.kernels.optim import Optim

    cu = Optim(gpu_device)
    try:
        with Scratch(stream, out=np.zeros(schedule.total, np.float32)) as s:
            cu.schedule_rates(stream, s["out"], 0, schedule.total, schedule)
            rates = s.get("out")
    finally:
        cu.close()
    ref = np.array([schedule.at(k) for k in range(schedule.total)])
    assert np.abs(rates - ref).max() <= 2e-6 * schedule.lr, schedule


def test_replayed_graph_rate_follows_schedule(stream, gpu_device):
    """One captured optimizer step replayed k times: the rate it used at each replay is the
    schedule's at that step, with nothing re-captured or patched."""
    from graphtrain.kernels.optim import STATE_INTS, Optim, constants_of
    from graphtrain.libs import cuda

    schedule = R.Schedule("one-cycle", 0.01, 30)
    optimizer = R.Optimizer("adam", betas=(0.7, 0.9))
    cu = Optim(gpu_device)
    n = 500
    try:
        with Scratch(stream, p=np.ones(n, np.float32), g=np.full(n, 0.5, np.float32), s1=np.zeros(n, np.float32),
                     s2=np.zeros(n, np.float32), st=np.zeros(STATE_INTS, np.int32), lr=np.zeros(1, np.float32),
                     constants=constants_of(optimizer, schedule)) as s:
            with cuda.Graph.capture(stream) as graph:
                cu.step(stream, s["p"], s["g"], s["s1"], s["s2"], n, s["st"], s["lr"], s["constants"])
            try:
                for k in range(schedule.total):
                    graph.launch(stream)
                    lr = s.get("lr")[0]
                    assert abs(lr - schedule.at(k)) <= 1e-6 * schedule.lr, f"step {k}: {lr} vs {schedule.at(k)}"
            finally:
                graph.close()
    finally:
        cu.close()


# ---- whole steps and runs ---------------------------------------------------------------------

SMALL = R.CnnSpec((R.ConvLayer(6, 5), R.ConvLayer(8, 3)), (32,), classes=10)


@dataclass
class SmallCnnRun:
    """A small cnn run for CnnDevice: the model, the recipe, the data, each seed's run plan (the
    speedrun preset's, with this model and batch)."""

    spec: R.CnnSpec
    recipe: object  # graphtrain.recipe.Recipe
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray

    @property
    def steps(self) -> int:
        return self.recipe.steps(len(self.train_images))

    def plan(self, seed: int):
        from graphtrain.config import preset
        from graphtrain.plan import RunPlan

        cfg = preset("speedrun").replace(
            conv=tuple((layer.out_channels, layer.kernel) for layer in self.spec.convs), hidden=self.spec.hidden,
            batch=self.recipe.batch, epochs=self.recipe.epochs, seed=seed)
        return RunPlan.build(cfg, len(self.train_images), len(self.test_images),
                             self.spec.channels * self.spec.height * self.spec.width, self.spec.classes)

    def initial(self, seed: int) -> list[np.ndarray]:
        return [a.copy() for layer in self.plan(seed).initial for a in (layer.w, layer.b)]

    def orders(self, seed: int) -> np.ndarray:
        return self.plan(seed).orders


def small_task(num_train=600, num_test=300, batch=128, optimizer=None, schedule_kind="one-cycle",
               precision="fp32", spec=SMALL, seed=0):
    from graphtrain.recipe import Recipe

    rng = np.random.default_rng([seed, 99])
    # Learnable synthetic digits: a class mean image plus noise.
    means = rng.standard_normal((10, 784))
    ytr, yte = rng.integers(0, 10, num_train), rng.integers(0, 10, num_test)
    xtr = (means[ytr] + rng.standard_normal((num_train, 784))).astype(np.float32)
    xte = (means[yte] + rng.standard_normal((num_test, 784))).astype(np.float32)
    steps = -(-num_train // batch)
    recipe = Recipe(batch=batch, epochs=1, optimizer=optimizer or R.Optimizer("adam", betas=(0.7, 0.9)),
                    schedule=R.Schedule(schedule_kind, 0.01, steps), precision=precision)
    return SmallCnnRun(spec, recipe, xtr, ytr.astype(np.int32), xte, yte.astype(np.int32))


def reference_run(task, seed, steps):
    params = [p.astype(np.float64) for p in task.initial(seed)]
    opt, sched, b = task.recipe.optimizer, task.recipe.schedule, task.recipe.batch
    state = opt.init_state(params)
    order = task.orders(seed)[0]
    for t, lo in enumerate(range(0, len(order), b)):
        if t == steps:
            break
        idx = order[lo:lo + b]
        R.train_step(task.spec, params, task.train_images[idx].astype(np.float64), task.train_labels[idx], opt, state,
                     t + 1, sched.at(t))
    return params


# path: (CnnDevice's options, the recipe's precision, the weights' tolerance, the test accuracy's
# largest difference from float64's in samples of the 300). TF32 (the conv layers and the hidden
# linear one) rounds every product's operands to 10 mantissa bits, Adam's m/√v magnifies the
# change in the smallest gradients (measured on an H100: 0.9% of the weights, 4 samples).
PATHS = {"fused": (dict(fused=True), "fp32", 1e-4, 2), "fused-tf32": (dict(fused=True), "tf32", 2e-2, 6),
         "cudnn-nhwc": (dict(fused=False, nhwc=True), "fp32", 1e-3, 2),
         "cudnn-nchw": (dict(fused=False, nhwc=False), "fp32", 1e-3, 2)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("optimizer", [R.Optimizer("sgd"), R.Optimizer("adam", betas=(0.7, 0.9))], ids=["sgd", "adam"])
def test_training_steps_match_reference(gpu_device, optimizer, path):
    """Every step of a short epoch, the tail batch (600 = 4·128 + 88) included: the conv layers as
    our fused kernels in fp32 (25 taps: the register weight gradient; 54: the per-tap one) or on
    the tensor cores (TF32, the linear layers too), or through cuDNN (fp32) on NHWC or NCHW tensors."""
    from graphtrain.kernels.convpool_tc import ConvPoolTc
    from graphtrain.stages.cnn_device import CnnDevice

    options, precision, tol, samples = PATHS[path]
    task = small_task(optimizer=optimizer, precision=precision)
    model = CnnDevice(gpu_device, task.spec, task.recipe, task.train_images, task.train_labels, task.test_images,
                      task.test_labels, **options)
    assert model.fused == options["fused"]
    if model.fused:
        assert all(isinstance(cp, ConvPoolTc) == (precision == "tf32") for cp in model.convpool)
    try:
        seed = 4
        model.load(task.initial(seed), task.orders(seed))
        model.reset(model.stream)
        for _ in range(task.steps):
            model.record_step(model.stream)
        got = model.weights()
        model.record_eval(model.stream)
        correct = model.read_correct()
    finally:
        model.close()
    ref = reference_run(task, seed, task.steps)
    # cuDNN may pick FFT or Winograd algorithms, which round more than a direct sum.
    for i, (g, r) in enumerate(zip(got, ref)):
        assert rel_err(g, r) < tol, f"parameter {i} {r.shape}, {optimizer.kind}, {path}, seed {seed}"
    ref_acc = R.accuracy(task.spec, ref, task.test_images.astype(np.float64), task.test_labels)
    assert abs(correct / len(task.test_images) - ref_acc) <= samples / len(task.test_images), f"{path}, seed {seed}"


def test_a_batch_read_through_its_sample_indices_trains_the_gathered_batchs_bits(gpu_device, monkeypatch):
    """The first layer reading its batch in the resident training set through the step's sample
    indices (convpool_tc's `samples`; no gathered x) against the rows gathered into x: every step of
    an epoch, the tail batch's padding rows included, gives the same weights bit for bit."""
    from graphtrain.kernels.convpool_tc import ConvPoolTc
    from graphtrain.stages.cnn_device import CnnDevice

    task = small_task(precision="tf32")
    seed = 6
    weights = []
    for through in (True, False):
        monkeypatch.setattr(ConvPoolTc, "reads_samples", through)
        model = CnnDevice(gpu_device, task.spec, task.recipe, task.train_images, task.train_labels,
                          task.test_images, task.test_labels)
        try:
            assert model.through_samples == through and (model.x is None) == through
            model.load(task.initial(seed), task.orders(seed))
            model.reset(model.stream)
            for _ in range(task.steps):
                model.record_step(model.stream)
            weights.append(model.weights())
        finally:
            model.close()
    for i, (a, b) in enumerate(zip(*weights)):
        assert a.tobytes() == b.tobytes(), f"parameter {i}, seed {seed}"


def test_runs_are_bit_identical_and_graphs_equal_device_loop(gpu_device):
    """The same seed twice gives the same weights bit for bit; the device-loop graph (WHILE body
    of 2 steps, 5 steps = 2 iterations + 1 unrolled) gives the same as the step graph replayed;
    nothing is allocated and the host waits once per run."""
    from graphtrain.libs import cuda
    from graphtrain.stages.cnn_device import CnnDevice

    task = small_task(precision="tf32")
    model = CnnDevice(gpu_device, task.spec, task.recipe, task.train_images, task.train_labels, task.test_images,
                      task.test_labels, device_loop=True)
    outer = cuda.Stream()
    try:
        results = []
        for _ in range(2):
            model.load(task.initial(1), task.orders(1))
            cuda.reset_counters()
            graph = model.capture_run(task.steps, outer, per_body=2)
            graph.launch(outer)
            correct = int(model.correct.download(outer)[0])
            assert (cuda.counters.mallocs, cuda.counters.syncs) == (0, 1)
            graph.close()
            results.append((model.weights(), correct))
        model.load(task.initial(1), task.orders(1))
        model.reset(model.stream)
        with cuda.Graph.capture(model.stream) as step:
            model.record_step(model.stream)
        for _ in range(task.steps):
            step.launch(model.stream)
        step.close()
        stepped = model.weights()
    finally:
        outer.close()
        model.close()
    (w1, c1), (w2, c2) = results
    assert c1 == c2
    for a, b, c in zip(w1, w2, stepped):
        assert np.array_equal(a, b)
        assert np.array_equal(a, c)


def test_speedrun_reaches_99_percent_on_mnist(gpu_device, mnist_dir):
    """The speedrun preset, device-loop, one seed: 99% on the test set (the bar is the mean over
    10 seeds; one seed lies within its spread)."""
    from graphtrain import config, data, speedrun

    case = speedrun.SpeedrunCase.of(config.preset("speedrun").replace(precision="tf32"),
                                    data.load("mnist", data_dir=mnist_dir))
    result = speedrun.run_row("device-loop", case, [0])
    assert result.accuracies[0] >= 0.985, result


@pytest.mark.parametrize("batch,k,cursor", [(256, 256, 59904), (100, 37, 0)], ids=["speedrun tail", "small"])
def test_head_kernels_match_reference(stream, gpu_device, seed, batch, k, cursor):
    """head.cu's logits layer + loss step, and the logits layer's gradients, against float64: the
    valid rows only (the speedrun's tail batch: 96 of 256), the cursor moved on by them, the loss
    summed, the count of blocks left 0 (twice: the second call reuses it)."""
    from graphtrain.kernels.head import Head

    classes, epoch = 10, 60000
    rng = np.random.default_rng(seed)
    h = np.maximum(rng.standard_normal((batch, k)), 0)
    w = rng.standard_normal((classes, k)) / np.sqrt(k)
    b = 0.1 * rng.standard_normal(classes)
    y = rng.integers(0, classes, batch).astype(np.int32)
    cu = Head(gpu_device, classes)
    f32 = np.float32
    try:
        with Scratch(stream, h=h.astype(f32), w=w.astype(f32), b=b.astype(f32), y=y,
                     dl=np.full((batch, classes), np.nan, f32), dw=np.full((classes, k), np.nan, f32),
                     db=np.full(classes, np.nan, f32), cursor=np.array([cursor], np.int32),
                     loss=np.array([1.5]), row_loss=np.zeros(batch), count=np.zeros(1, np.int32)) as s:
            for _ in range(2):
                s.bufs["cursor"].upload(np.array([cursor], np.int32), stream)
                cu.logits_loss(stream, s["h"], s["w"], s["b"], s["y"], s["dl"], s["row_loss"], s["count"],
                               s["cursor"], batch, k, epoch, s["loss"])
                cu.grads(stream, s["h"], s["dl"], s["dw"], s["db"], batch, k)
            dl, dw, db, cur, loss, count = (s.get(name) for name in ("dl", "dw", "db", "cursor", "loss", "count"))
    finally:
        cu.close()
    valid = min(batch, epoch - cursor % epoch)
    ref_loss, ref_dl = R.loss_and_dlogits(h[:valid] @ w.T + b, y[:valid])
    msg = f"batch {batch}, k {k}, seed {seed}"
    assert cur[0] == cursor + valid and count[0] == 0, msg
    assert np.all(dl[valid:] == 0), msg
    assert rel_err(dl[:valid], ref_dl) < 1e-5, msg
    assert rel_err(dw, ref_dl.T @ h[:valid]) < 1e-5, msg
    assert rel_err(db, ref_dl.sum(axis=0)) < 1e-5, msg
    assert abs(loss[0] - 1.5 - 2 * ref_loss * valid) < 1e-5 * ref_loss * valid, msg


@pytest.mark.parametrize("batch,cursor,ranks", [(256, 59904, 1), (256, 59904, 2), (100, 0, 1), (100, 0, 2)],
                         ids=["speedrun tail", "speedrun tail, rank of 2", "small", "small, rank of 2"])
def test_softmax_xent_step_matches_reference(stream, gpu_device, seed, batch, cursor, ranks):
    """cnn.cu's loss step (the unfused head's) against float64: each rank's real rows are its slice
    of the batch's valid ones (96 of 256 at the speedrun's tail), divided by the combined batch's
    valid rows, the rows it reads past them zero; the cursor moves on by the valid rows; loss_sum
    gets the rank's rows' losses."""
    from graphtrain.kernels.cnn import Cnn

    classes, epoch = 10, 60000
    rng = np.random.default_rng(seed)
    z = 3 * rng.standard_normal((batch, classes))
    y = rng.integers(0, classes, batch).astype(np.int32)
    valid = min(batch, epoch - cursor % epoch)
    rows, mine = batch // ranks, valid // ranks
    cu = Cnn(gpu_device)
    f32 = np.float32
    try:
        for rank in range(ranks):
            first = rank * mine  # the rank's rows: its slice of the valid ones, then the rows it reads on
            z_rank, y_rank = z[first:first + rows], y[first:first + rows]
            with Scratch(stream, z=z_rank.astype(f32), y=y_rank, dl=np.full((rows, classes), np.nan, f32),
                         cursor=np.array([cursor], np.int32), loss=np.array([1.5])) as s:
                cu.softmax_xent_step(stream, s["z"], s["y"], s["dl"], s["cursor"], batch, epoch, classes, s["loss"],
                                     ranks)
                dl, cur, loss = (s.get(name) for name in ("dl", "cursor", "loss"))
            ref_loss, ref_dl = R.loss_and_dlogits(z_rank[:mine], y_rank[:mine])
            msg = f"batch {batch}, cursor {cursor}, rank {rank} of {ranks}, seed {seed}"
            assert cur[0] == cursor + valid, msg
            assert np.all(dl[mine:] == 0), msg
            assert rel_err(dl[:mine], ref_dl * mine / valid) < 1e-5, msg
            assert abs(loss[0] - 1.5 - ref_loss * mine) < 1e-5 * ref_loss * mine, msg
    finally:
        cu.close()
