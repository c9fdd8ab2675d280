"""Many softmax regressions on one GPU at once: the `persistent` rung's kernel, one cluster a model.

The persistent kernel trains an epoch of one model with one 16-block thread-block cluster: 16
of an H100's 132 SMs. A sweep's models differ only in learning rate and seed, so they share the
images and labels and need nothing else but their own weights, bias, sample orders and metrics.
`train_packed` uploads the data once, gives each model those four (`PackBuffers`, made of the
rung's own device pieces, graphtrain.stages.device: the parameters, the dataset, the test-set
evaluation, so a packed model's test accuracy is counted as the rung counts it), and launches the
same compiled kernel for every model and epoch on a few streams ("lanes"), as many as clusters
the SMs hold (⌊SMs / 16⌋): each lane trains its models one after another, epoch after epoch, and
the lanes run side by side, so the GPU holds that many clusters at once. Every launch is the
launch the rung makes for that model alone (the same kernel, arguments and sample order), and
the kernel sums in a fixed order, so each model's weights are bit-identical to its run alone.

Timing: one event before everything and one after each epoch of each model, on its lane. A
model's epoch time is the time its lane spent on that epoch; the pack's training time is from
the first event to the last model's end, what the whole grid took to train.
"""

from __future__ import annotations

import time

import numpy as np

from graphtrain import environment
from graphtrain.errors import ModelUnsupported
from graphtrain.plan import RunPlan
from graphtrain.record import EpochRecord, RunRecord, data_summary


def lanes_for(sm_count: int, cluster: int, models: int) -> int:
    """How many models train at once: as many clusters as the SMs hold, at most one per model."""
    return max(1, min(models, sm_count // cluster))


def lane_schedule(models: int, lanes: int) -> list[list[int]]:
    """Which models each lane trains, in order: model m on lane m mod lanes."""
    return [list(range(lane, models, lanes)) for lane in range(lanes)]


def check_pack(plans: list[RunPlan]) -> None:
    """The plans must differ only in learning rate and seed (ValueError: a caller's bug); every
    pack's trainer (this one, the jax-vmap peer) checks this first."""
    base = plans[0].config.replace(lr=1.0, seed=0)
    for plan in plans[1:]:
        if plan.config.replace(lr=1.0, seed=0) != base or plan.batches != plans[0].batches:
            raise ValueError("a pack's models must share everything but the learning rate and the seed")


class PackBuffers:
    """What a pack trains with. One arena for what the models share (the images in the kernel's
    form, the labels and the test set through the rung's device pieces, graphtrain.stages.device,
    and the test-set evaluation) and model 0's sample orders; then an arena per further model for
    its orders, and per model its parameters (device.Parameters, whose buffer names are a
    model's own) and per-epoch metrics. Planned without a GPU; `allocate` allocates them all."""

    def __init__(self, plans: list[RunPlan], data, shape):
        from graphtrain.libs.memory import Arena
        from graphtrain.stages import device as device_pieces

        first, cfg = plans[0], plans[0].config
        self.arena = Arena()
        self.dataset = device_pieces.DatasetOnDevice(self.arena, first, data, train_images=False)
        self.images = self.arena.reserve("images", (first.num_train, shape.padded_features), shape.image_dtype)
        self.evaluation = device_pieces.DeviceEvaluation(self.arena, cfg, self.dataset)
        self.model_arenas = [Arena() for _ in plans]
        self.orders = [self.dataset.order] + [arena.reserve("order", (plan.orders.size,), np.int32)
                                              for arena, plan in zip(self.model_arenas[1:], plans[1:])]
        self.params = [device_pieces.Parameters(arena, cfg) for arena in self.model_arenas]
        self.metrics = [arena.reserve("metrics", (first.num_epochs, 2), np.float64) for arena in self.model_arenas]

    def allocate(self) -> None:
        for arena in (self.arena, *self.model_arenas):
            arena.allocate()

    def close(self) -> None:
        for arena in (self.arena, *self.model_arenas):
            arena.close()


def train_packed(plans: list[RunPlan], data, precision: str | None = None, lanes: int | None = None) -> list[RunRecord]:
    """Train every plan's softmax regression with the persistent kernel, packed on this process's
    GPU; one run record per plan, in order. Every record's `pack` says how the pack ran.
    `lanes` (default: `lanes_for` the GPU) is how many streams the models are spread over."""
    from graphtrain.kernels.persistent import CLUSTER, Persistent, Shape, kernel_images, pixel_levels
    from graphtrain.libs import cuda, nvrtc
    from graphtrain.stages.persistent import products_note, refuse_unless_trains, require_clusters

    check_pack(plans)
    run_start = time.perf_counter()
    cfg, first = plans[0].config, plans[0]
    if cfg.hidden:
        raise ModelUnsupported("packing trains softmax regressions (no hidden layer) only")
    precision = precision or cfg.precision or "bf16"  # the rung's own precision first, as the rung
    if precision not in ("bf16", "fp32"):
        raise ModelUnsupported(f"the persistent rung trains in bf16 or fp32, not --precision {precision}")
    device = cuda.open_device()
    require_clusters(device)
    features = data.train_images.shape[1]
    shape = Shape(features, cfg.classes, cfg.batch, pixel_levels(data.train_images), bf16=precision == "bf16")
    refuse_unless_trains(shape)
    for plan in plans:
        plan.check_fits(True, device.total_memory)

    num_train, num_epochs, count = first.num_train, first.num_epochs, len(plans)
    pack = PackBuffers(plans, data, shape)
    dataset, images, orders = pack.dataset, pack.images, pack.orders
    params, metrics, evaluation = pack.params, pack.metrics, pack.evaluation
    lanes = min(lanes, count) if lanes else lanes_for(device.sm_count, CLUSTER, count)
    streams = [cuda.Stream() for _ in range(lanes)]
    kernel = None
    events: list[list[cuda.Event]] = []
    try:
        pack.allocate()
        setup_stream = streams[0]
        dataset.upload(setup_stream)
        images.upload(kernel_images(data.train_images, shape), setup_stream)
        for k, plan in enumerate(plans[1:], 1):
            orders[k].upload(plan.orders.ravel(), setup_stream)
        kernel = Persistent(device, shape)
        evaluation.load(device)

        def upload_initial() -> None:
            for k, plan in enumerate(plans):
                params[k].upload(plan.initial, setup_stream)
                metrics[k].zero(setup_stream)

        def launch(k: int, epoch: int, stream) -> None:
            plan, (w,), (b,) = plans[k], params[k].w, params[k].b
            kernel.train_epoch(stream, images.ptr, dataset.train_labels.ptr, orders[k].at(epoch * num_train), w.ptr,
                               b.ptr if b is not None else 0, num_train, plan.batches[epoch],
                               plan.config.lr, metrics[k].at(epoch, 0), plan.metrics_due[epoch])

        # Warm up (first launch of the module), then every model from its initial weights again.
        upload_initial()
        launch(0, 0, setup_stream)
        setup_stream.synchronize()
        upload_initial()
        setup_stream.synchronize()
        events = [[cuda.Event() for _ in range(num_epochs)] for _ in range(count)]
        start = cuda.Event()
        events.append([start])
        setup_ms = (time.perf_counter() - run_start) * 1e3

        # Launch: round robin over the lanes, each lane its models in turn, epoch after epoch.
        schedule = lane_schedule(count, lanes)
        queues = [[(k, epoch) for k in models for epoch in range(num_epochs)] for models in schedule]
        train_start = time.perf_counter()
        start.record(streams[0])
        for step in range(max(len(q) for q in queues)):
            for lane, work in enumerate(queues):
                if step < len(work):
                    k, epoch = work[step]
                    launch(k, epoch, streams[lane])
                    events[k][epoch].record(streams[lane])
        for stream in streams:
            stream.synchronize()
        train_wall_ms = (time.perf_counter() - train_start) * 1e3
        ends = [start.elapsed_ms(events[k][-1]) for k in range(count)]
        pack_ms = max(ends)

        records = []
        gpu_env = {**environment.host(), **environment.gpu(device), "nvrtc": nvrtc.version(),
                   "persistent_products": products_note(shape)}
        for k, plan in enumerate(plans):
            lane = k % lanes
            # The lane's previous event: the end of the model before on the lane, or the start.
            before = k - lanes
            epoch_ms, previous = [], events[before][-1] if before >= 0 else start
            for epoch in range(num_epochs):
                epoch_ms.append(previous.elapsed_ms(events[k][epoch]))
                previous = events[k][epoch]
            sums = metrics[k].download(setup_stream)
            epochs = []
            for epoch in range(num_epochs):
                entry = EpochRecord(plan.first_epoch + epoch + 1, epoch_ms[epoch], plan.batches[epoch],
                                    full=plan.batches[epoch] == plan.batches_per_epoch)
                if plan.metrics_due[epoch]:
                    seen = plan.samples_seen(plan.batches[epoch])
                    entry.train_loss, entry.train_accuracy = float(sums[epoch, 0] / seen), float(sums[epoch, 1] / seen)
                epochs.append(entry)
            accuracy = evaluation.accuracy(setup_stream, params[k])
            epochs[-1].test_accuracy = accuracy
            record = RunRecord(
                stage="persistent", kind="stage", config=plan.config, environment=gpu_env, epochs=epochs,
                setup_ms=setup_ms, total_ms=(time.perf_counter() - run_start) * 1e3, test_accuracy=accuracy,
                note=f"packed: {count} models, {lanes} at once (one cluster each)",
                precision=precision, data=data_summary(data), params=params[k].download(setup_stream))
            record.pack = {"models": count, "lanes": lanes, "train_ms": pack_ms, "train_wall_ms": train_wall_ms,
                           "lane": lane, "how": f"{lanes} clusters at once, one stream each",
                           "id": f"persistent-{plans[0].config.seed}-{plans[0].config.lr}-{count}"}
            records.append(record)
        return records
    finally:
        for row in events:
            for event in row:
                event.close()
        if kernel is not None:
            kernel.close()
        evaluation.close()
        pack.close()
        for stream in streams:
            stream.close()
