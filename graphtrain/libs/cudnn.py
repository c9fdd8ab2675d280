"""cuDNN through ctypes: a row-wise softmax and its backward pass; 2-D convolutions forward,
backward data and backward filter.

cuDNN 9 is split into sub-libraries; the legacy functions used here (tensor descriptors, softmax,
convolutions) live in libcudnn_ops and libcudnn_cnn and are exported through the libcudnn.so.9
shim, which loads the sub-library on first use. Descriptors are created at setup and destroyed by
`close`, so the training step only launches.

Convolutions use the legacy API (cudnnConvolutionForward / BackwardData / BackwardFilter): each
call is one or two kernels on the handle's stream with the workspace we give it, so a step
captures into a CUDA graph as it is, nothing allocated or chosen in the loop. The algorithm of
each pass is chosen once at setup (`ConvPlan`): cuDNN's heuristics name the candidates and their
workspace, then cudnnFind*AlgorithmEx times them on our own buffers; only deterministic
algorithms are taken (the same seed must give the same weights bit for bit).
"""

from __future__ import annotations

import ctypes

from graphtrain.libs import cuda
from graphtrain.libs.shared_lib import SharedLibrary

# Enum values from cudnn_graph.h / cudnn_ops.h.
CUDNN_TENSOR_NCHW, CUDNN_TENSOR_NHWC = 0, 1
LAYOUTS = {"nchw": CUDNN_TENSOR_NCHW, "nhwc": CUDNN_TENSOR_NHWC}
CUDNN_DATA_FLOAT = 0
CUDNN_CROSS_CORRELATION = 1  # what deep-learning frameworks call convolution (no kernel flip)
CUDNN_DETERMINISTIC = 1
# cudnnMathType_t: FMA keeps fp32 products on CUDA cores; TENSOR_OP lets fp32 data run on the
# tensor cores as TF32 (PyTorch's choice with allow_tf32, and the same two values it uses).
CUDNN_TENSOR_OP_MATH, CUDNN_FMA_MATH = 1, 3
MATH_TYPES = {"fp32": CUDNN_FMA_MATH, "tf32": CUDNN_TENSOR_OP_MATH}
MAX_WORKSPACE_BYTES = 256 << 20  # algorithms that want more are not considered
CUDNN_SOFTMAX_ACCURATE = 1  # subtracts the row maximum first: no overflow for large logits
CUDNN_SOFTMAX_MODE_INSTANCE = 0  # one softmax per n, over c·h·w

_int, _ptr, _size = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
library = SharedLibrary("cudnn", "cuDNN 9 (libcudnn)", {
    "cudnnGetVersion": ([], ctypes.c_size_t),
    "cudnnGetErrorString": ([_int], ctypes.c_char_p),
    "cudnnCreate": ([ctypes.POINTER(_ptr)], _int),
    "cudnnDestroy": ([_ptr], _int),
    "cudnnSetStream": ([_ptr, _ptr], _int),
    "cudnnCreateTensorDescriptor": ([ctypes.POINTER(_ptr)], _int),
    # desc, format, dataType, n, c, h, w
    "cudnnSetTensor4dDescriptor": ([_ptr, _int, _int, _int, _int, _int, _int], _int),
    "cudnnDestroyTensorDescriptor": ([_ptr], _int),
    # handle, algo, mode, alpha, xDesc, x, beta, yDesc, y
    "cudnnSoftmaxForward": ([_ptr, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr], _int),
    # handle, algo, mode, alpha, yDesc, y, dyDesc, dy, beta, dxDesc, dx
    "cudnnSoftmaxBackward": ([_ptr, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr], _int),
    "cudnnCreateFilterDescriptor": ([ctypes.POINTER(_ptr)], _int),
    # desc, dataType, format, k, c, h, w
    "cudnnSetFilter4dDescriptor": ([_ptr, _int, _int, _int, _int, _int, _int], _int),
    "cudnnDestroyFilterDescriptor": ([_ptr], _int),
    "cudnnCreateConvolutionDescriptor": ([ctypes.POINTER(_ptr)], _int),
    # desc, pad_h, pad_w, stride_h, stride_w, dilation_h, dilation_w, mode, computeType
    "cudnnSetConvolution2dDescriptor": ([_ptr, _int, _int, _int, _int, _int, _int, _int, _int], _int),
    "cudnnSetConvolutionMathType": ([_ptr, _int], _int),
    "cudnnDestroyConvolutionDescriptor": ([_ptr], _int),
    # convDesc, xDesc, wDesc, *n, *c, *h, *w
    "cudnnGetConvolution2dForwardOutputDim": ([_ptr, _ptr, _ptr] + [ctypes.POINTER(_int)] * 4, _int),
    # handle, xDesc, wDesc, convDesc, yDesc, requested, *returned, results
    "cudnnGetConvolutionForwardAlgorithm_v7": ([_ptr, _ptr, _ptr, _ptr, _ptr, _int, ctypes.POINTER(_int), _ptr], _int),
    # handle, wDesc, dyDesc, convDesc, dxDesc, requested, *returned, results
    "cudnnGetConvolutionBackwardDataAlgorithm_v7": ([_ptr, _ptr, _ptr, _ptr, _ptr, _int, ctypes.POINTER(_int), _ptr],
                                                    _int),
    # handle, xDesc, dyDesc, convDesc, dwDesc, requested, *returned, results
    "cudnnGetConvolutionBackwardFilterAlgorithm_v7": ([_ptr, _ptr, _ptr, _ptr, _ptr, _int, ctypes.POINTER(_int),
                                                       _ptr], _int),
    # handle, xDesc, x, wDesc, w, convDesc, yDesc, y, requested, *returned, results, workspace, bytes
    "cudnnFindConvolutionForwardAlgorithmEx": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int,
                                                ctypes.POINTER(_int), _ptr, _ptr, _size], _int),
    # handle, wDesc, w, dyDesc, dy, convDesc, dxDesc, dx, requested, *returned, results, workspace, bytes
    "cudnnFindConvolutionBackwardDataAlgorithmEx": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int,
                                                     ctypes.POINTER(_int), _ptr, _ptr, _size], _int),
    # handle, xDesc, x, dyDesc, dy, convDesc, dwDesc, dw, requested, *returned, results, workspace, bytes
    "cudnnFindConvolutionBackwardFilterAlgorithmEx": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int,
                                                       ctypes.POINTER(_int), _ptr, _ptr, _size], _int),
    # handle, alpha, xDesc, x, wDesc, w, convDesc, algo, workspace, bytes, beta, yDesc, y
    "cudnnConvolutionForward": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _size, _ptr, _ptr, _ptr],
                                _int),
    # handle, alpha, wDesc, w, dyDesc, dy, convDesc, algo, workspace, bytes, beta, dxDesc, dx
    "cudnnConvolutionBackwardData": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _size, _ptr, _ptr,
                                      _ptr], _int),
    # handle, alpha, xDesc, x, dyDesc, dy, convDesc, algo, workspace, bytes, beta, dwDesc, dw
    "cudnnConvolutionBackwardFilter": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _size, _ptr, _ptr,
                                        _ptr], _int),
}, status_name="cudnnGetErrorString")


class AlgoPerf(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t: the three share this layout."""

    _fields_ = [("algo", _int), ("status", _int), ("time", ctypes.c_float), ("memory", _size),
                ("determinism", _int), ("math_type", _int), ("reserved", _int * 3)]


MAX_ALGOS = 16  # more than any pass has (8 forward, 6 backward data, 7 backward filter)


def version() -> str:
    """cuDNN's version ("9.13.0"), without a GPU: cudnnGetVersion is major·10000 + minor·100 + patch."""
    encoded = int(library.load().cudnnGetVersion())
    return f"{encoded // 10000}.{(encoded % 10000) // 100}.{encoded % 100}"


class Cudnn:
    """A cuDNN handle bound to one stream."""

    def __init__(self, stream: cuda.Stream):
        self._lib = lib = library.load()
        handle = ctypes.c_void_p()
        library.check(lib.cudnnCreate(ctypes.byref(handle)), "cudnnCreate")
        self._handle: ctypes.c_void_p | None = handle
        self._descs: list[ctypes.c_void_p] = []  # tensor descriptors, destroyed by close()
        self._filters: list[ctypes.c_void_p] = []
        self._convolutions: list[ctypes.c_void_p] = []
        self.stream = stream
        try:
            library.check(lib.cudnnSetStream(handle, int(stream.handle)), "cudnnSetStream")
        except BaseException:
            self.close()
            raise
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._one_ref, self._zero_ref = ctypes.byref(self._one), ctypes.byref(self._zero)

    def _require(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise cuda.ClosedError("this cuDNN handle was closed")
        return self._handle

    def tensor_4d(self, n: int, c: int, h: int = 1, w: int = 1, layout: str = "nchw") -> ctypes.c_void_p:
        """A float32 tensor descriptor, NCHW (or NHWC: channels innermost), destroyed by `close`.
        For row-wise softmax over a rows×classes matrix use tensor_4d(rows, classes, 1, 1)."""
        self._require()
        desc = ctypes.c_void_p()
        library.check(self._lib.cudnnCreateTensorDescriptor(ctypes.byref(desc)), "cudnnCreateTensorDescriptor")
        self._descs.append(desc)  # destroyed by close(), also when setting it fails below
        library.check(self._lib.cudnnSetTensor4dDescriptor(desc, LAYOUTS[layout], CUDNN_DATA_FLOAT, n, c, h, w),
                      "cudnnSetTensor4dDescriptor")
        return desc

    def softmax_forward(self, desc: ctypes.c_void_p, x_ptr: int, y_ptr: int) -> None:
        """y = softmax(x) over each instance (c·h·w values), accurate algorithm; queued."""
        status = self._lib.cudnnSoftmaxForward(self._require(), CUDNN_SOFTMAX_ACCURATE, CUDNN_SOFTMAX_MODE_INSTANCE,
                                               self._one_ref, desc, x_ptr, self._zero_ref, desc, y_ptr)
        if status:
            library.check(status, "cudnnSoftmaxForward")

    def softmax_backward(self, desc: ctypes.c_void_p, y_ptr: int, dy_ptr: int, dx_ptr: int) -> None:
        """dx = y ⊙ (dy − Σ y·dy) per instance, from the forward output y; queued."""
        status = self._lib.cudnnSoftmaxBackward(self._require(), CUDNN_SOFTMAX_ACCURATE, CUDNN_SOFTMAX_MODE_INSTANCE,
                                                self._one_ref, desc, y_ptr, desc, dy_ptr, self._zero_ref, desc, dx_ptr)
        if status:
            library.check(status, "cudnnSoftmaxBackward")

    def filter_4d(self, k: int, c: int, h: int, w: int, layout: str = "nchw") -> ctypes.c_void_p:
        """A float32 filter descriptor, k outputs × c inputs × h × w, stored KCHW ("nchw") or KHWC
        ("nhwc"), destroyed by `close`."""
        self._require()
        desc = ctypes.c_void_p()
        library.check(self._lib.cudnnCreateFilterDescriptor(ctypes.byref(desc)), "cudnnCreateFilterDescriptor")
        self._filters.append(desc)
        library.check(self._lib.cudnnSetFilter4dDescriptor(desc, CUDNN_DATA_FLOAT, LAYOUTS[layout], k, c, h, w),
                      "cudnnSetFilter4dDescriptor")
        return desc

    def convolution_2d(self, padding: int, stride: int, precision: str) -> ctypes.c_void_p:
        """A cross-correlation descriptor (square padding and stride, no dilation) computing in
        fp32, on the tensor cores as TF32 when `precision` is "tf32"; destroyed by `close`."""
        if precision not in MATH_TYPES:
            raise ValueError(f"cuDNN convolutions run in {' or '.join(MATH_TYPES)}, not {precision!r}")
        self._require()
        desc = ctypes.c_void_p()
        library.check(self._lib.cudnnCreateConvolutionDescriptor(ctypes.byref(desc)),
                      "cudnnCreateConvolutionDescriptor")
        self._convolutions.append(desc)
        library.check(self._lib.cudnnSetConvolution2dDescriptor(desc, padding, padding, stride, stride, 1, 1,
                                                                CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
                      "cudnnSetConvolution2dDescriptor")
        library.check(self._lib.cudnnSetConvolutionMathType(desc, MATH_TYPES[precision]), "cudnnSetConvolutionMathType")
        return desc

    def output_dim(self, conv, x_desc, w_desc) -> tuple[int, int, int, int]:
        """(n, c, h, w) of the convolution's output."""
        dims = [ctypes.c_int() for _ in range(4)]
        library.check(self._lib.cudnnGetConvolution2dForwardOutputDim(conv, x_desc, w_desc,
                                                                      *(ctypes.byref(d) for d in dims)),
                      "cudnnGetConvolution2dForwardOutputDim")
        return tuple(d.value for d in dims)  # type: ignore[return-value]

    def algorithms(self, call: str, *args) -> list[AlgoPerf]:
        """The perf results a cudnnGet*Algorithm_v7 (heuristics) or cudnnFind*AlgorithmEx (timed)
        call returns, best first; `args` are the call's own up to the results (and, for Find,
        the workspace after)."""
        results, returned = (AlgoPerf * MAX_ALGOS)(), ctypes.c_int()
        head, tail = (args[:-2], args[-2:]) if call.startswith("cudnnFind") else (args, ())
        library.check(getattr(self._lib, call)(self._require(), *head, MAX_ALGOS, ctypes.byref(returned), results,
                                               *tail), call)
        return list(results[:returned.value])

    def conv_forward(self, x_desc, x: int, w_desc, w: int, conv, algo: int, workspace: int, workspace_bytes: int,
                     y_desc, y: int) -> None:
        """y = conv(x, w); queued."""
        status = self._lib.cudnnConvolutionForward(self._require(), self._one_ref, x_desc, x, w_desc, w, conv, algo,
                                                   workspace, workspace_bytes, self._zero_ref, y_desc, y)
        if status:
            library.check(status, "cudnnConvolutionForward")

    def conv_backward_data(self, w_desc, w: int, dy_desc, dy: int, conv, algo: int, workspace: int,
                           workspace_bytes: int, dx_desc, dx: int) -> None:
        """dx = ∂(Σ dy·conv(x, w))/∂x; queued."""
        status = self._lib.cudnnConvolutionBackwardData(self._require(), self._one_ref, w_desc, w, dy_desc, dy, conv,
                                                        algo, workspace, workspace_bytes, self._zero_ref, dx_desc, dx)
        if status:
            library.check(status, "cudnnConvolutionBackwardData")

    def conv_backward_filter(self, x_desc, x: int, dy_desc, dy: int, conv, algo: int, workspace: int,
                             workspace_bytes: int, dw_desc, dw: int) -> None:
        """dw = ∂(Σ dy·conv(x, w))/∂w; queued."""
        status = self._lib.cudnnConvolutionBackwardFilter(self._require(), self._one_ref, x_desc, x, dy_desc, dy,
                                                          conv, algo, workspace, workspace_bytes, self._zero_ref,
                                                          dw_desc, dw)
        if status:
            library.check(status, "cudnnConvolutionBackwardFilter")

    def close(self) -> None:
        """Destroy every descriptor made here, then the handle (idempotent)."""
        for attr, destroy in (("_descs", "cudnnDestroyTensorDescriptor"), ("_filters", "cudnnDestroyFilterDescriptor"),
                              ("_convolutions", "cudnnDestroyConvolutionDescriptor")):
            descs = getattr(self, attr, [])
            setattr(self, attr, [])
            for desc in descs:
                library.check(getattr(self._lib, destroy)(desc), destroy)
        if self._handle is not None:
            handle, self._handle = self._handle, None
            library.check(self._lib.cudnnDestroy(handle), "cudnnDestroy")


FIRST_USE_ROWS, FIRST_USE_CLASSES = 16, 10  # first_use's softmax


def first_use() -> None:
    """cuDNN's once-a-process start, on a handle, stream and memory of its own, all released
    after: the first handle of the process, and one softmax (cuDNN loads the sub-library that
    holds it, libcudnn_ops, at its first call, and the runtime the softmax kernel). What a
    run's first softmax pays otherwise; run on the command's start-up thread (graphtrain.__main__),
    where every call releases the Python lock, it goes on beside the caller's imports and data."""
    nbytes = FIRST_USE_ROWS * FIRST_USE_CLASSES * 4
    stream = cuda.Stream()
    try:
        with cuda.scratch(2 * nbytes) as x:
            cuda.memset(x, 0, nbytes, stream)
            dnn = Cudnn(stream)
            try:
                dnn.softmax_forward(dnn.tensor_4d(FIRST_USE_ROWS, FIRST_USE_CLASSES, 1, 1), x, x + nbytes)
                cuda.wait_uncounted(stream)
            finally:
                dnn.close()
    finally:
        stream.close()


class ConvAlgorithmError(RuntimeError):
    """cuDNN offers no deterministic algorithm for a convolution pass within the workspace cap."""


# pass -> (heuristics call, timed call)
_PASSES = {
    "forward": ("cudnnGetConvolutionForwardAlgorithm_v7", "cudnnFindConvolutionForwardAlgorithmEx"),
    "backward_data": ("cudnnGetConvolutionBackwardDataAlgorithm_v7", "cudnnFindConvolutionBackwardDataAlgorithmEx"),
    "backward_filter": ("cudnnGetConvolutionBackwardFilterAlgorithm_v7",
                        "cudnnFindConvolutionBackwardFilterAlgorithmEx"),
}


def _usable(results: list[AlgoPerf], cap: int) -> list[AlgoPerf]:
    return [r for r in results if r.status == 0 and r.determinism == CUDNN_DETERMINISTIC and r.memory <= cap]


class ConvPlan:
    """One convolution layer at one batch size: its descriptors and the algorithm of each pass.

        plan = ConvPlan(dnn, n, c, h, w, k, kernel, stride, padding, "tf32", passes)
        arena.reserve("workspace", plan.workspace_bytes)   # heuristics' candidates, before allocation
        plan.choose(x, w, y, workspace, workspace_bytes)   # timed on the real buffers, at setup
        plan.forward(x, w, y)                              # in the step: one queued call

    `passes` names the passes the layer runs ("forward", "backward_data", "backward_filter"):
    the first layer of a network needs no backward-data pass. `layout` is every tensor's, "nchw"
    or "nhwc" (the filter then KHWC): cuDNN's tensor-core kernels read NHWC without transposing.
    """

    def __init__(self, dnn: Cudnn, n: int, c: int, h: int, w: int, k: int, kernel: int, stride: int, padding: int,
                 precision: str, passes=tuple(_PASSES), layout: str = "nchw"):
        self.dnn, self.passes, self.layout = dnn, tuple(passes), layout
        self.x_desc = dnn.tensor_4d(n, c, h, w, layout)
        self.w_desc = dnn.filter_4d(k, c, kernel, kernel, layout)
        self.conv = dnn.convolution_2d(padding, stride, precision)
        self.out_shape = dnn.output_dim(self.conv, self.x_desc, self.w_desc)  # (n, c, h, w) whatever the layout
        self.y_desc = dnn.tensor_4d(*self.out_shape, layout)
        self.candidates = {name: _usable(self._heuristics(name), MAX_WORKSPACE_BYTES) for name in self.passes}
        for name, found in self.candidates.items():
            if not found:
                raise ConvAlgorithmError(f"cuDNN has no deterministic {name.replace('_', ' ')} algorithm for a "
                                         f"{kernel}x{kernel} convolution of {n}x{c}x{h}x{w} within "
                                         f"{MAX_WORKSPACE_BYTES >> 20} MiB of workspace")
        # Room for every candidate, so the timed search below can try them all.
        self.workspace_bytes = max(r.memory for found in self.candidates.values() for r in found)
        self.algo: dict[str, int] = {}
        self.timed: dict[str, list[tuple]] = {}
        self.workspace, self.workspace_size = 0, 0

    def _heuristics(self, name: str) -> list[AlgoPerf]:
        d = self
        args = {"forward": (d.x_desc, d.w_desc, d.conv, d.y_desc),
                "backward_data": (d.w_desc, d.y_desc, d.conv, d.x_desc),
                "backward_filter": (d.x_desc, d.y_desc, d.conv, d.w_desc)}[name]
        return self.dnn.algorithms(_PASSES[name][0], *args)

    def choose(self, x: int, w: int, y: int, workspace: int, workspace_bytes: int) -> dict[str, int]:
        """Time every pass's algorithms on these buffers (their contents are overwritten: setup
        only) and keep the fastest deterministic one that fits `workspace_bytes`."""
        d = self
        for name in self.passes:
            args = {"forward": (d.x_desc, x, d.w_desc, w, d.conv, d.y_desc, y),
                    "backward_data": (d.w_desc, w, d.y_desc, y, d.conv, d.x_desc, x),
                    "backward_filter": (d.x_desc, x, d.y_desc, y, d.conv, d.w_desc, w)}[name]
            results = self.dnn.algorithms(_PASSES[name][1], *args, workspace, workspace_bytes)
            self.timed[name] = [(r.algo, r.status, round(r.time, 4), r.memory, r.determinism, r.math_type)
                                for r in results]  # what cuDNN measured, for a profile to show
            timed = _usable(results, workspace_bytes)
            if not timed:
                raise ConvAlgorithmError(f"cuDNN timed no deterministic {name.replace('_', ' ')} algorithm that fits "
                                         f"{workspace_bytes} bytes of workspace")
            self.algo[name] = int(timed[0].algo)
        self.workspace, self.workspace_size = workspace, workspace_bytes
        return dict(self.algo)

    def forward(self, x: int, w: int, y: int) -> None:
        self.dnn.conv_forward(self.x_desc, x, self.w_desc, w, self.conv, self.algo["forward"], self.workspace,
                              self.workspace_size, self.y_desc, y)

    def backward_data(self, w: int, dy: int, dx: int) -> None:
        self.dnn.conv_backward_data(self.w_desc, w, self.y_desc, dy, self.conv, self.algo["backward_data"],
                                    self.workspace, self.workspace_size, self.x_desc, dx)

    def backward_filter(self, x: int, dy: int, dw: int) -> None:
        self.dnn.conv_backward_filter(self.x_desc, x, self.y_desc, dy, self.conv, self.algo["backward_filter"],
                                      self.workspace, self.workspace_size, self.w_desc, dw)
