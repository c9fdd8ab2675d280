"""What the cnns of one process share on a GPU, set up once: the dataset resident on the device,
and the lanes (a stream with the library handles bound to it).

    data = resident_data(device, train_images, train_labels, test_images, test_labels, stream)
    data.acquire() … data.release()          # a model's use of it; an unused one may be dropped later
    lane = lane_of(device)                    # lane 0: where a model runs unless told otherwise
    lane.stream, lane.gemms("tf32"), lane.dnn()

A process that trains many cnns of one dataset (a sweep's rows, the speedrun's seeds, a pack of
models) uploads the dataset once per device: `resident_data` keeps the last MAX_RESIDENT datasets
uploaded, keyed on the arrays' identity (it holds the arrays, so that identity is not reused; the
arrays are taken as they are at the first upload and must not change after). The kernel files
are shared the same way (graphtrain.kernels.KernelFile).

A lane's models run one after another, in its stream's order, so they share its handles and
their workspace: a cuBLASLt handle with its products per precision (graphtrain.libs.cublaslt.
LtGemms: one algorithm per product shape, whatever the number of models a call multiplies, so a
model's products are the same bits alone and packed on a model axis) and one cuDNN handle,
created at their first use. cuBLASLt, as cuBLAS, gives the same bits on every run only where each
stream has a workspace of its own: models on different lanes run at once, each lane with its own.
Lanes last as long as the process's hold on the device.
"""

from __future__ import annotations

import threading

import numpy as np

from graphtrain.data.images import MNIST_NORMALISATION
from graphtrain.kernels.images import Images
from graphtrain.libs import cuda
from graphtrain.libs.cublaslt import GemmShape, Lt, LtGemms, choose_algo
from graphtrain.libs.cudnn import Cudnn
from graphtrain.libs.memory import Arena

LANE_WORKSPACE_BYTES = 32 << 20
# first_use's query: any TF32 product (the heuristics' set-up is the same for every shape)
FIRST_QUERY = GemmShape(False, True, 256, 256, 256, 256, 256, 256, "tf32")
MAX_RESIDENT = 2  # datasets a device keeps; beyond, the least recently used one no model holds goes
MAX_EVAL_PASSES = 64  # an evaluation's forward passes at most: the test set is padded by MAX_EVAL_PASSES − 1 rows


def dataset_arrays(data) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The dataset's arrays as every cnn of the process hands them to CnnDevice, with
    normalisation=MNIST_NORMALISATION (the images as loaded, normalised on the device; the labels
    int32, as they are where int32 already): the same objects each time, so `resident_data`
    uploads them once."""
    return (data.train_images, data.train_labels.astype(np.int32, copy=False),
            data.test_images, data.test_labels.astype(np.int32, copy=False))


class ResidentData:
    """The training and test sets on one device as the cnn reads them: fp32 images, one row of
    `features` a sample, int32 labels; the test set followed by MAX_EVAL_PASSES − 1 zero rows, so
    that an evaluation in equal passes (graphtrain.stages.cnn_device.eval_passes) reads its last
    pass's extra rows from memory of its own (their results are not counted). With
    `normalisation` (mean, std), the images are normalised on the device after their upload
    (kernels/images.cu: the values graphtrain.data.images.normalise computes, bit for bit, where
    NumPy would take ~90 ms over MNIST); without, they are taken as they are."""

    def __init__(self, device: cuda.DeviceInfo, train_images: np.ndarray, train_labels: np.ndarray,
                 test_images: np.ndarray, test_labels: np.ndarray, stream: cuda.Stream | None,
                 normalisation: tuple[float, float] | None = None):
        """Allocated, then uploaded on `stream` and waited for; with no stream, only allocated:
        `begin_upload` uploads it beside the caller."""
        self.device, self.normalisation = device, normalisation
        self.arrays = (train_images, train_labels, test_images, test_labels)  # held: the key is their identity
        self.num_train, self.num_test = len(train_images), len(test_images)
        self.features = int(np.prod(train_images.shape[1:]))
        if int(np.prod(test_images.shape[1:])) != self.features:
            raise ValueError(f"training images of {self.features} features, test images of {test_images.shape[1:]}")
        pad = MAX_EVAL_PASSES - 1
        self.arena = arena = Arena()
        self.train_x = arena.reserve("train_images", (self.num_train, self.features))
        self.train_y = arena.reserve("train_labels", (self.num_train,), np.int32)
        self.test_x = arena.reserve("test_images", (self.num_test + pad, self.features))
        self.test_y = arena.reserve("test_labels", (self.num_test + pad,), np.int32)
        self.users = 0
        self.uploading: cuda.HeadStart | None = None
        arena.allocate()
        if stream is not None:
            try:
                self.upload(stream, Images(device) if normalisation is not None else None)
            except BaseException:
                arena.close()
                raise

    def upload(self, stream: cuda.Stream, images: Images | None) -> None:
        """The arrays copied in (waited for), then normalised by `images` where asked (queued)."""
        train_images, train_labels, test_images, test_labels = self.arrays
        self.train_x.upload(np.ascontiguousarray(train_images, np.float32).reshape(self.train_x.shape), stream)
        self.train_y.upload(np.asarray(train_labels).astype(np.int32), stream)
        test = np.zeros(self.test_x.shape, np.float32)
        test[:self.num_test] = np.asarray(test_images, np.float32).reshape(self.num_test, self.features)
        self.test_x.upload(test, stream)
        labels = np.zeros(self.test_y.shape, np.int32)
        labels[:self.num_test] = test_labels
        self.test_y.upload(labels, stream)
        if images is not None:
            for x, rows in ((self.train_x, self.num_train), (self.test_x, self.num_test)):  # not the padding
                images.normalise(stream, x.ptr, rows * self.features, *self.normalisation)

    def begin_upload(self) -> None:
        """Upload the dataset on a thread and a stream of their own (graphtrain.libs.cuda.beside),
        the caller going on with its setup meanwhile (the copies, ~220 MB of MNIST from pageable
        memory, release the Python lock); `ready` waits for it. The kernel file is loaded here,
        on the caller's thread, where the setup loads its others."""
        images = Images(self.device) if self.normalisation is not None else None

        def upload() -> None:
            stream = cuda.Stream()
            try:
                self.upload(stream, images)
                # Needed: the models read the data on their lanes' streams, which nothing orders
                # after this one; the thread's end, which `ready` waits for, then means it is there.
                stream.synchronize()
            finally:
                stream.close()

        self.uploading = cuda.beside(upload, self.device, name="graphtrain-upload-dataset")

    def ready(self) -> ResidentData:
        """This data, once its upload (begun by `begin_upload`) is done: what the upload raised is
        raised here, and the data dropped, so that the next model uploads it again."""
        if self.uploading is not None:
            try:
                self.uploading.result()
            except BaseException:
                if self in _resident:
                    _resident.remove(self)
                self.close()
                raise
            self.uploading = None
        return self

    def serves(self, device: cuda.DeviceInfo, arrays: tuple, normalisation: tuple[float, float] | None) -> bool:
        """Whether these are `arrays` (the same objects) on `device` (opened in the same context),
        normalised as asked."""
        return (self.device is device and self.normalisation == normalisation
                and all(a is b for a, b in zip(self.arrays, arrays, strict=True)))

    def acquire(self) -> ResidentData:
        self.users += 1
        return self

    def release(self) -> None:
        """A model is done with the data; it stays resident for the next one (until dropped)."""
        if self.users <= 0:
            raise RuntimeError("the resident dataset was released more often than acquired")
        self.users -= 1

    def close(self) -> None:
        self.arena.close()

    def drop(self) -> None:
        """Free the data, which no model holds, once an upload still under way is over. A failure
        of that upload is not raised here, in the setup of a model of other data: no model was
        handed it, so cuda.wait_for_head_starts raises it."""
        if self.uploading is not None:
            self.uploading.thread.join()
        self.close()


_resident: list[ResidentData] = []  # least recently used first


def resident_data(device: cuda.DeviceInfo, train_images: np.ndarray, train_labels: np.ndarray,
                  test_images: np.ndarray, test_labels: np.ndarray, stream: cuda.Stream | None,
                  normalisation: tuple[float, float] | None = None) -> ResidentData:
    """The dataset of these arrays on `device` (normalised there with `normalisation`, see
    ResidentData): the one uploaded before, or uploaded now on `stream` (waited for); with no
    stream, uploaded beside the caller (ResidentData.begin_upload): its `ready()` waits for it
    before anything reads it. Beyond MAX_RESIDENT datasets, the least recently used one that no
    model holds is dropped first."""
    arrays = (train_images, train_labels, test_images, test_labels)
    for data in _resident:
        if data.serves(device, arrays, normalisation):
            _resident.remove(data)
            _resident.append(data)
            return data
    for data in [d for d in _resident if d.users == 0][:max(0, len(_resident) + 1 - MAX_RESIDENT)]:
        _resident.remove(data)
        data.drop()
    data = ResidentData(device, *arrays, stream, normalisation)
    if stream is None:
        try:
            data.begin_upload()
        except BaseException:
            data.close()
            raise
    _resident.append(data)
    return data


class Lane:
    """A stream, the library handles bound to it (made at their first use) and the cuBLASLt
    workspace they use. The models of a lane run in its stream's order, one after another."""

    def __init__(self, device: cuda.DeviceInfo, index: int):
        self.device, self.index = device, index
        self.stream = cuda.Stream()
        self.arena = Arena()
        self.workspace = self.arena.reserve("cublaslt_workspace", (LANE_WORKSPACE_BYTES,), np.uint8)
        self.arena.allocate()
        self._lt: Lt | None = None
        self._lt_lock = threading.Lock()
        self._gemms: dict[str, LtGemms] = {}
        self._dnn: Cudnn | None = None

    def lt(self) -> Lt:
        """The lane's cuBLASLt handle, on its workspace (made at its first use; where `first_use`
        is still making it, waiting for it)."""
        with self._lt_lock:
            if self._lt is None:
                ws = self.workspace
                self._lt = Lt(ws.ptr, ws.nbytes, arch=self.device.arch)
            return self._lt

    def gemms(self, precision: str) -> LtGemms:
        """The lane's cuBLASLt products in `precision` (each shape's one algorithm, and every
        product planned on the lane, kept for its next models)."""
        if precision not in self._gemms:
            self._gemms[precision] = LtGemms(self.lt(), self.stream, precision)
        return self._gemms[precision]

    def dnn(self) -> Cudnn:
        """The lane's cuDNN handle."""
        if self._dnn is None:
            self._dnn = Cudnn(self.stream)
        return self._dnn

    def close(self) -> None:
        for handle in (*self._gemms.values(), self._lt, self._dnn):
            if handle is not None:
                handle.close()
        self.arena.close()
        self.stream.close()


_lanes: dict[int, list[Lane]] = {}  # device ordinal -> its lanes, in order
_lanes_lock = threading.Lock()  # `first_use` makes lane 0 on a thread of its own


def lanes(device: cuda.DeviceInfo, count: int) -> list[Lane]:
    """The process's first `count` lanes on `device` (made where there are fewer; where
    `first_use` is still making lane 0, waiting for it)."""
    with _lanes_lock:
        made = _lanes.get(device.ordinal, [])
        if made and made[0].device is not device:  # the device was released and opened again: a new context
            made = []
        while len(made) < count:
            made.append(Lane(device, len(made)))
        _lanes[device.ordinal] = made
        return made[:count]


def lane_of(device: cuda.DeviceInfo, index: int = 0) -> Lane:
    """Lane `index` of `device` (lane 0: where a model runs unless told otherwise)."""
    return lanes(device, index + 1)[index]


def first_use() -> None:
    """The cnn's once-a-process start on the GPU, begun beside the data loading (a cnn rung's
    `first_uses`): lane 0 made (its stream, its workspace, its cuBLASLt handle: the library's own
    start on this GPU), which the setup's `lane_of` then takes as made, and one algorithm query
    (cuBLASLt's heuristics set themselves up at their first, which would otherwise fall in the
    setup's first choice of an algorithm). Where it fails, the setup's own `lane_of` makes the lane
    again and raises what its own calls raise."""
    lt = lane_of(cuda.open_device()).lt()
    choose_algo(lt, FIRST_QUERY)
