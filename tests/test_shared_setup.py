"""What a process sets up once and shares, on the CPU: kernel files loaded once per device and
defines (graphtrain.kernels.KernelFile), the optimizer's constants record against optim.cu's
struct, the cnn's dataset resident once per device (graphtrain.stages.cnn_shared), the cnn's
packed parameter layout and its refusals of a recipe that a capture cannot take."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from graphtrain import kernels
from graphtrain import reference_cnn as R
from graphtrain.libs import cuda

FAKE_DEVICE = cuda.DeviceInfo(0, "test GPU", (9, 0), "sm_90", 132, 80 << 30, "13.0", "13.0",
                              228 * 1024, 64 * 1024, 2048)


# ---- kernel files: one module per class, device and defines ------------------------------------


class _Scale(kernels.KernelFile):
    stem = "scale_test"
    defines = {"N": 1}
    _scale = kernels.kernel("scale", kernels.PTR, kernels.F32, kernels.I32)


@pytest.fixture
def loads(monkeypatch):
    """Module loads counted (no GPU: a stand-in module; the compile: a done future)."""
    made = []

    class FakeModule:
        def __init__(self, name, cubin, specs, device):
            self.kernels = {spec.name: ("kernel", len(made), spec.name) for spec in specs}
            made.append((name, cubin, device))

        def __getitem__(self, name):
            return self.kernels[name]

    def cubin_async(cls, arch, defines=None):
        done: Future = Future()
        done.set_result(f"{arch} {sorted({**cls.defines, **(defines or {})}.items())}".encode())
        return done

    monkeypatch.setattr(kernels, "Module", FakeModule)
    monkeypatch.setattr(_Scale, "cubin_async", classmethod(cubin_async))
    monkeypatch.setattr(kernels, "_FILES", {})
    return made


def test_a_kernel_file_is_loaded_once_per_device_and_defines(loads):
    first, second = _Scale(FAKE_DEVICE), _Scale(FAKE_DEVICE)
    assert len(loads) == 1 and first.module is second.module and first._scale is second._scale
    other = _Scale(FAKE_DEVICE, {"N": 2})  # other defines: another cubin, another module
    assert len(loads) == 2 and other.module is not first.module
    assert _Scale(FAKE_DEVICE, {"N": 1}).module is first.module  # the class's own value given again


def test_closing_an_instance_keeps_the_module_for_the_next(loads):
    first = _Scale(FAKE_DEVICE)
    first.close()
    again = _Scale(FAKE_DEVICE)
    assert len(loads) == 1 and again.module is first.module


def test_a_device_opened_again_loads_the_file_again(loads):
    _Scale(FAKE_DEVICE)
    reopened = cuda.DeviceInfo(*vars(FAKE_DEVICE).values())  # equal, but another context's
    assert reopened == FAKE_DEVICE
    _Scale(reopened)
    assert len(loads) == 2 and loads[1][2] is reopened


def test_a_failed_compile_is_tried_again(loads, monkeypatch):
    attempts = []

    def failing(cls, arch, defines=None):
        attempts.append(arch)
        future: Future = Future()
        future.set_exception(RuntimeError("compile failed"))
        return future

    monkeypatch.setattr(_Scale, "cubin_async", classmethod(failing))
    with pytest.raises(RuntimeError, match="compile failed"):
        _Scale(FAKE_DEVICE)
    with pytest.raises(RuntimeError, match="compile failed"):
        _Scale(FAKE_DEVICE)
    assert len(attempts) == 2 and not loads


# ---- the optimizer's constants on the device ---------------------------------------------------


def test_the_constants_record_is_optim_cus_struct(nvrtc_available, cache):
    """optim.cu's static_asserts follow optim.py's CONSTANTS: it compiles as it is, and not with a
    record whose fields are in another order, of another type or of another size."""
    from graphtrain.kernels.optim import CONSTANTS, Optim, layout_defines
    from graphtrain.libs.nvrtc import NvrtcError

    assert Optim.cubin("sm_90").startswith(b"\x7fELF")
    names = list(CONSTANTS.names)
    swapped = np.dtype([(n, CONSTANTS.fields[n][0]) for n in [names[1], names[0], *names[2:]]])
    retyped = np.dtype([(n, np.float32 if n == "total" else CONSTANTS.fields[n][0]) for n in names])
    longer = np.dtype([*((n, CONSTANTS.fields[n][0]) for n in names), ("extra", np.float32)])
    for record, field in ((swapped, "momentum"), (retyped, "total"), (longer, None)):
        with pytest.raises(NvrtcError, match=f"OptimizerConstants{'.' + field if field else ''}"):
            Optim.cubin("sm_90", layout_defines(record))


def test_the_constants_record_holds_the_recipe_in_float32():
    from graphtrain.kernels.optim import constants_of

    optimizer = R.Optimizer("adamw", momentum=0.5, betas=(0.7, 0.9), eps=1e-7, weight_decay=0.1)
    schedule = R.Schedule("warmup", 0.013, 235, warmup_steps=12, pct=0.25, div=20.0, final_div=1e3)
    record = constants_of(optimizer, schedule)[0]
    assert (record["optimizer"], record["schedule"], record["total"], record["warmup"]) == (4, 1, 235, 12)
    for field, value in (("momentum", 0.5), ("beta1", 0.7), ("beta2", 0.9), ("eps", 1e-7), ("weight_decay", 0.1),
                         ("lr", 0.013), ("pct", 0.25), ("div", 20.0), ("final_div", 1e3)):
        assert record[field] == np.float32(value), field


def test_a_device_optimizer_refuses_an_optimizer_it_has_no_room_for():
    from graphtrain.libs.memory import Arena
    from graphtrain.stages.device import DeviceOptimizer

    arena = Arena()
    params, grads = arena.reserve("params", (100,)), arena.reserve("grads", (100,))
    momentum = DeviceOptimizer.over_span(arena, params, grads, R.Optimizer("momentum"), R.Schedule())
    assert momentum.slot1 is not None and momentum.slot2 is None
    assert momentum.refusal(R.Optimizer("nesterov")) is None and momentum.refusal(R.Optimizer("sgd")) is None
    assert "adam keeps 2 state arrays a parameter, and 1 were allocated" in momentum.refusal(R.Optimizer("adam"))
    with pytest.raises(ValueError, match="adam keeps 2"):
        momentum.set_recipe(R.Optimizer("adam"), R.Schedule())  # refused before any copy
    roomy = DeviceOptimizer.over_span(Arena(), params, grads, R.Optimizer("sgd"), R.Schedule(), slots=2)
    assert roomy.refusal(R.Optimizer("adamw")) is None
    with pytest.raises(ValueError, match="adam needs 2"):
        DeviceOptimizer.over_span(Arena(), params, grads, R.Optimizer("adam"), R.Schedule(), slots=1)
    with pytest.raises(RuntimeError, match="not laid out"):
        DeviceOptimizer.over_span(Arena(), params, arena.reserve("short", (99,)), R.Optimizer("sgd"), R.Schedule())


# ---- the cnn's parameters and evaluation passes ------------------------------------------------


def test_the_cnns_parameters_lie_aligned_in_one_span_and_round_trip(seed):
    from graphtrain.libs.memory import Arena
    from graphtrain.stages.cnn_layers import PARAM_ALIGN, Parameter, ParameterSpan

    params = [Parameter("conv0.weight", (6, 1, 5, 5), khwc=True), Parameter("conv0.bias", (6,)),
              Parameter("linear0.weight", (10, 96)), Parameter("linear0.bias", (10,))]
    span = ParameterSpan(Arena(), params)
    assert [p.offset for p in params] == [0, 192, 256, 1216]  # 150 → 192, 6 → 64, 960, then the bias
    assert all(p.offset % PARAM_ALIGN == 0 for p in params) and span.params.shape == span.grads.shape == (1280,)
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
    flat = span.pack(values)
    assert np.array_equal(flat[:150], values[0].transpose(0, 2, 3, 1).ravel()), f"seed {seed}"  # KHWC
    assert not flat[150:192].any() and not flat[198:256].any(), "the padding is zero"
    assert all(np.array_equal(a, b) for a, b in zip(span.unpack(flat), values)), f"seed {seed}"
    with pytest.raises(ValueError, match="linear0.weight"):
        span.pack([*values[:2], values[2].T, values[3]])


@pytest.mark.parametrize("num_test,max_rows,expected", [
    (10_000, 10_000, (10_000, 1)), (300, 10_000, (300, 1)), (10_000, 2_500, (2_500, 4)),
    (10_000, 3_000, (2_500, 4)), (25_001, 10_000, (8_334, 3)), (7, 2, (2, 4))])
def test_an_evaluation_runs_in_equal_passes_within_the_padding(num_test, max_rows, expected):
    from graphtrain.stages.cnn_device import eval_passes
    from graphtrain.stages.cnn_shared import MAX_EVAL_PASSES

    rows, passes = eval_passes(num_test, max_rows)
    assert (rows, passes) == expected and rows <= max_rows
    assert (passes - 1) * rows < num_test <= passes * rows <= num_test + MAX_EVAL_PASSES - 1


def test_an_evaluation_of_too_many_passes_is_refused():
    from graphtrain.stages.cnn_device import eval_passes

    with pytest.raises(ValueError, match="65 passes"):
        eval_passes(6_500, 100)


# ---- the resident dataset ------------------------------------------------------------------------


@pytest.fixture
def fake_uploads(monkeypatch):
    """Device memory and copies as counters (no GPU)."""
    from graphtrain.stages import cnn_shared

    counts = {"mallocs": 0, "frees": 0, "uploads": 0}

    def malloc(nbytes):
        counts["mallocs"] += 1
        return counts["mallocs"] << 32

    monkeypatch.setattr(cuda, "malloc", malloc)
    monkeypatch.setattr(cuda, "free", lambda ptr: counts.__setitem__("frees", counts["frees"] + 1))
    monkeypatch.setattr(cuda, "copy_to_device", lambda dst, src, stream: counts.__setitem__(
        "uploads", counts["uploads"] + 1))
    monkeypatch.setattr(cnn_shared, "_resident", [])
    # An upload beside the caller: its thread sets the device and uploads on a stream of its own.
    monkeypatch.setattr(cuda, "runtime_api", lambda: _FakeRuntime)
    monkeypatch.setattr(cuda, "Stream", _FakeStream)
    yield counts
    # Every upload begun beside the test done (and its failure, if no caller took it, raised here)
    # before the fakes are undone: a thread still running would reach the real calls with fake streams.
    cuda.wait_for_head_starts()


class _FakeRuntime:
    @staticmethod
    def cudaSetDevice(ordinal: int) -> int:
        return 0


class _FakeStream:
    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


def _ready_all() -> None:
    """Every dataset's upload begun beside waited for (they run on threads of their own)."""
    from graphtrain.stages import cnn_shared

    for data in list(cnn_shared._resident):
        data.ready()


def dataset(seed: int, n: int = 50):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 784)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32),
            rng.standard_normal((20, 784)).astype(np.float32), rng.integers(0, 10, 20).astype(np.int32))


def test_a_dataset_is_uploaded_once_per_device_and_arrays(fake_uploads):
    from graphtrain.stages.cnn_shared import MAX_EVAL_PASSES, resident_data

    arrays = dataset(0)
    first = resident_data(FAKE_DEVICE, *arrays, None).acquire().ready()
    assert fake_uploads["uploads"] == 4 and first.test_x.shape == (20 + MAX_EVAL_PASSES - 1, 784)
    assert resident_data(FAKE_DEVICE, *arrays, None) is first and fake_uploads["uploads"] == 4
    copies = tuple(a.copy() for a in arrays)  # equal, but other arrays: the key is their identity
    assert resident_data(FAKE_DEVICE, *copies, None).ready() is not first and fake_uploads["uploads"] == 8
    reopened = cuda.DeviceInfo(*vars(FAKE_DEVICE).values())
    assert resident_data(reopened, *arrays, None) is not first


def test_a_dataset_no_model_holds_goes_when_room_is_needed(fake_uploads):
    from graphtrain.stages.cnn_shared import MAX_RESIDENT, _resident, resident_data

    held = resident_data(FAKE_DEVICE, *dataset(0), None).acquire()
    others = [resident_data(FAKE_DEVICE, *dataset(seed), None) for seed in range(1, MAX_RESIDENT + 2)]
    _ready_all()
    assert held in _resident and len(_resident) == MAX_RESIDENT, "the held one stays, unused ones make room"
    assert others[-1] in _resident and fake_uploads["frees"] == MAX_RESIDENT
    held.release()
    with pytest.raises(RuntimeError, match="released more often"):
        held.release()


def test_an_upload_begun_beside_is_waited_for_where_the_data_is_used(fake_uploads, monkeypatch):
    """The upload runs on a thread of its own: `ready` waits for all of it (the caller's setup
    goes on meanwhile), and a stream given uploads at once, before resident_data returns."""
    import threading

    from graphtrain.stages.cnn_shared import resident_data

    gate, copy = threading.Event(), cuda.copy_to_device

    def held_copy(dst, src, stream):
        gate.wait(5)
        copy(dst, src, stream)

    monkeypatch.setattr(cuda, "copy_to_device", held_copy)
    data = resident_data(FAKE_DEVICE, *dataset(0), None)
    assert fake_uploads["uploads"] == 0 and data.uploading.thread.is_alive(), "resident_data returned at once"
    gate.set()
    assert data.ready() is data and fake_uploads["uploads"] == 4
    monkeypatch.setattr(cuda, "copy_to_device", copy)
    resident_data(FAKE_DEVICE, *dataset(1), _FakeStream())
    assert fake_uploads["uploads"] == 8, "with a stream, uploaded before it returns"


def test_a_failed_upload_surfaces_where_the_data_is_used_and_is_dropped(fake_uploads, monkeypatch):
    from graphtrain.stages.cnn_shared import _resident, resident_data

    def fails(dst, src, stream):
        raise cuda.CudaError("cudaMemcpyAsync(HostToDevice)", "cudaErrorMemoryAllocation")

    monkeypatch.setattr(cuda, "copy_to_device", fails)
    arrays = dataset(0)
    data = resident_data(FAKE_DEVICE, *arrays, None).acquire()
    with pytest.raises(cuda.CudaError, match="cudaErrorMemoryAllocation"):
        data.ready()
    assert data not in _resident and fake_uploads["frees"] == 1, "dropped: its memory freed"
    cuda.wait_for_head_starts()  # handed to the caller already: not raised again
    monkeypatch.setattr(cuda, "copy_to_device", lambda dst, src, stream: None)
    assert resident_data(FAKE_DEVICE, *arrays, None).ready() is not data, "the next model uploads it again"


def test_a_failed_upload_of_data_no_model_holds_is_raised_by_the_wait_not_by_its_dropping(
        fake_uploads, monkeypatch):
    """A dataset whose model failed before using it, its upload failed too: dropping it to make
    room for other data waits for the upload and frees it without raising in that other data's
    setup; the failure is not lost: the wait for the head starts raises it."""
    from graphtrain.stages.cnn_shared import MAX_RESIDENT, _resident, resident_data

    copy = cuda.copy_to_device

    def fails(dst, src, stream):
        raise cuda.CudaError("cudaMemcpyAsync(HostToDevice)", "cudaErrorMemoryAllocation")

    monkeypatch.setattr(cuda, "copy_to_device", fails)
    orphan = resident_data(FAKE_DEVICE, *dataset(0), None)  # acquired and released by a failed setup
    monkeypatch.setattr(cuda, "copy_to_device", copy)
    others = [resident_data(FAKE_DEVICE, *dataset(seed), None).acquire() for seed in range(1, MAX_RESIDENT + 1)]
    assert orphan not in _resident and fake_uploads["frees"] == 1, "dropped: its memory freed"
    assert all(data.ready() in _resident for data in others)
    with pytest.raises(cuda.HeadStartError, match="cudaErrorMemoryAllocation"):
        cuda.wait_for_head_starts()


def test_the_first_use_makes_lane_0_and_its_handle_for_the_setup(monkeypatch):
    """cnn_shared.first_use, on its thread, makes lane 0 and its cuBLASLt handle, then makes one
    algorithm query on that handle; the setup's lane_of takes that lane and that handle (waiting
    where they are still being made)."""
    import threading

    from graphtrain.stages import cnn_shared

    made, queries, entered, gate = [], [], threading.Event(), threading.Event()

    class FakeLt:
        def __init__(self, workspace, nbytes, arch):
            entered.set()
            gate.wait(5)
            made.append(threading.current_thread().name)

    class FakeLane(cnn_shared.Lane):
        def __init__(self, device, index):  # no stream, no memory: the handle's making only
            self.device, self.index, self._lt, self._lt_lock = device, index, None, threading.Lock()
            self.workspace = type("Workspace", (), {"ptr": 0, "nbytes": 1})()

    def fake_query(lt, shape):  # cuBLASLt's heuristics, set up at their first query
        queries.append((lt, shape, threading.current_thread().name))

    monkeypatch.setattr(cnn_shared, "Lt", FakeLt)
    monkeypatch.setattr(cnn_shared, "Lane", FakeLane)
    monkeypatch.setattr(cnn_shared, "choose_algo", fake_query)
    monkeypatch.setattr(cnn_shared, "_lanes", {})
    monkeypatch.setattr(cuda, "open_device", lambda: FAKE_DEVICE)
    thread = threading.Thread(target=cnn_shared.first_use, name="first-use")
    thread.start()
    try:
        assert entered.wait(5)  # the first use is making the handle
        lane = cnn_shared.lane_of(FAKE_DEVICE)
        gate.set()
        handle = lane.lt()  # waits for the first use's handle rather than making another
        thread.join(5)
        assert made == ["first-use"] and lane.lt() is handle and cnn_shared.lane_of(FAKE_DEVICE) is lane
        assert queries == [(handle, cnn_shared.FIRST_QUERY, "first-use")], "one query, after the handle"
    finally:
        gate.set()
        thread.join(5)


# ---- a recipe on a built cnn ------------------------------------------------------------------------


def test_a_built_cnn_takes_another_lr_schedule_and_optimizer_but_not_another_capture():
    from graphtrain.recipe import Recipe
    from graphtrain.stages.cnn_device import capture_refusal

    built = Recipe(batch=256, epochs=1, optimizer=R.Optimizer("adam"), schedule=R.Schedule("one-cycle", 0.01, 235))
    for other in (R.Optimizer("sgd"), R.Optimizer("momentum", 0.8), R.Optimizer("adamw", weight_decay=0.1)):
        assert capture_refusal(built, Recipe(256, 1, other, R.Schedule("cosine", 0.02, 235))) is None
    assert capture_refusal(built, Recipe(256, 1, schedule=R.Schedule("warmup", 0.1, 300, 10))) is None
    why = capture_refusal(built, Recipe(batch=128, epochs=2, precision="fp32"))
    assert why == ("what the model's captures hold differs: batch 128 (the model's is 256), epochs 2 (the model's "
                   "is 1), precision fp32 (the model's is tf32)")


# ---- the cnn's packs in the registry ------------------------------------------------------------


def test_the_cnn_packs_on_graphs_and_device_loop_and_the_mlps_as_before():
    from graphtrain import stages
    from graphtrain.config import preset

    cnn, mlp, softmax = preset("speedrun"), preset("cuda-mnist"), preset("cuda-mnist").replace(hidden=())
    assert cnn.model == "cnn" and mlp.model == "mlp" and mlp.hidden and not softmax.hidden
    packs = {name: [spec.pack_for(config) for config in (cnn, mlp, softmax)] for name, spec in stages.SPECS.items()}
    for name in ("graphs", "device-loop"):
        pack = packs[name][0]
        assert pack is stages.SPECS[name].pack_cnn and callable(stages.load_target(pack.target)), name
        assert packs[name][1:] == [None, None], f"{name}: its MLPs run alone"
    persistent = stages.SPECS["persistent"].pack
    assert packs["persistent"] == [None, None, persistent], "softmax regressions only"
    vmapped = stages.SPECS["jax-vmap"].pack
    assert packs["jax-vmap"][1:] == [vmapped, vmapped]
    assert {name for name, found in packs.items() if found[0] is not None} <= {"graphs", "device-loop", "jax-vmap"}


def test_a_pack_spreads_its_models_over_lanes_and_groups():
    from graphtrain.stages.cnn_pack import groups_of, lane_models

    assert lane_models(5, 2) == [[0, 2, 4], [1, 3]] and lane_models(3, 3) == [[0], [1], [2]]
    assert groups_of(5, 2) == [[0, 1], [2, 3], [4]] and groups_of(64, 64) == [list(range(64))]
    # group j holds the j-th model of every lane
    assert all(lane_models(64, 8)[lane][j] == groups_of(64, 8)[j][lane] for lane in range(8) for j in range(8))


def test_a_pack_evaluates_in_smaller_passes_only_where_its_models_do_not_fit():
    from graphtrain.stages.cnn_pack import fitting_eval_rows

    mib, row = 2**20, 20 * 1024
    # 64 models of 210 MiB (activations of 10000 rows, 20 KiB a row, and 15 MiB more) in 80 GiB: as they are
    model = 10_000 * row + 15 * mib
    assert fitting_eval_rows(64, model, row, 10_000, 256, 80 * 1024 * mib) == 10_000
    # in 8 GiB: 128 MiB a model, of which 15 MiB do not scale: (128 − 15) MiB in rows of 20 KiB
    assert fitting_eval_rows(64, model, row, 10_000, 256, 8 * 1024 * mib) == (113 * mib) // row == 5785
    with pytest.raises(ValueError, match="do not fit"):
        fitting_eval_rows(64, model, row, 10_000, 256, 64 * 18 * mib)  # 3 MiB a model for rows: 153 < 256
