"""The only part of graphtrain that talks to CUDA: runtime, NVRTC kernels, cuBLAS(Lt), cuDNN and NCCL.

    cuda.py        cuda.bindings: checked calls, device, streams, events, copies, CUDA Graphs, counters
    memory.py      one device arena per run, carved into typed buffers
    nvrtc.py       compile kernels (cubin cache on disk), load and launch them
    shared_lib.py  cuBLAS/cuDNN/cuBLASLt through ctypes: found by cuda.pathfinder, LibraryError
    cublas.py      a row-major GEMM;  cublaslt.py  products with fused epilogues, planned once
    cudnn.py       softmax forward and backward
    nccl.py        NCCL through ctypes: a communicator per GPU process, the gradients' all-reduce
    cupti.py       CUPTI's activity tracing (graphtrain.profile), each call checked

Importing any of it needs no GPU and no CUDA package: everything is loaded on first use.

Why not NVIDIA's `cuda.core` for compiling and launching: the stream and graph capture shared
with cuBLAS and cuDNN, and the counters the tests assert on, would stay here either way, and its
`launch` types each argument from its Python value, so an eager step must make a numpy scalar
per argument and a LaunchConfig per launch. On an H100 host (scripts/benchmarks/launch_cost.py): a bare
cuLaunchKernel 3.7 µs per launch; cuda.core 4.2 µs with config and scalars made beforehand,
6.4 µs made per launch; graphtrain's Kernel 5.6 µs with a ctypes slot per argument, which
packing them with one precompiled `struct.pack_into`, as now, cuts by ~0.4 µs (CPU-measured).
"""
