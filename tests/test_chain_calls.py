"""What each rung of the ladder's chain (baseline … graphs, and `graphs` as one rank of `run --gpus`)
asks of the GPU, on the CPU: every kernel launch, every cuBLAS, cuDNN and NCCL call, every copy,
memset, stream, event and graph, with its arguments, in order, for a small MLP; and the arena's
layout. The CUDA layer (graphtrain.libs.cuda's calls, the loaded kernel modules, the three
libraries' native functions) is replaced by recorders; the rung's own code runs as it is.

tests/data/chain_calls.json holds the sequences as a revision recorded them; a rung's code may be
rearranged, but what it queues may change only together with that file, rewritten on purpose:

    PYTHONPATH=. python tests/test_chain_calls.py --write

Pointers are the fake allocations' addresses (one arena a rung, at a fixed base), so a buffer
moved in the arena shows as other arguments; an upload is its bytes' hash, so other initial
weights or another sample order show too.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from graphtrain import kernels
from graphtrain.config import TrainConfig
from graphtrain.data import Dataset
from graphtrain.libs import cublas, cuda, cudnn, nccl, nvrtc
from graphtrain.plan import RunPlan

# Recorded from the revision before the chain's parts; since then one change on purpose: the
# optimizer's launch takes the model axis's stride (kernels/optim.cu), 0 for one model.
EXPECTED = Path(__file__).parent / "data" / "chain_calls.json"
FAKE_DEVICE = cuda.DeviceInfo(0, "test GPU", (9, 0), "sm_90", 132, 80 << 30, "13.0", "13.0",
                              228 * 1024, 64 * 1024, 2048)

# name -> (rung, config overrides, data-parallel rank of 2 or None)
CASES = {
    "baseline": ("baseline", {}, None),
    "baseline-softmax-regression": ("baseline", {"hidden": ()}, None),
    "baseline-two-hidden-no-bias": ("baseline", {"hidden": (8, 6), "bias": False}, None),
    "fewer-syncs": ("fewer-syncs", {}, None),
    "cublas": ("cublas", {}, None),
    "cublas-tf32": ("cublas", {"precision": "tf32"}, None),
    "sparse-metrics": ("sparse-metrics", {}, None),
    "cudnn-softmax": ("cudnn-softmax", {}, None),
    "cudnn-softmax-regression": ("cudnn-softmax", {"hidden": (), "bias": False}, None),
    "graphs": ("graphs", {}, None),
    "graphs-tf32": ("graphs", {"precision": "tf32"}, None),
    "graphs-adam": ("graphs", {"optimizer": "adam", "schedule": "one-cycle", "lr": 0.01}, None),
    "graphs-two-hidden-no-bias": ("graphs", {"hidden": (8, 6), "bias": False}, None),
    "graphs-rank-1-of-2": ("graphs", {}, 1),
    "graphs-rank-0-of-2-tf32": ("graphs", {"precision": "tf32"}, 0),
}


class Recorder:
    """The calls, as lines of text, in the order they were made."""

    def __init__(self):
        self.calls: list[str] = []
        self.next_id = 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def add(self, *parts) -> None:
        self.calls.append(" ".join(str(part) for part in parts))


def plain(value):
    """An argument as text: a stream by its id, a ctypes reference by what it refers to."""
    if isinstance(value, FakeStream):
        return f"stream{value.id}"
    if isinstance(value, ctypes._SimpleCData):
        return plain(value.value)
    if type(value).__name__ == "CArgObject":  # ctypes.byref(x)
        return f"&{plain(value._obj)}"
    if isinstance(value, ctypes.Structure):
        return type(value).__name__
    if isinstance(value, float):
        return repr(float(np.float32(value))) if value == np.float32(value) else repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(plain(v) for v in value) + ")"
    return repr(value)


class FakeStream:
    def __init__(self, rec: Recorder):
        self.rec, self.id = rec, rec.new_id()
        self.handle = 0x5000 + self.id
        rec.add("stream", self.id)

    def synchronize(self):
        self.rec.add("synchronize", plain(self))

    def close(self):
        self.rec.add("close", plain(self))


class FakeEvent:
    def __init__(self, rec: Recorder):
        self.rec, self.id = rec, rec.new_id()
        rec.add("event", self.id)

    def record(self, stream):
        self.rec.add("event-record", self.id, plain(stream))

    def synchronize(self):
        self.rec.add("event-synchronize", self.id)

    def elapsed_ms(self, end):
        return 1.0

    def close(self):
        self.rec.add("close event", self.id)


class FakeGraph:
    def __init__(self, rec: Recorder):
        self.rec, self.id = rec, rec.new_id()

    def launch(self, stream):
        self.rec.add("graph-launch", self.id, plain(stream))

    def close(self):
        self.rec.add("graph-close", self.id)


class FakeLibrary:
    """A native library whose every function records its name and arguments and returns 0 (a
    handle or descriptor it creates gets a fresh number; a version asked for, a fixed one)."""

    def __init__(self, rec: Recorder, name: str):
        self.rec, self.name = rec, name

    def __getattr__(self, function: str):
        def call(*args):
            for arg in args:
                target = getattr(arg, "_obj", None)
                if isinstance(target, ctypes.c_void_p) and ("Create" in function or "InitRank" in function):
                    target.value = 0x9000 + self.rec.new_id()
                elif isinstance(target, ctypes.c_int) and ("Version" in function or "Property" in function):
                    target.value = 7
            self.rec.add(function, *(plain(arg) for arg in args))
            return 90000 if function == "cudnnGetVersion" else 0

        return call


def fake_module(rec: Recorder):
    class FakeModule:
        def __init__(self, name, cubin, specs, device):
            rec.add("module", name)
            self.names = {spec.name for spec in specs}

        def __getitem__(self, name):
            assert name in self.names

            def launch(stream, grid, block, *args, shared_bytes=0):
                rec.add("launch", name, plain(grid), plain(block), plain(stream), *(plain(a) for a in args),
                        f"smem={shared_bytes}")

            return launch

    return FakeModule


@contextmanager
def recording(monkeypatch):
    rec = Recorder()
    bases = iter(range(1, 100))

    def malloc(nbytes):
        base = next(bases) << 32
        rec.add("malloc", nbytes, "->", base)
        return base

    def copy_to_device(ptr, array, stream):
        digest = hashlib.sha1(np.ascontiguousarray(array).tobytes()).hexdigest()[:12]
        rec.add("copy_to_device", ptr, array.dtype, array.shape, digest, plain(stream))

    def copy_to_host(ptr, out, stream):
        rec.add("copy_to_host", ptr, out.dtype, out.shape, plain(stream))
        out[...] = 0
        return out

    @contextmanager
    def capture(cls, stream):
        graph = FakeGraph(rec)
        rec.add("capture-begin", graph.id, plain(stream))
        yield graph
        rec.add("capture-end", graph.id)

    def cubin_async(cls, arch, defines=None):
        done: Future = Future()
        done.set_result(b"cubin")
        return done

    monkeypatch.setattr(cuda, "open_device", lambda ordinal=0: FAKE_DEVICE)
    monkeypatch.setattr(cuda, "Stream", lambda: FakeStream(rec))
    monkeypatch.setattr(cuda, "Event", lambda: FakeEvent(rec))
    monkeypatch.setattr(cuda, "malloc", malloc)
    monkeypatch.setattr(cuda, "free", lambda ptr: rec.add("free", ptr))
    monkeypatch.setattr(cuda, "copy_to_device", copy_to_device)
    monkeypatch.setattr(cuda, "copy_to_host", copy_to_host)
    monkeypatch.setattr(cuda, "memset", lambda ptr, value, nbytes, stream: rec.add("memset", ptr, value, nbytes,
                                                                                   plain(stream)))
    monkeypatch.setattr(cuda.Graph, "capture", classmethod(capture))
    monkeypatch.setattr(cuda, "wait_for_head_starts", lambda: rec.add("wait_for_head_starts"))
    monkeypatch.setattr(kernels, "Module", fake_module(rec))
    monkeypatch.setattr(kernels, "_FILES", {})
    monkeypatch.setattr(kernels.KernelFile, "cubin_async", classmethod(cubin_async))
    monkeypatch.setattr(nvrtc, "version", lambda: "13.0")
    for library in (cublas.library, cudnn.library, nccl.library):
        monkeypatch.setattr(library, "load", lambda name=library.name: FakeLibrary(rec, name))
    yield rec


def run_case(name: str, monkeypatch) -> list[str]:
    """Everything the case's rung queues, from its construction to its close."""
    from graphtrain.stages import get_stage
    from graphtrain.stages import data_parallel as dp

    rung, overrides, rank = CASES[name]
    data = Dataset.synthetic(80, 20, seed=3, num_features=12, num_classes=5)
    settings = dict(batch=32, epochs=3, hidden=(8,), metrics_every=2, seed=5, lr=0.1)
    config = TrainConfig(**{**settings, **overrides})
    plan = RunPlan.for_data(config, data)
    with recording(monkeypatch) as rec:
        if rank is None:
            cls = get_stage(rung)
        else:
            cls = get_stage(rung, "mlp", data_parallel=True).for_group(dp.Group(rank, 2, bytes(128)))
        stage = cls(plan, data)
        rec.add("class", cls.__name__, "precision", stage.precision, "note", repr(stage.note))
        rec.add("uses", sorted(cls.uses), "first_uses", [f.__module__ for f in cls.first_uses()])
        rec.add("needs", {what: stage.needs(what) for what in ("matmul", "softmax", "cublas", "cudnn")})
        stage.setup()
        rec.add("arena", [(n, b.offset, b.shape, str(b.dtype)) for n, b in stage.arena.buffers.items()])
        for epoch, rows in enumerate(plan.batches):
            measure = stage.measures(epoch)
            result = stage.train_epoch(epoch, rows, measure)
            rec.add("epoch", epoch, measure, result)
        rec.add("accuracy", stage.test_accuracy())
        rec.add("weights", [(layer.w.shape, None if layer.b is None else layer.b.shape) for layer in stage.weights()])
        rec.add("library_versions", sorted(stage.library_versions()))
        stage.close()
    return rec.calls


@pytest.mark.parametrize("name", list(CASES))
def test_a_chain_rung_queues_what_it_queued_before(name, monkeypatch):
    expected = json.loads(EXPECTED.read_text(encoding="utf-8"))[name]
    calls = run_case(name, monkeypatch)
    first = next((i for i, (a, b) in enumerate(zip(calls, expected)) if a != b), min(len(calls), len(expected)))
    assert calls == expected, (f"{name}: call {first} differs\n  now:    "
                               f"{calls[first] if first < len(calls) else '(none)'}\n  before: "
                               f"{expected[first] if first < len(expected) else '(none)'}")


def write_expected() -> None:
    """Record every case with this revision's code into EXPECTED."""
    out = {}
    mp = pytest.MonkeyPatch()
    for name in CASES:
        with mp.context() as patch:
            out[name] = run_case(name, patch)
    EXPECTED.write_text(json.dumps(out, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {EXPECTED}: {', '.join(f'{k} {len(v)}' for k, v in out.items())} calls")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: tests/test_chain_calls.py --write")
    write_expected()
