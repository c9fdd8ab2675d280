#!/usr/bin/env python3
"""What one eager kernel launch costs the host, graphtrain's way and NVIDIA cuda.core's way.

    python3 scripts/benchmarks/launch_cost.py [--launches 20000]

Launches kernels/layers.cu's `sgd_update` (w -= lr·dw over 4,096 floats: a kernel shorter than
its launch, so the host sets the pace) back to back on one stream and reports the host time per
launch: after a warm-up round, the rows take turns for five rounds, and each row's median counts.

- launcher: graphtrain's `Layers.sgd_update` (computes its grid, then the Kernel call);
- Kernel: the Kernel object with a grid given, the part graphtrain owns;
- cuLaunchKernel: cuda.bindings with every argument prepared beforehand, the floor from Python;
- cuda.core launch, prepared: `launch()` with a LaunchConfig and numpy scalars made beforehand;
- cuda.core launch, per call: what an eager step does with it: the scalars (np.float32 for a
  float, np.int32 for an int) and the LaunchConfig made for each launch.

The same cubin, context and stream serve every row. cuda.core rows are left out, with a note,
where it is not installed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from graphtrain.kernels import ceil_div
from graphtrain.kernels.layers import THREADS, Layers
from graphtrain.libs import cuda
from graphtrain.libs.memory import Arena

N = 4096


def timed_round(launch, count: int, stream: cuda.Stream) -> float:
    """µs per launch over `count` launches, the stream drained before and after."""
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        launch()
    stream.synchronize()
    return (time.perf_counter() - start) / count * 1e6


def cuda_core_rows(device: cuda.DeviceInfo, stream: cuda.Stream, w: int, dw: int, lr: float) -> dict:
    try:
        from cuda import core
    except ImportError as exc:
        return {"cuda.core": f"not installed ({exc})"}
    api = core if hasattr(core, "launch") else core.experimental
    core_device = api.Device(device.ordinal)
    core_device.set_current()

    class Handle:  # the stream protocol cuda.core accepts for a stream it does not own
        def __cuda_stream__(self):
            return (0, int(stream.handle))

    try:
        core_stream = core_device.create_stream(Handle())
    except Exception:  # releases before the __cuda_stream__ method take the raw handle instead
        core_stream = api.Stream.from_handle(int(stream.handle))
    kernel = api.ObjectCode.from_cubin(Layers.cubin(device.arch)).get_kernel("sgd_update")
    grid = ceil_div(N, THREADS)
    config = api.LaunchConfig(grid=grid, block=THREADS)
    lr32, n32 = np.float32(lr), np.int32(N)
    return {
        "cuda.core launch, prepared": lambda: api.launch(core_stream, config, kernel, w, dw, lr32, n32),
        "cuda.core launch, per call": lambda: api.launch(core_stream, api.LaunchConfig(grid=ceil_div(N, THREADS),
                                                                                       block=THREADS),
                                                         kernel, w, dw, np.float32(lr), np.int32(N)),
        "cuda.core version": getattr(core, "__version__", "?"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20_000)
    args = parser.parse_args()

    device = cuda.open_device()
    stream = cuda.Stream()
    layers = Layers(device)
    arena = Arena()
    w_buf, dw_buf = arena.reserve("w", (N,)), arena.reserve("dw", (N,))
    arena.allocate()
    w_buf.upload(np.zeros(N, np.float32), stream)
    dw_buf.upload(np.zeros(N, np.float32), stream)
    w, dw, lr, grid = w_buf.ptr, dw_buf.ptr, 0.1, ceil_div(N, THREADS)

    kernel = layers._sgd_update
    driver = cuda.driver_api()
    handle = stream.handle
    rows = {
        "launcher (Layers.sgd_update)": lambda: layers.sgd_update(stream, w, dw, lr, N),
        "Kernel call": lambda: kernel(stream, grid, THREADS, w, dw, lr, N),
        "cuLaunchKernel, prepared": lambda: driver.cuLaunchKernel(kernel._function, grid, 1, 1, THREADS, 1, 1, 0,
                                                                  handle, kernel._params, 0),
        **cuda_core_rows(device, stream, w, dw, lr),
    }
    print(f"{device.name}, {args.launches} launches of sgd_update per round, median of 5 rounds")
    timings: dict[str, list[float]] = {}
    for name, launch in rows.items():
        if not callable(launch):
            print(f"  {name:32s} {launch}")
            continue
        try:
            timed_round(launch, args.launches, stream)  # warm-up: clocks, caches, first-call paths
            timings[name] = []
        except Exception as exc:  # an API this cuda.core release lacks: say so, and measure the rest
            print(f"  {name:32s} failed: {type(exc).__name__}: {exc}")
    for _ in range(5):
        for name in timings:
            timings[name].append(timed_round(rows[name], args.launches, stream))
    for name, rounds in timings.items():
        print(f"  {name:32s} {statistics.median(rounds):6.2f} µs per launch")
    layers.close()
    arena.close()
    stream.close()


if __name__ == "__main__":
    main()
