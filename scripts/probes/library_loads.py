"""What loading each NVIDIA library costs a run, and whether the load holds Python's lock.

    python3 scripts/probes/library_loads.py

In a fresh process: CUDA started, then NVRTC, cuBLASLt, cuBLAS and cuDNN loaded one after another
on a second thread (as `graphtrain run`'s head start does) while this thread counts how long it
goes without running: a load that holds the GIL stalls it for the load's length."""

from __future__ import annotations

import threading
import time

from graphtrain.libs import cublas, cublaslt, cuda, cudnn, nvrtc

LOADS = [("cuInit + context", lambda: cuda.open_device()), ("NVRTC", nvrtc.version),
         ("cuBLASLt", cublaslt.library.load), ("cuBLAS", cublas.library.load), ("cuDNN", cudnn.library.load)]


def main() -> None:
    spans: list[tuple[str, float, float]] = []

    def loads() -> None:
        for name, load in LOADS:
            start = time.perf_counter()
            load()
            spans.append((name, start, time.perf_counter()))

    worker = threading.Thread(target=loads)
    gaps: list[tuple[float, float]] = []  # (when, how long) this thread did not run
    last = time.perf_counter()
    worker.start()
    while worker.is_alive():
        now = time.perf_counter()
        if now - last > 2e-3:
            gaps.append((last, now - last))
        last = now
    for name, start, end in spans:
        stalled = sum(min(end, at + gap) - max(start, at) for at, gap in gaps if at < end and at + gap > start)
        print(f"{name:18s} {1e3 * (end - start):7.1f} ms, this thread stalled {1e3 * stalled:7.1f} ms of it")


if __name__ == "__main__":
    main()
