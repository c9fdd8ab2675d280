"""The only part of graphtrain that talks to CUDA: runtime, NVRTC kernels, cuBLAS and cuDNN.

    cuda.py        cuda.bindings: checked calls, device, streams, events, copies, CUDA Graphs, counters
    memory.py      one device arena per run, carved into typed buffers
    nvrtc.py       compile kernels (cubin cache on disk), declare their arguments, launch them
    shared_lib.py  cuBLAS/cuDNN/cuBLASLt through ctypes: found by cuda.pathfinder, LibraryError
    cublas.py      a row-major GEMM;  cudnn.py  softmax forward and backward

Importing this package (or any module in it) needs no GPU and no CUDA package: everything is
loaded on first use. Version and environment discovery for reports lives outside, in
graphtrain/environment.py.

What graphtrain owns, and why not NVIDIA's `cuda.core`: its Program, LaunchConfig and launch
could replace the NVRTC calls and the launch; the stream and graph capture shared with cuBLAS
and cuDNN, and the counters the tests assert on, would stay here either way. Its `launch` types
each argument from its Python value (an int goes as 64 bits, a float as a double), so an eager
step must make a numpy scalar per `int` or `float` argument, and a LaunchConfig per grid, per
launch. graphtrain declares the types once, has the compiler check them, and packs plain Python
numbers with one precompiled `struct.pack_into` before calling cuLaunchKernel. On an H100 host
(scripts/launch_cost.py): cuLaunchKernel with everything prepared 3.7 µs per launch; cuda.core
4.2 µs with config and scalars made beforehand, 6.4 µs with them made per launch; graphtrain's
Kernel call 5.6 µs when it stored each argument into its own ctypes slot, a way that packing
with `struct` beats by ~0.4 µs (measured on the CPU).
"""
