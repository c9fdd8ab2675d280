"""The only part of graphtrain that talks to CUDA: runtime, NVRTC kernels, cuBLAS and cuDNN.

    cuda.py        cuda.bindings: checked calls, device, streams, events, copies, CUDA Graphs, counters
    memory.py      one device arena per run, carved into typed buffers
    nvrtc.py       compile kernels (cubin cache on disk), declare their arguments, launch them
    shared_lib.py  cuBLAS/cuDNN/cuBLASLt through ctypes: found by cuda.pathfinder, LibraryError
    cublas.py      a row-major GEMM;  cudnn.py  softmax forward and backward

Importing this package (or any module in it) needs no GPU and no CUDA package: everything is
loaded on first use. Version and environment discovery for reports lives outside, in
graphtrain/environment.py.

What graphtrain owns, and why not NVIDIA's `cuda.core`: `cuda.core` (Program, ObjectCode,
LaunchConfig, launch) would replace the NVRTC calls and the launch, but not what the ladder
measures with. Its `launch` types each argument from its Python value on every call (an int
goes as a 64-bit integer and a float as a double, so a kernel's `int` and `float` arguments
need a numpy or ctypes scalar made per launch) and takes a `LaunchConfig` whose grid is fixed
when it is built, while the eager rungs launch with a grid that follows the batch size. Here a
kernel's argument types are declared once, checked once by the compiler, and a launch stores
plain Python numbers into ctypes slots made once, then calls cuLaunchKernel: fewer Python
steps per launch, which is what the eager rungs are timed on. graphtrain also keeps its own
stream and graph capture (cuBLAS and cuDNN are captured on the same stream), the sync, copy and
allocation counters the tests assert on, and the cubin cache on disk. `scripts/launch_cost.py`
measures the launch both ways on a GPU.
"""
