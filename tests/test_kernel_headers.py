"""One source per kernel idea, without a GPU: the logits layer's loss step and the data-parallel
batch slice are written once, in logits_loss.cuh and batch_slice.cuh, and every kernel file that
computes them takes them from there; the files built per model (the class count, fused.cu's
element type) compile for each build on sm_80 and sm_90 with their declarations checked."""

from __future__ import annotations

import re

import pytest

from graphtrain.kernels import KERNELS_DIR, head
from graphtrain.kernels.cnn import Cnn
from graphtrain.kernels.fused import Fused
from graphtrain.kernels.gather import Gather
from graphtrain.kernels.head import Head
from graphtrain.kernels.persistent import Persistent
from graphtrain.kernels.persistent_mlp import PersistentMlp
from graphtrain.kernels.persistent_wide import PersistentWide
from graphtrain.libs import nvrtc

ELF_MAGIC = b"\x7fELF"

# What each header holds, as the code a copy of it in a kernel file would contain.
LOSS_STEP = {"the exponentials of the softmax": r"\bexpf\(", "the loss's logarithm": r"\blogf\(",
             "the first largest logit": r"__ffs\("}
BATCH_SLICE = {"the batch's valid rows": r"%\s*epoch_samples", "a rank's slice": r"/\s*ranks"}
USERS = {Head: (LOSS_STEP, BATCH_SLICE), Fused: (LOSS_STEP, {}), Cnn: (LOSS_STEP, BATCH_SLICE),
         Gather: ({}, BATCH_SLICE), Persistent: (LOSS_STEP, {}), PersistentMlp: (LOSS_STEP, {}),
         PersistentWide: (LOSS_STEP, {})}


def code_of(path) -> str:
    """The file's text without its comments (which may state the math)."""
    text = path.read_text(encoding="utf-8")
    return re.sub(r"//[^\n]*", "", text)


@pytest.mark.parametrize("launcher", USERS, ids=lambda cls: cls.stem)
def test_the_loss_step_and_the_batch_slice_come_from_their_headers(launcher):
    loss_step, batch_slice = USERS[launcher]
    code = code_of(KERNELS_DIR / f"{launcher.stem}.cu")
    for header, pieces in (("logits_loss.cuh", loss_step), ("batch_slice.cuh", batch_slice)):
        if not pieces:
            continue
        assert header in launcher.headers, f"{launcher.stem}.py does not put {header} before {launcher.stem}.cu"
        for what, pattern in pieces.items():
            assert re.search(pattern, code_of(KERNELS_DIR / header)), f"{header} does not compute {what}"
            assert not re.search(pattern, code), f"{launcher.stem}.cu computes {what} itself, not by {header}"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("classes", [1, 10, 32])
def test_fused_compiles_once_per_element_type(nvrtc_available, cache, arch, classes):
    """fused.cu's kernels have one name each, their activations floatX: fp32 or bf16 by BF16."""
    fp32 = Fused.cubin(arch, {"CLASSES": classes, "BF16": 0})
    bf16 = Fused.cubin(arch, {"CLASSES": classes, "BF16": 1})
    assert fp32.startswith(ELF_MAGIC) and bf16.startswith(ELF_MAGIC)
    assert fp32 != bf16
    for name in ("head_step", "head_update", "head_backward", "relu_bias_grad"):
        assert f"_{name}" in Fused.specs(), name


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("classes", [1, 10, head.MAX_CLASSES])
def test_head_compiles_for_every_class_count_it_takes(nvrtc_available, cache, arch, classes):
    assert head.fits(256, classes)
    assert Head.cubin(arch, {"HL_CLASSES": classes}).startswith(ELF_MAGIC)


def test_head_refuses_more_classes_than_its_gradients_kernel_holds(nvrtc_available, cache):
    """head_grads' partial sums are static shared memory: one class more does not compile, so the
    cnn keeps the unfused head there (CnnDevice asks head.fits)."""
    assert not head.fits(256, head.MAX_CLASSES + 1)
    with pytest.raises(nvrtc.NvrtcError, match="too much shared data"):
        Head.cubin("sm_90", {"HL_CLASSES": head.MAX_CLASSES + 1})
