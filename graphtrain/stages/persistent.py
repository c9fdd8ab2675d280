"""`persistent`: one kernel trains the epoch; the steps never leave the GPU.

After `device-loop`, an epoch is still ~2,000 graph nodes, each a kernel launched and drained by
the GPU, each step's parameters read from and written to device memory. Here one launch of one
thread-block cluster (16 blocks, one per SM) runs every step of the epoch (kernels/persistent.cu):
each block keeps its slice of the input features' weights in shared memory, computes partial
logits of the batch over its slice, and sends them to the block that owns each row; the owners
compute softmax and dlogits and send those to every block, and each block updates its own slice.
A step is two small exchanges through distributed shared memory, each store counted on the
receiver's mbarrier (no cluster barrier); two warps copy the next batch in while eight train the
current one. It trains in bf16, its own precision as for an MLP: the products read bf16 operands
(the images uploaded as bf16, 8-bit pixels as k, exact; a bf16 copy of the weights, refreshed at
each update) in one tensor-core pass with fp32 sums, fp32 master weights and bias, and the
dlogits travel as bf16. `--precision fp32` trains it in TF32 passes that keep fp32 accuracy
instead: three, or two where the images are 8-bit pixels (k/255, as every IDX or uint8 dataset
is), which the kernel reads as k, exact in TF32 (on an H100, jhu: 3,837 SM cycles a step in bf16,
5,224 in fp32; results/persistent-phases-jhu-softmax-h100*.md). Sums in a fixed order, so the same seed
gives the same weights bit for bit.

An MLP (kernels/persistent_mlp.cu) splits its hidden units instead: each block owns 1/16 of the
units of every hidden layer (their rows of W, their columns of the head), gathers the layer's
activations from every block, sends the head's partial logits of each row to the row's owner (whose
softmax sends the row's dlogits back to every block), and sends each block its share of the input
gradients on the way back, so no block ever needs another's weights. Each exchange goes from every
block to every other (bulk copies for the activations and input gradients, stores for the small
logits), counted on the receiver's mbarrier, with no cluster barrier in the loop. It too trains in
bf16: each hidden layer's products read bf16 operands (rounded as they are loaded, the images
uploaded as bf16) in one tensor-core pass, with fp32 sums, fp32 master weights and an fp32 head.
The gathered activations travel as bf16 (they are only ever bf16 operands) and so do the pieces of
the input gradients, each block's partial sums, which the receiver adds in fp32. The first layer's
weights live in the registers of the warps that use them, and a step's images, copied into shared
memory during the step before, in registers once read. `--precision fp32` trains it in three TF32
passes instead (two for the first layer's with 8-bit pixels, which the kernel then reads as bytes
k), near fp32's accuracy, with every exchange in fp32. It trains equal hidden sizes that are multiples of 64
whose parameters and step buffers fit a block's 227 KB of shared memory (the cuda-mnist preset
at H = 128 and 256, batch 32). A step of three hidden layers is a chain of six exchanges and the
short products between them, bound by latency and instruction issue more than by arithmetic
(scripts/probes/persistent_mlp_phases.py counts the cycles of each phase).

An MLP the cluster cannot hold (the 784³ MLP, whose bf16 weights alone are 3.7 MB) goes to the grid
kernel (kernels/persistent_wide.cu): a cooperative grid of one block per SM, each block owning a few
units of every hidden layer with their fp32 master weights in its shared memory, the activations
and input gradients of the whole batch exchanged through global memory (L2) between grid-wide
barriers, 2·L a step for L hidden layers. Each block reads every exchanged matrix once a step; a
hidden layer's dX and weight update read its input gradients in one pass (the same mma fragments,
transposed in registers). Its precision is the bf16 rung's: bf16 operands, fp32 sums and master
weights, the head and softmax in fp32; it has no fp32 build. It trains equal hidden sizes of any
width whose blocks fit the GPU's SMs and their shared memory (up to 1024 units on an H100, three
layers, batch 128). Anything neither kernel trains is refused before training, with both reasons.
A run's record names the kernel that trained it (`persistent_kernel`: cluster or grid). A GPU with
thread-block clusters (compute capability 9.0: Hopper and later).

A set-up row trains the next plan of its shape in place (`restart`): the plan's weights and orders
uploaded, the metrics zeroed; the rate is a launch argument of every epoch, so nothing is compiled
or converted again.
"""

from __future__ import annotations

import numpy as np

from graphtrain import environment
from graphtrain.errors import ModelUnsupported
from graphtrain.kernels.images import Images
from graphtrain.kernels.persistent import Persistent, Shape
from graphtrain.kernels.persistent_mlp import MlpShape, PersistentMlp
from graphtrain.kernels.persistent_wide import MAX_IMAGE_VALUES, PersistentWide, WideShape
from graphtrain.libs import cuda, nvrtc
from graphtrain.libs.memory import Arena
from graphtrain.plan import RunPlan
from graphtrain.reference import Layer
from graphtrain.stages import device
from graphtrain.stages.base import EpochResult, Stage


def require_clusters(device_info: cuda.DeviceInfo) -> None:
    """ModelUnsupported unless the GPU has thread-block clusters (compute capability 9.0)."""
    if device_info.compute_capability < (9, 0):
        raise ModelUnsupported(f"the persistent rung needs thread-block clusters (compute capability 9.0), "
                               f"and {device_info.name} has {'.'.join(map(str, device_info.compute_capability))}")


def refuse_unless_trains(shape: Shape | MlpShape | WideShape) -> None:
    """ModelUnsupported where the kernel cannot train `shape` (its `refusal` says why)."""
    refusal = shape.refusal()
    if refusal is not None:
        raise ModelUnsupported(f"the persistent rung cannot train {refusal}; use --stage device-loop")


def mlp_shape(cluster: MlpShape, sm_count: int, refuse: bool = True, clusters: bool = True) -> MlpShape | WideShape:
    """The shape of the kernel that trains the MLP of `cluster`: the cluster kernel's where it fits
    one cluster, else the grid kernel's (blocks bounded by the GPU's `sm_count`; `clusters`: whether
    the GPU runs thread-block clusters, which the grid kernel's split needs). Where neither
    trains it: ModelUnsupported with both reasons, or (refuse False) the cluster's shape."""
    if cluster.refusal() is None:
        return cluster
    wide = WideShape(cluster.features, cluster.hidden, cluster.classes, cluster.batch, cluster.pixel_levels,
                     bf16=cluster.bf16, sm_count=sm_count, clusters=clusters)
    if wide.refusal() is None:
        return wide
    if refuse:
        raise ModelUnsupported(f"the persistent rung cannot train {cluster.refusal()}, nor can its grid kernel: "
                               f"{wide.refusal()}; use --stage device-loop")
    return cluster


def kernel_name(shape: Shape | MlpShape | WideShape) -> str:
    """Which persistent kernel trains `shape`, as a run's record names it."""
    return "grid" if isinstance(shape, WideShape) else "cluster"


def products_note(shape: Shape | MlpShape | WideShape) -> str:
    """How the kernel of `shape` computes its products, as a run's record states it."""
    if isinstance(shape, WideShape):
        staged = (f"; k-steps staged in rings of {shape.stage_depth}" if shape.stage_depth
                  else f"; loads {shape.prefetch_depth} k-steps ahead" if shape.prefetch_depth > 1 else "")
        split = (f" in clusters of {shape.cluster_blocks} (each block multiplying 1/{shape.cluster_blocks} of a product's "
                 f"inputs for the cluster's {shape.cluster_units} units)" if shape.cluster_blocks > 1 else "")
        return (f"bf16 mma, one pass, fp32 sums and master weights; the head fp32; a grid of {shape.blocks} blocks "
                f"of {shape.block_units} units{split}{staged}")
    if isinstance(shape, MlpShape) and shape.bf16:
        return "bf16 mma, one pass, fp32 sums and master weights; the head 3xTF32"
    if shape.bf16:
        return "bf16 mma, one pass, fp32 sums and master weights; dlogits sent as bf16"
    return ("3xTF32 mma; 8-bit inputs, exact in TF32: two passes with the images" if shape.pixel_levels
            else "3xTF32 mma: three passes")


class PersistentStage(Stage):
    """Its own program, composed of the device pieces (graphtrain.stages.device) and its kernel:
    the arena holds what the kernel reads (the images in its own form, made on the GPU from the
    fp32 ones, the labels, the orders, the parameters, the metrics) and what the test-set
    evaluation needs (the naive kernels); no cuBLAS, cuDNN, graph or stream of the ladder's chain."""

    name = "persistent"
    summary = "one kernel trains the epoch: a thread-block cluster, weights in shared memory"

    def measures(self, epoch: int) -> bool:
        return self.plan.metrics_due[epoch]

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, plan, data = self.config, self.plan, self.data
        self.context = device.DeviceContext()
        self.device, self.stream = self.context.device, self.context.stream
        require_clusters(self.device)
        self.num_train, self.num_test = plan.num_train, plan.num_test
        # One allocation for the run. The fp32 training images go up with the dataset, only for the
        # GPU to check them for 8-bit pixels and write them in the kernel's form (images.cu): the
        # form depends on that check, so its room is the larger of the two candidates'.
        candidates = [self.kernel_shape(levels, refuse=False) for levels in (0, 255)]
        room = max(s.padded_features * np.dtype(s.image_dtype).itemsize for s in candidates)
        workspace = max((s.workspace.bytes for s in candidates if isinstance(s, WideShape)), default=0)
        arena = self.arena = Arena()
        self.dataset = device.DatasetOnDevice(arena, plan, data)
        self.train_labels, self.order = self.dataset.train_labels, self.dataset.order
        images_room = arena.reserve("kernel_images", (self.num_train, room), np.uint8)
        self.params = device.Parameters(arena, cfg)
        self.w, self.b = self.params.w, self.params.b
        self.metrics = arena.reserve("metrics", (2,), np.float64)  # [Σ loss, # correct]
        self.off_levels = arena.reserve("off_levels", (1,), np.uint64)  # images.cu's count
        if cfg.hidden:  # the addresses of every layer's weights, then of its biases
            self.param_table = arena.reserve("param_table", (2 * len(self.w),), np.uint64)
        if workspace:  # the grid kernel's scratch in global memory (its exchanges, its barrier)
            self.workspace = arena.reserve("workspace", (workspace,), np.uint8)
        self.evaluation = device.DeviceEvaluation(arena, cfg, self.dataset)
        arena.allocate()
        self.dataset.upload(self.stream)
        images_cu, fp32 = Images(self.device), self.dataset.train_images
        try:
            self.shape = self.kernel_shape(images_cu.pixel_levels(self.stream, fp32.ptr, fp32.size,
                                                                  self.off_levels.ptr))
            self.images = images_room.view((self.num_train, self.shape.padded_features), self.shape.image_dtype)
            images_cu.kernel_images(self.stream, fp32.ptr, self.num_train, cfg.in_features, self.shape,
                                    self.images.ptr)
            self.stream.synchronize()
        finally:
            images_cu.close()
        if isinstance(self.shape, WideShape):
            self.persistent_cu = PersistentWide(self.device, self.shape)
        elif cfg.hidden:
            self.persistent_cu = PersistentMlp(self.device, self.shape)
        else:
            self.persistent_cu = Persistent(self.device, self.shape)
        if cfg.hidden:
            biases = [b.ptr if b is not None else 0 for b in self.b]
            self.param_table.upload(np.array([w.ptr for w in self.w] + biases, np.uint64), self.stream)
        self.evaluation.load(self.device)
        # Warm up (the first launch), then start again from the shared init.
        self.launch_epoch(0, 1, measure=True)
        self.start_run(plan)

    def start_run(self, plan: RunPlan) -> None:
        """The plan's initial weights and every epoch's sample order on the device, the metrics
        zeroed: what the epochs start from. The kernel keeps nothing else between launches (the
        grid kernel's barrier is zeroed before each), and reads the rate as a launch argument."""
        self.dataset.upload_orders(plan, self.stream)
        self.params.upload(plan.initial, self.stream)
        self.metrics.zero(self.stream)

    def restart(self, plan: RunPlan) -> bool:
        """A plan of the same shape in place: another seed or rate, the images in the kernel's
        form, the compiled kernel and the parameters' table kept. The kernel trains SGD at a
        constant rate only: another recipe is refused (False), as a fresh setup would refuse it."""
        if not self.same_shape(plan) or (plan.config.optimizer, plan.config.schedule) != ("sgd", "constant"):
            return False
        self.adopt(plan)
        self.start_run(plan)
        return True

    def kernel_shape(self, pixel_levels: int, refuse: bool = True) -> Shape | MlpShape | WideShape:
        """The sizes the kernel is compiled for; refused (ModelUnsupported) when it cannot train them."""
        cfg, bf16 = self.config, self.precision == "bf16"
        if cfg.hidden:
            cluster = MlpShape(cfg.in_features, cfg.hidden, cfg.classes, cfg.batch, pixel_levels, bf16=bf16)
            shape = mlp_shape(cluster, self.device.sm_count, refuse, clusters=self.device.compute_capability >= (9, 0))
            if refuse and isinstance(shape, WideShape) and self.num_train * shape.padded_features > MAX_IMAGE_VALUES:
                raise ModelUnsupported(f"the persistent rung's grid kernel addresses at most {MAX_IMAGE_VALUES} image "
                                       f"values, and {self.num_train} images of {shape.padded_features} are more; "
                                       "use --stage device-loop")
            return shape
        shape = Shape(cfg.in_features, cfg.classes, cfg.batch, pixel_levels, bf16=bf16)
        if refuse:
            refuse_unless_trains(shape)
        return shape

    # ---- epochs --------------------------------------------------------------------------------

    def launch_epoch(self, epoch: int, num_steps: int, measure: bool) -> None:
        cfg, order = self.config, self.order.at(epoch * self.num_train)
        if isinstance(self.shape, WideShape):
            self.persistent_cu.train_epoch(self.stream, self.images.ptr, self.train_labels.ptr, order,
                                           self.param_table.ptr, cfg.bias, self.num_train, num_steps, cfg.lr,
                                           self.metrics.ptr, measure, self.workspace.ptr)
        elif cfg.hidden:
            self.persistent_cu.train_epoch(self.stream, self.images.ptr, self.train_labels.ptr, order,
                                           self.param_table.ptr, cfg.bias, self.num_train, num_steps, cfg.lr,
                                           self.metrics.ptr, measure)
        else:
            self.persistent_cu.train_epoch(self.stream, self.images.ptr, self.train_labels.ptr, order,
                                           self.w[0].ptr, self.b[0].ptr if cfg.bias else 0, self.num_train,
                                           num_steps, cfg.lr, self.metrics.ptr, measure)

    def train_epoch(self, epoch: int, num_batches: int, measure: bool) -> EpochResult:
        if measure:
            self.metrics.zero(self.stream)
        ms = self.context.timed(lambda: self.launch_epoch(epoch, num_batches, measure))
        if not measure:
            return EpochResult(ms)
        loss_sum, correct = self.metrics.download(self.stream)
        seen = self.plan.samples_seen(num_batches)
        return EpochResult(ms, loss_sum / seen, correct / seen)

    def test_accuracy(self) -> float:
        return self.evaluation.accuracy(self.stream, self.params)

    def weights(self) -> list[Layer]:
        return self.params.download(self.stream)

    def environment(self) -> dict:
        return {**environment.gpu(self.device), "nvrtc": nvrtc.version(),
                "persistent_kernel": kernel_name(self.shape), "persistent_products": products_note(self.shape)}

    def close(self) -> None:
        for name in ("persistent_cu", "evaluation", "arena", "context"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
