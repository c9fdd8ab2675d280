"""The cnn set up once and trained many times, on the GPU: a recipe put on a captured model trains
as a fresh model does; packed models train the bits each trains alone; what the models of a
process share (the dataset's upload, the kernel modules, the lane's stream and handles)."""

import dataclasses

import numpy as np
import pytest

from graphtrain import reference_cnn as R
from tests.helpers import Scratch, rel_err

pytestmark = pytest.mark.gpu


def small_task(**kwargs):
    from test_cnn_gpu import small_task

    return small_task(**kwargs)


def same_bits(a, b) -> bool:
    return all(x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


def run_graph(model, graph, stream, initial, orders) -> tuple[list[np.ndarray], int]:
    """Load a run's initial weights and orders, launch its captured run, read weights and count."""
    from graphtrain.libs import cuda

    model.load(initial, orders)  # queued on the model's stream: the launch waits for it
    cuda.stream_wait(stream, model.stream)
    graph.launch(stream)
    stream.synchronize()  # the weights are read on the model's stream, after the run
    return model.weights(), int(model.correct.download(stream)[0])


# ---- set_recipe: another recipe, the same captures --------------------------------------------------


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_a_recipe_set_on_a_captured_run_trains_as_a_fresh_model(gpu_device, precision):
    """Model A is built for Adam on a one-cycle schedule, its whole run captured and launched; then
    set_recipe(B) (momentum with weight decay, cosine, another rate), another seed's weights and
    orders, and the same graph launched again: the weights and the count of a model built for B,
    bit for bit. And back to A: A's first run again."""
    from graphtrain.libs import cuda
    from graphtrain.recipe import Recipe
    from graphtrain.stages.cnn_device import CnnDevice

    task = small_task(precision=precision)
    a = task.recipe
    b = Recipe(batch=a.batch, epochs=a.epochs, optimizer=R.Optimizer("momentum", 0.8, weight_decay=0.01),
               schedule=R.Schedule("cosine", 0.03, task.steps), precision=precision)
    data = (task.train_images, task.train_labels, task.test_images, task.test_labels)
    outer = cuda.Stream()
    built = CnnDevice(gpu_device, task.spec, a, *data, device_loop=True)
    fresh = CnnDevice(gpu_device, task.spec, b, *data, device_loop=True)
    graphs = []
    try:
        graphs.append(built.capture_run(task.steps, outer, per_body=2))
        first = run_graph(built, graphs[0], outer, task.initial(1), task.orders(1))
        built.set_recipe(b)
        replayed = run_graph(built, graphs[0], outer, task.initial(2), task.orders(2))
        graphs.append(fresh.capture_run(task.steps, outer, per_body=2))
        wanted = run_graph(fresh, graphs[1], outer, task.initial(2), task.orders(2))
        built.set_recipe(a)
        again = run_graph(built, graphs[0], outer, task.initial(1), task.orders(1))
    finally:
        for graph in graphs:
            graph.close()
        outer.close()
        built.close()
        fresh.close()
    assert same_bits(replayed[0], wanted[0]) and replayed[1] == wanted[1], precision
    assert same_bits(first[0], again[0]) and first[1] == again[1], precision
    assert not same_bits(first[0], replayed[0])  # the recipes do train differently


def test_a_recipe_set_on_a_captured_step_trains_as_a_fresh_model(gpu_device):
    """The graphs rung's form: one step captured, replayed per batch; set_recipe between runs."""
    from graphtrain.libs import cuda
    from graphtrain.stages.cnn_device import CnnDevice

    task = small_task(precision="tf32")
    b = dataclasses.replace(task.recipe, optimizer=R.Optimizer("adamw", betas=(0.8, 0.95), weight_decay=0.1),
                            schedule=R.Schedule("warmup", 0.02, task.steps, warmup_steps=3))
    data = (task.train_images, task.train_labels, task.test_images, task.test_labels)
    built, fresh = CnnDevice(gpu_device, task.spec, task.recipe, *data), CnnDevice(gpu_device, task.spec, b, *data)
    results, graphs = [], []
    try:
        for model, recipe in ((built, b), (fresh, None)):
            with cuda.Graph.capture(model.stream) as step:
                model.record_step(model.stream)
            graphs.append(step)
            if recipe is not None:
                model.set_recipe(recipe)
            model.load(task.initial(3), task.orders(3))
            model.reset(model.stream)
            for _ in range(task.steps):
                step.launch(model.stream)
            results.append((model.weights(), model.read_loss_sum()))
    finally:
        for graph in graphs:
            graph.close()
        built.close()
        fresh.close()
    (got, got_loss), (want, want_loss) = results
    assert same_bits(got, want) and got_loss == want_loss


def test_a_recipe_a_capture_cannot_take_is_refused_and_changes_nothing(gpu_device):
    from graphtrain.stages.cnn_device import CnnDevice

    task = small_task()
    model = CnnDevice(gpu_device, task.spec, task.recipe, task.train_images, task.train_labels, task.test_images,
                      task.test_labels)
    try:
        constants = model.optimizer.constants.download(model.stream).tobytes()
        for change in (dict(batch=64), dict(epochs=2), dict(precision="tf32" if task.recipe.precision == "fp32"
                                                              else "fp32")):
            with pytest.raises(ValueError, match=f"differs: {next(iter(change))}"):
                model.set_recipe(dataclasses.replace(task.recipe, **change))
        assert model.optimizer.constants.download(model.stream).tobytes() == constants
        assert model.recipe == task.recipe
    finally:
        model.close()


def test_a_captured_optimizer_step_trains_the_constants_written_after(stream, gpu_device):
    """optimizer_step captured with Adam's constants, then SGD's with momentum written over them:
    the replays follow the reference of the second, their rate its schedule's."""
    from graphtrain.kernels.optim import STATE_INTS, Optim, constants_of
    from graphtrain.libs import cuda

    seed, n, steps = 8, 700, 6
    rng = np.random.default_rng(seed)
    p0, grads = rng.standard_normal(n), [rng.standard_normal(n) for _ in range(steps)]
    first = (R.Optimizer("adam", betas=(0.7, 0.9)), R.Schedule("one-cycle", 0.05, steps))
    second = (R.Optimizer("nesterov", momentum=0.8, weight_decay=0.001), R.Schedule("cosine", 0.03, steps))
    ref = [p0.copy()]
    state = second[0].init_state(ref)
    for t in range(steps):
        second[0].step(ref, [grads[t]], state, t + 1, second[1].at(t))
    cu = Optim(gpu_device)
    try:
        with Scratch(stream, p=p0.astype(np.float32), g=np.zeros(n, np.float32), s1=np.zeros(n, np.float32),
                     s2=np.zeros(n, np.float32), st=np.zeros(STATE_INTS, np.int32), lr=np.zeros(1, np.float32),
                     constants=constants_of(*first)) as s:
            with cuda.Graph.capture(stream) as graph:
                cu.step(stream, s["p"], s["g"], s["s1"], s["s2"], n, s["st"], s["lr"], s["constants"])
            try:
                s.bufs["constants"].upload(constants_of(*second), stream)
                for t in range(steps):
                    s.bufs["g"].upload(grads[t].astype(np.float32), stream)
                    graph.launch(stream)
                    assert abs(s.get("lr")[0] - second[1].at(t)) <= 1e-6 * second[1].lr, f"step {t}, seed {seed}"
            finally:
                graph.close()
            p = s.get("p")
    finally:
        cu.close()
    assert rel_err(p - p0, ref[0] - p0) < 5e-5, f"seed {seed}"


@pytest.fixture
def stream(gpu_device):
    from graphtrain.libs import cuda

    s = cuda.Stream()
    yield s
    s.close()


# ---- what the models of a process share -------------------------------------------------------------


def test_two_models_of_the_same_arrays_share_one_upload_the_modules_and_the_lane(gpu_device):
    from graphtrain.libs import cuda
    from graphtrain.stages.cnn_device import CnnDevice

    task = small_task(precision="tf32")
    data = (task.train_images, task.train_labels, task.test_images, task.test_labels)
    first = CnnDevice(gpu_device, task.spec, task.recipe, *data)
    second = copies = None
    try:
        cuda.reset_counters()
        second = CnnDevice(gpu_device, task.spec, task.recipe, *data, device_loop=True)
        mallocs = cuda.counters.mallocs
        copies = CnnDevice(gpu_device, task.spec, task.recipe, *(a.copy() for a in data))
        assert second.data is first.data and second.data.train_x.ptr == first.data.train_x.ptr
        assert mallocs == 1, "the second model allocates its own arena only: no dataset, no lane, no workspace"
        assert copies.data is not first.data, "other arrays (equal or not) are another upload"
        assert second.stream is first.stream and second.lane.gemms("tf32") is first.lane.gemms("tf32")
        assert second.cnn_cu.module is first.cnn_cu.module
        assert [cp.module for cp in second.convpool] == [cp.module for cp in first.convpool]
    finally:
        for model in (first, second, copies):
            if model is not None:
                model.close()


def test_images_normalised_on_the_device_are_the_hosts_bit_for_bit(gpu_device):
    """ResidentData's normalisation (kernels/images.cu) against data.images.normalise, on 8-bit
    pixels k/255 and on arbitrary floats in [0, 1]; the test set's padding stays zero."""
    from graphtrain.libs import cuda
    from graphtrain.recipe import MNIST_MEAN, MNIST_STD, normalise
    from graphtrain.stages.cnn_shared import ResidentData

    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    train = np.concatenate([rng.integers(0, 256, (300, 784)) / np.float32(255), rng.random((45, 784))]).astype(np.float32)
    test = rng.random((77, 784), dtype=np.float32)
    labels = rng.integers(0, 10, 345).astype(np.int32), rng.integers(0, 10, 77).astype(np.int32)
    stream = cuda.Stream()
    data = ResidentData(gpu_device, train, labels[0], test, labels[1], stream, (MNIST_MEAN, MNIST_STD))
    try:
        got_train = data.train_x.download(stream)
        got_test = data.test_x.download(stream)
        assert got_train.tobytes() == normalise(train).tobytes(), f"seed {seed}"
        assert got_test[:77].tobytes() == normalise(test).tobytes(), f"seed {seed}"
        assert not got_test[77:].any(), "the padding rows are not normalised"
        assert data.serves(gpu_device, data.arrays, (MNIST_MEAN, MNIST_STD))
        assert not data.serves(gpu_device, data.arrays, None), "normalised data serves no row that wants it raw"
    finally:
        data.close()
        stream.close()


# ---- packs: each model the bits of its run alone ----------------------------------------------------


@pytest.mark.parametrize("mode", ["streams", "graph"])
@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_packed_cnns_train_the_bits_each_trains_alone(gpu_device, mnist_dir, precision, mode):
    """Three speedrun cnns (lr and seed differing) on two lanes (one lane runs two of them), two
    epochs of a 1000-image slice (2 × 8 steps): each model's weights, test count and epoch losses
    against the same model trained alone by a device-loop run of its own."""
    from graphtrain import data as data_mod
    from graphtrain.config import cnn_spec, preset
    from graphtrain.libs import cuda
    from graphtrain.plan import RunPlan
    from graphtrain.recipe import recipe_of
    from graphtrain.stages.cnn_device import CnnDevice
    from graphtrain.stages.cnn_pack import flat, train_packed_cnn
    from graphtrain.stages.cnn_shared import MNIST_NORMALISATION, dataset_arrays

    full = data_mod.load("mnist", data_dir=mnist_dir)
    data = dataclasses.replace(full, train_images=full.train_images[:1000], train_labels=full.train_labels[:1000],
                               test_images=full.test_images[:500], test_labels=full.test_labels[:500])
    config = preset("speedrun").replace(epochs=2, batch=128)
    plans = [RunPlan.for_data(config.replace(lr=lr, seed=seed), data) for lr, seed in
             ((0.006, 0), (0.01, 1), (0.014, 2))]
    records = train_packed_cnn(plans, data, precision=precision, lanes=2, mode=mode)
    assert [r.pack["lane"] for r in records] == [0, 1, 0] and records[0].pack["models"] == 3
    outer = cuda.Stream()
    try:
        for plan, record in zip(plans, records):
            recipe = recipe_of(plan.config, sum(plan.batches), plan.num_epochs, precision)
            alone = CnnDevice(gpu_device, cnn_spec(plan.config), recipe, *dataset_arrays(data), device_loop=True,
                              normalisation=MNIST_NORMALISATION)
            try:
                graph = alone.capture_run(sum(plan.batches), outer)
                weights, correct = run_graph(alone, graph, outer, flat(plan.initial), plan.orders)
                graph.close()
                loss = alone.read_loss_sum()
            finally:
                alone.close()
            packed = flat(record.params)
            label = f"{precision}, {mode}, lr {plan.config.lr}, seed {plan.config.seed}"
            assert same_bits(packed, weights), label
            assert record.test_accuracy == correct / plan.num_test, label
            losses = [e.train_loss * plan.samples_seen(e.batches) for e in record.epochs]
            assert abs(sum(losses) - loss) <= 1e-12 * loss, label  # fp64 sums, apart and together
    finally:
        outer.close()
    assert records[0].pack["train_ms"] > 0 and all(e.ms > 0 for r in records for e in r.epochs)


# ---- the model axis: K cnns in every launch ------------------------------------------------------


@pytest.mark.parametrize("precision,per_launch", [("tf32", None), ("fp32", None), ("tf32", 2)],
                         ids=["tf32", "fp32", "tf32 two packs"])
def test_cnns_on_one_model_axis_train_the_bits_each_trains_alone_on_graphs(gpu_device, mnist_dir, monkeypatch,
                                                                           precision, per_launch):
    """Three speedrun cnns (lr and seed differing) on one model axis, one epoch of a 1000-image
    slice at batch 96 (11 steps, the last a tail batch of 40 rows) and 500 test images: each
    model's weights, test accuracy and loss against the same plan trained alone by the `graphs`
    row (its step graph replayed per batch, then the evaluation). "two packs": at most 2 models a
    launch, so packs of 1 and 2 trained one after the other."""
    from graphtrain import data as data_mod, training
    from graphtrain.config import preset
    from graphtrain.plan import RunPlan
    from graphtrain.stages import cnn_pack

    if per_launch is not None:
        monkeypatch.setattr(cnn_pack, "AXIS_MAX_MODELS", per_launch)
    full = data_mod.load("mnist", data_dir=mnist_dir)
    data = dataclasses.replace(full, train_images=full.train_images[:1000], train_labels=full.train_labels[:1000],
                               test_images=full.test_images[:500], test_labels=full.test_labels[:500])
    config = preset("speedrun").replace(epochs=1, batch=96, precision=precision)
    plans = [RunPlan.for_data(config.replace(lr=lr, seed=seed), data) for lr, seed in
             ((0.006, 0), (0.01, 1), (0.014, 2))]
    assert tuple(plans[0].batches) == (11,)
    records = cnn_pack.train_packed_cnn(plans, data, precision=precision, mode="axis")
    pack = records[0].pack
    assert pack["mode"] == "axis" and pack["models"] == 3
    assert pack["packs"] == (1 if per_launch is None else 2) and pack["models_per_launch"] == (per_launch or 3)
    assert "packed: 3 models on one model axis" in records[0].note and "cuBLASLt" in records[0].note
    for plan, record in zip(plans, records):
        alone = training.train(plan.config, "graphs", data=data)
        label = f"{precision}, {per_launch} a launch, lr {plan.config.lr}, seed {plan.config.seed}"
        assert same_bits(cnn_pack.flat(record.params), cnn_pack.flat(alone.params)), label
        assert record.test_accuracy == alone.test_accuracy, label
        packed_loss, loss = record.epochs[0].train_loss, alone.epochs[0].train_loss
        assert abs(packed_loss - loss) <= 1e-12 * loss, label  # fp64 sums of the same losses
    assert pack["train_ms"] > 0 and all(e.ms > 0 for r in records for e in r.epochs)


def test_the_speedrun_on_graphs_keeps_its_accuracy_with_cublaslt_products(gpu_device, mnist_dir):
    """The graphs row's linear layers through cuBLASLt (a batch of one, each shape's one
    algorithm, as a model axis takes them): the speedrun, seed 0, in its accuracy range."""
    from graphtrain import data as data_mod, training
    from graphtrain.config import preset

    record = training.train(preset("speedrun").replace(precision="tf32"), "graphs",
                            data=data_mod.load("mnist", data_dir=mnist_dir))
    assert "linear layers TF32 (cuBLASLt)" in record.note, record.note
    assert record.test_accuracy >= 0.989, record.test_accuracy
