"""Many cnns of one shape trained together on one GPU: the sweep's packs of the cnn on `graphs`
and `device-loop`, every model's weights bit-identical to its run alone.

Three ways (`mode`; scripts/probes/cnn_pack_modes.py times them all in one call):

    axis     the models on one model axis: every launch of a step trains K models at once
             (graphtrain.stages.cnn_layers.ModelAxis), each epoch one graph for all of them
    streams  one graph per model and epoch, captured from its lane's stream; each lane launches
             its models' graphs one after another, the lanes side by side (launched in turn)
    graph    one graph per epoch and group of `lanes` models (the j-th model of every lane), each
             model a branch of it; the groups' graphs launched one after another

"axis" is the sweep's (graphtrain.stages.REGISTRY's Pack.mode): a speedrun cnn's replayed step is
~15 small dependent launches, so K models alone on streams are ~15·K launches a step, bound by
launching; on the axis they are ~15 launches a step whatever K, each K times as wide.

The axis. K models are one CnnDevice of `models=K`: one allocation of K copies of a model's arena
layout, model k's `model_stride` bytes after model k − 1's; model k's initial weights, sample
orders and recipe constants (its learning rate, the schedule's and the optimizer's) written into
its own copy. The step is recorded once, each launch with the grid's z over the models and the
stride (the kernels' model axis), the linear layers' products as strided batches of K through
cuBLASLt with each shape's one algorithm (graphtrain.libs.cublaslt.LtGemms, which a run alone
takes as a batch of one); each epoch is one graph (the reset first, the steps in a WHILE node,
the evaluation after the last). A block computes for model k what it computes for the model
alone, and so each model trains the bits of its run alone (same seed, lr and order). The models
go in packs of at most AXIS_MAX_MODELS, and as many as PACK_MEMORY_FRACTION of the GPU holds (each
evaluating the whole test set at once, as the run alone does); packs beyond the first are trained
one after another, each built, trained, read and freed in turn (the pack's training time sums
theirs).

The streams and graph modes: each model is a CnnDevice of its own, built with its plan's recipe: its
parameters, gradients, optimizer state, activations and sample orders in an arena of its own. They
share what a process sets up once (graphtrain.stages.cnn_shared): the dataset on the device (one
upload for the whole pack, and for the process's next pack of the same data), the kernel modules,
and per lane a stream with its library handles and workspace; model m runs on lane m mod `lanes`. A
model's run is its epochs captured as graphs (`CnnDevice.record_part`): the reset, each epoch's
steps in a WHILE node with their loss summed apart, the evaluation after the last. These are the
launches of its run alone, reading and writing its own buffers only (no sum across models), so each
model trains the bits it trains alone (same seed, learning rate and sample order).

Timing, with CUDA events: axis, an event after each pack's epoch graph (each model's epoch time is
its pack's); streams, an event on the lane after each of its models' epochs (a model's epoch
time is its lane's time on it, as graphtrain.packed times its lanes); graph, an event after each
group's epoch graph (each model's epoch time is its group's). The pack's training time runs from
an event before the first launch to the last event: first step to last accuracy on the device
(the axis: summed over its packs); the correct counts are read after.

Memory (streams and graph): a model's evaluation passes take up to MAX_EVAL_ROWS test rows (its
activations sized for them); where that many models do not fit PACK_MEMORY_FRACTION of the GPU,
the pack evaluates in smaller passes, the same for every model (its records say so): each row's
logits come from the same kernels, but cuBLASLt may sum the products in another order for
another row count, so an accuracy may then differ from the run alone's by a sample on a near
tie. The axis keeps the run alone's passes, and trains fewer models a pack instead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from itertools import chain

import numpy as np

from graphtrain import environment
from graphtrain.errors import ModelUnsupported
from graphtrain.kernels import ceil_div
from graphtrain.plan import RunPlan
from graphtrain.record import EpochRecord, RunRecord, data_summary
from graphtrain.reference import Layer

MODES = ("axis", "streams", "graph")
DEFAULT_MODE = "axis"
DEFAULT_LANES = 16  # streams and graph: lanes at most (streams with their handles), one per model up to this
AXIS_MAX_MODELS = 128  # axis: models a launch trains at most (a pack); more go in further packs
PACK_MEMORY_FRACTION = 0.85  # of the GPU's memory, for the models' arenas and the lanes


def lane_models(models: int, lanes: int) -> list[list[int]]:
    """The models each lane trains, in order: model m on lane m mod lanes."""
    return [list(range(lane, models, lanes)) for lane in range(lanes)]


def groups_of(models: int, lanes: int) -> list[list[int]]:
    """The graph mode's groups: group j holds the j-th model of every lane."""
    return [list(range(first, min(first + lanes, models))) for first in range(0, models, lanes)]


def fitting_eval_rows(models: int, model_bytes: int, row_bytes: int, rows: int, batch: int, budget: int) -> int:
    """The most rows an evaluation pass may take for `models` models to fit `budget` bytes, a
    model taking `model_bytes` with its activations sized for `rows` rows (`row_bytes` a row):
    `rows` where they fit; ValueError where not even the training batch's activations do."""
    if models * model_bytes <= budget:
        return rows
    fixed = model_bytes - rows * row_bytes  # what does not scale with the activations' rows
    fitting = (budget // models - fixed) // row_bytes if row_bytes else 0
    if fitting < batch:
        raise ValueError(f"{models} models of {model_bytes / 2**20:.0f} MiB do not fit {budget / 2**30:.1f} GiB, "
                         f"even evaluating as few rows at a time as the training batch")
    return int(fitting)


def train_packed_cnn(plans: list[RunPlan], data, precision: str | None = None, lanes: int | None = None,
                     mode: str = DEFAULT_MODE, row: str = "graphs") -> list[RunRecord]:
    """Train every plan's cnn together on this process's GPU, in `mode` (MODES; `lanes`: the
    streams and graph modes'); one run record per plan, in order, each with `pack`: how the pack
    ran, its training time and its setup."""
    from graphtrain.config import cnn_spec
    from graphtrain.libs import cuda
    from graphtrain.packed import check_pack
    from graphtrain.recipe import recipe_of
    from graphtrain.stages import CNN_TRAINS
    from graphtrain.stages.cnn_device import MAX_EVAL_ROWS, CnnDevice
    from graphtrain.stages.cnn_shared import (LANE_WORKSPACE_BYTES, MNIST_NORMALISATION, dataset_arrays,
                                              lanes as lanes_of)

    if mode not in MODES:
        raise ValueError(f"pack mode {mode!r}: one of {', '.join(MODES)}")
    check_pack(plans)
    run_start = time.perf_counter()
    first, count = plans[0], len(plans)
    if first.config.model != "cnn":
        raise ModelUnsupported(f"this pack trains cnns, not the {first.config.model}")
    precision = precision or first.config.precision or CNN_TRAINS[0]
    if precision not in CNN_TRAINS:
        raise ModelUnsupported(f"the cnn trains in {' or '.join(CNN_TRAINS)}, not --precision {precision}")
    device = cuda.open_device()
    first.check_fits(True, device.total_memory)
    spec = cnn_spec(first.config)
    recipes = [recipe_of(plan.config, sum(plan.batches), plan.num_epochs, precision) for plan in plans]
    arrays = dataset_arrays(data)
    if mode == "axis":
        return _train_on_axis(plans, data, precision, row, run_start, device, spec, recipes, arrays)
    lanes = min(lanes or DEFAULT_LANES, count)
    pool = lanes_of(device, lanes)
    lane_of_model = [m % lanes for m in range(count)]

    models: list[CnnDevice] = []
    graphs: list = []
    events: list = []
    outers = [cuda.Stream() for _ in range(lanes)]  # where each lane's graphs are captured and launched
    main = cuda.Stream()
    try:
        def build(m: int, eval_rows: int) -> CnnDevice:
            model = CnnDevice(device, spec, recipes[m], *arrays, normalisation=MNIST_NORMALISATION,
                              device_loop=True, lane=pool[lane_of_model[m]], eval_rows=eval_rows)
            if not model.fused:  # cuDNN's timed search could pick other algorithms than the run alone's
                model.close()
                raise ModelUnsupported("the cnn packs where every conv layer runs as the fused kernels; these "
                                       "layers run through cuDNN, whose timed algorithm search could pick other "
                                       "algorithms than each model's run alone")
            return model

        model_starts = [time.perf_counter()]
        probe = build(0, MAX_EVAL_ROWS)
        budget = (int(PACK_MEMORY_FRACTION * device.total_memory) - lanes * LANE_WORKSPACE_BYTES
                  - probe.data.arena.nbytes)
        try:
            eval_rows = fitting_eval_rows(count, probe.arena.nbytes, probe.eval_row_bytes,
                                          max(probe.batch, probe.eval_rows), probe.batch, budget)
        except ValueError as exc:
            probe.close()
            raise ModelUnsupported(str(exc)) from None
        if eval_rows < probe.eval_rows:
            probe.close()
            probe = build(0, eval_rows)
        models.append(probe)
        for m in range(1, count):
            model_starts.append(time.perf_counter())
            models.append(build(m, probe.eval_rows))
        model_starts.append(time.perf_counter())

        # Warm up each lane (the first launches of every kernel and library call on its handles),
        # then every model from its initial weights and orders.
        for lane in range(lanes):
            model = models[lane]
            model.load(flat(plans[lane].initial), plans[lane].orders)
            model.reset(model.stream)
            model.record_step(model.stream)
            model.record_eval(model.stream)
        for model, plan in zip(models, plans):
            model.load(flat(plan.initial), plan.orders)
        for lane in pool:
            lane.stream.synchronize()

        epochs = first.batches

        def record(model: CnnDevice, outer, e: int) -> None:
            model.record_part(outer, epochs[e], epoch=e, reset=e == 0, evaluate=e == len(epochs) - 1)

        capture_start = time.perf_counter()
        if mode == "streams":
            for m, model in enumerate(models):
                graphs.append([])
                for e in range(len(epochs)):
                    with cuda.Graph.capture(outers[lane_of_model[m]]) as graph:
                        record(model, outers[lane_of_model[m]], e)
                    graphs[m].append(graph)
        else:
            for group in groups_of(count, lanes):
                graphs.append([])
                for e in range(len(epochs)):
                    with cuda.Graph.capture(main) as graph:
                        for m in group:
                            outer = outers[lane_of_model[m]]
                            cuda.stream_wait(outer, main)  # a branch of the graph
                            record(models[m], outer, e)
                            cuda.stream_wait(main, outer)
                    graphs[-1].append(graph)
        capture_ms = (time.perf_counter() - capture_start) * 1e3
        setup_ms = (time.perf_counter() - run_start) * 1e3

        start = cuda.Event()
        events.append([start])
        train_start = time.perf_counter()
        start.record(main)
        if mode == "streams":
            for outer in outers:
                cuda.stream_wait(outer, main)
            ends = [[cuda.Event() for _ in epochs] for _ in models]
            events += ends
            queues = [[(m, e) for m in ms for e in range(len(epochs))] for ms in lane_models(count, lanes)]
            for step in range(max(len(q) for q in queues)):
                for lane, queue in enumerate(queues):
                    if step < len(queue):
                        m, e = queue[step]
                        graphs[m][e].launch(outers[lane])
                        ends[m][e].record(outers[lane])
            for outer in outers:
                outer.synchronize()
        else:
            group_ends = [[cuda.Event() for _ in epochs] for _ in graphs]
            events += group_ends
            for j, group_graphs in enumerate(graphs):
                for e, graph in enumerate(group_graphs):
                    graph.launch(main)
                    group_ends[j][e].record(main)
            main.synchronize()
            ends = [group_ends[j] for j, group in enumerate(groups_of(count, lanes)) for _ in group]
        train_wall_ms = (time.perf_counter() - train_start) * 1e3
        pack_ms = max(start.elapsed_ms(model_ends[-1]) for model_ends in ends)

        def previous(m: int, e: int):
            """The event before model m's epoch e on its lane (its group's, in graph mode)."""
            if e:
                return ends[m][e - 1]
            earlier = m - lanes if mode == "streams" else (m // lanes - 1) * lanes  # the lane's, the group's
            return ends[earlier][-1] if earlier >= 0 else start

        epoch_ms = [[previous(m, e).elapsed_ms(ends[m][e]) for e in range(len(epochs))] for m in range(count)]

        per_model_setup = [(b - a) * 1e3 for a, b in zip(model_starts, model_starts[1:])]
        how = (f"{count} models on {lanes} lanes, {mode}: " +
               ("each model's epochs graphs of their own, the lanes' streams side by side" if mode == "streams"
                else f"each epoch one graph of {min(lanes, count)} models as branches"))
        if probe.eval_rows < min(MAX_EVAL_ROWS, first.num_test):
            how += f"; evaluated {probe.eval_rows} test rows at a time (memory)"
        pack = {"models": count, "lanes": lanes, "mode": mode, "train_ms": pack_ms, "train_wall_ms": train_wall_ms,
                "setup_ms": setup_ms, "capture_ms": capture_ms, "first_model_setup_ms": per_model_setup[0],
                "model_setup_ms": statistics.median(per_model_setup[1:]) if count > 1 else None,
                "eval_rows": probe.eval_rows, "how": how,
                "id": f"cnn-{row}-{first.config.seed}-{first.config.lr}-{count}"}
        gpu_env = {**environment.host(), **environment.gpu(device), **probe.environment()}
        return [model_record(plan, row, data, precision, gpu_env, epoch_ms[m], read_model(model),
                             {**pack, "lane": lane_of_model[m]}, run_start)
                for m, (model, plan) in enumerate(zip(models, plans))]
    finally:  # the graphs before the models whose buffers they launch on, the streams last
        for obj in (*chain.from_iterable(events), *chain.from_iterable(graphs), *models, *outers, main):
            obj.close()


def read_model(model, k: int = 0) -> tuple[np.ndarray, int, list[np.ndarray], str]:
    """What a run record takes of model `k` of a CnnDevice (0: a model of its own) after its run:
    its epochs' loss sums, its test count, its weights, its precision note."""
    return model.read_loss_sums(model=k), model.read_correct(model=k), model.weights(model=k), model.precision_note()


def model_record(plan: RunPlan, row: str, data, precision: str, gpu_env: dict, epoch_ms: list[float], read: tuple,
                 pack: dict, run_start: float) -> RunRecord:
    """The run record of the plan from what `read_model` read: its epochs' times and losses, its
    test accuracy and weights; `pack` as it ran."""
    losses, correct, weights, precision_note = read
    accuracy = correct / plan.num_test
    entries = [EpochRecord(plan.first_epoch + e + 1, epoch_ms[e], plan.batches[e],
                           full=plan.batches[e] == plan.batches_per_epoch,
                           train_loss=float(losses[e]) / plan.samples_seen(plan.batches[e]))
               for e in range(len(plan.batches))]
    entries[-1].test_accuracy = accuracy
    record = RunRecord(stage=row, kind="stage", config=plan.config, environment=gpu_env, epochs=entries,
                       setup_ms=pack["setup_ms"], total_ms=(time.perf_counter() - run_start) * 1e3,
                       test_accuracy=accuracy, note=f"{precision_note}; packed: {pack['how']}",
                       precision=precision, data=data_summary(data),
                       params=[Layer(w, b) for w, b in zip(weights[::2], weights[1::2])])
    record.pack = pack
    return record


def axis_packs(count: int, fitting: int) -> list[list[int]]:
    """The models (0..count−1) in packs of at most min(AXIS_MAX_MODELS, fitting) models, as few
    packs as that allows, their sizes within one of each other, in order. ValueError where not
    even one model fits."""
    most = min(AXIS_MAX_MODELS, fitting)
    if most < 1:
        raise ValueError("not even one model fits")
    packs = ceil_div(count, most)
    return [list(range(p * count // packs, (p + 1) * count // packs)) for p in range(packs)]


def _train_on_axis(plans: list[RunPlan], data, precision: str, row: str, run_start: float, device, spec,
                   recipes: list, arrays) -> list[RunRecord]:
    """train_packed_cnn's "axis" mode: the models in packs on one model axis (see the module's
    docstring), trained one pack after another on the process's lane 0."""
    from graphtrain.libs import cuda
    from graphtrain.stages.cnn_device import CnnDevice
    from graphtrain.stages.cnn_shared import LANE_WORKSPACE_BYTES, MNIST_NORMALISATION, lane_of

    first, count, epochs = plans[0], len(plans), plans[0].batches
    lane = lane_of(device)
    # One model of its own: a model's bytes and evaluation passes (the first of the process also
    # uploads the dataset and loads the kernel files, which the packs then share).
    probe = CnnDevice(device, spec, recipes[0], *arrays, normalisation=MNIST_NORMALISATION, device_loop=True,
                      lane=lane)
    model_bytes, data_bytes, fused, eval_rows = probe.model_bytes, probe.data.arena.nbytes, probe.fused, probe.eval_rows
    probe.close()
    if not fused:
        raise ModelUnsupported("the cnn packs where every conv layer runs as the fused kernels; these layers run "
                               "through cuDNN, whose calls have no model axis")
    budget = int(PACK_MEMORY_FRACTION * device.total_memory) - LANE_WORKSPACE_BYTES - data_bytes
    try:
        packs = axis_packs(count, budget // model_bytes)
    except ValueError:
        raise ModelUnsupported(f"a cnn of {model_bytes / 2**20:.0f} MiB does not fit "
                               f"{budget / 2**30:.1f} GiB") from None
    outer = cuda.Stream()  # where each pack's graphs are captured and launched
    epoch_ms: list[list[float]] = [[] for _ in plans]
    reads: list[tuple | None] = [None] * count  # each model's read_model, once its pack has trained
    built_ms, model_setup_ms, capture_ms, train_ms, train_wall_ms = [], [], 0.0, 0.0, 0.0
    gpu_env: dict = {}
    objects: list = []  # what the pack training now holds: its model, then its graphs and events
    try:
        for members in packs:
            start = time.perf_counter()
            model = CnnDevice(device, spec, recipes[members[0]], *arrays, normalisation=MNIST_NORMALISATION,
                              device_loop=True, lane=lane,
                              models=len(members))
            objects.append(model)
            built_ms.append((time.perf_counter() - start) * 1e3)
            gpu_env = gpu_env or {**environment.host(), **environment.gpu(device), **model.environment()}

            def put_runs() -> None:
                """Each model's recipe, initial weights and sample orders, into its own copy."""
                for k, m in enumerate(members):
                    started = time.perf_counter()
                    model.set_recipe(recipes[m], model=k)
                    model.load(flat(plans[m].initial), plans[m].orders, model=k)
                    model_setup_ms.append((time.perf_counter() - started) * 1e3)

            # Warm up (the first launches of every kernel and product of the axis), then the runs again.
            put_runs()
            model.reset(model.stream)
            model.record_step(model.stream)
            model.record_eval(model.stream)
            model.stream.synchronize()
            del model_setup_ms[-len(members):]
            put_runs()
            capture_start = time.perf_counter()
            graphs = []
            for e, steps in enumerate(epochs):
                with cuda.Graph.capture(outer) as graph:
                    model.record_part(outer, steps, epoch=e, reset=e == 0, evaluate=e == len(epochs) - 1)
                objects.append(graph)
                graphs.append(graph)
            capture_ms += (time.perf_counter() - capture_start) * 1e3
            events = [cuda.Event() for _ in range(len(epochs) + 1)]
            objects += events
            cuda.stream_wait(outer, model.stream)  # the uploads before the first step
            wall_start = time.perf_counter()
            events[0].record(outer)
            for graph, end in zip(graphs, events[1:]):
                graph.launch(outer)
                end.record(outer)
            outer.synchronize()
            train_wall_ms += (time.perf_counter() - wall_start) * 1e3
            train_ms += events[0].elapsed_ms(events[-1])
            for k, m in enumerate(members):
                epoch_ms[m] = [a.elapsed_ms(b) for a, b in zip(events, events[1:])]
                reads[m] = read_model(model, k)
            while objects:  # the pack's memory free for the next
                objects.pop().close()
        setup_ms = (time.perf_counter() - run_start) * 1e3 - train_wall_ms
        sizes = sorted({len(members) for members in packs})
        how = (f"{count} models on one model axis: each step's launches train "
               f"{' or '.join(map(str, sizes))} models at once (grid z, strided batched products), "
               f"each epoch one graph")
        if len(packs) > 1:
            how += f"; {len(packs)} packs one after another (memory, or {AXIS_MAX_MODELS} models a launch at most)"
        pack = {"models": count, "lanes": 1, "mode": "axis", "packs": len(packs), "models_per_launch": max(sizes),
                "train_ms": train_ms, "train_wall_ms": train_wall_ms, "setup_ms": setup_ms,
                "capture_ms": capture_ms, "first_model_setup_ms": built_ms[0],
                "model_setup_ms": statistics.median(model_setup_ms), "eval_rows": eval_rows, "how": how,
                "id": f"cnn-{row}-{first.config.seed}-{first.config.lr}-{count}"}
        return [model_record(plan, row, data, precision, gpu_env, epoch_ms[m], reads[m], {**pack, "lane": 0},
                             run_start) for m, plan in enumerate(plans)]
    finally:  # the graphs and events before the model whose buffers they launch on, the stream last
        while objects:
            objects.pop().close()
        outer.close()


def flat(layers: Sequence[Layer]) -> list[np.ndarray]:
    """A plan's initial layers as the cnn's parameter list: each layer's weight, then its bias."""
    return [a for layer in layers for a in (layer.w, layer.b)]


def pack_graphs(plans: list[RunPlan], data, **options) -> list[RunRecord]:
    """The sweep's pack of the cnn on `graphs` (`train_packed_cnn`)."""
    return train_packed_cnn(plans, data, row="graphs", **options)


def pack_device_loop(plans: list[RunPlan], data, **options) -> list[RunRecord]:
    """The sweep's pack of the cnn on `device-loop` (`train_packed_cnn`)."""
    return train_packed_cnn(plans, data, row="device-loop", **options)
