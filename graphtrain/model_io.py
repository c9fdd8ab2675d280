"""Trained models on disk: safetensors files that PyTorch loads as they are.

Tensor names and layouts are those of the state_dict of PyTorch's

    nn.Sequential(Linear(d0, d1), ReLU(), Linear(d1, d2), ReLU(), ..., Linear(dk-1, dk))

that is, layer i's weight is ``f"{2 i}.weight"`` of shape (out, in) and its bias ``f"{2 i}.bias"``
(the ReLUs at odd indices hold no parameters), all float32. So in PyTorch
``model.load_state_dict(safetensors.torch.load_file(path))`` needs no conversion, and
`to_torch` builds that model for you.

The safetensors metadata (a string-to-string map) holds what it takes to use the model, text as
it is and numbers, booleans and lists as JSON. Keys: ``format`` (graphtrain.mlp) and
``format_version``; the model (``dims``, ``bias``, ``in_features``, ``classes``); its inputs
(``dataset``, ``image_shape``, ``preprocessing``, see `graphtrain.data.images`); and how it was
trained (``stage``, ``seed``, ``batch``, ``lr``, ``epochs_trained``, ``test_accuracy``,
``graphtrain_version``).
`epochs_trained` counts the epochs whose sample order training has used (a last one cut short by
--steps included), so that a run resumed from the file (`--init`) goes on with the next epoch's.

Every problem with a file (unreadable, truncated, corrupted, not safetensors, not a graphtrain
model, or not the model asked for) raises `ModelFileError`, one line naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from graphtrain.errors import INSTALL_HINTS, UsageError
from graphtrain.files import read_input, write_atomic
from graphtrain.data.images import PREPROCESSING
from graphtrain.reference import Layer

FORMAT = "graphtrain.mlp"
FORMAT_VERSION = 1
# A safetensors file starts with the length of its JSON header, a little-endian u64. Real headers
# are kilobytes; a length beyond this says the file is something else.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


# Metadata keys whose values are plain text; every other value is JSON.
TEXT_KEYS = frozenset({"format", "dataset", "preprocessing", "stage", "graphtrain_version"})


class ModelFileError(UsageError):
    """A model file is unreadable, damaged, foreign, or not the model asked for."""


@dataclass(frozen=True)
class ModelInfo:
    """What a saved model is (dims, bias), what it takes as input, and how it was trained."""

    dims: tuple[int, ...]
    bias: bool
    dataset: str
    image_shape: tuple[int, ...] | None = None
    preprocessing: str = PREPROCESSING
    stage: str | None = None
    seed: int | None = None
    batch: int | None = None
    lr: float | None = None
    epochs_trained: int = 0
    test_accuracy: float | None = None
    graphtrain_version: str | None = field(default=None, compare=False)

    @property
    def in_features(self) -> int:
        return self.dims[0]

    @property
    def classes(self) -> int:
        return self.dims[-1]

    @property
    def hidden(self) -> tuple[int, ...]:
        return tuple(self.dims[1:-1])

    def describe(self) -> str:
        return f"{'-'.join(map(str, self.dims))} {'with' if self.bias else 'without'} bias"

    def to_metadata(self) -> dict[str, str]:
        """Text values as they are, numbers, booleans and lists as JSON; unknowns left out."""
        values = {"format": FORMAT, "format_version": FORMAT_VERSION, "in_features": self.in_features,
                  "classes": self.classes, **{f.name: getattr(self, f.name) for f in fields(self)}}
        return {key: value if key in TEXT_KEYS else json.dumps(list(value) if isinstance(value, tuple) else value)
                for key, value in values.items() if value is not None}


@dataclass
class Model:
    """A trained model: its layers (float32, `reference.Layer`, weight (out, in)) and `info`."""

    layers: list[Layer]
    info: ModelInfo
    source: Path | None = None  # the file it was loaded from

    @classmethod
    def from_record(cls, record) -> Model:
        """The model a run trained (`graphtrain.train`'s record, whose `params` it holds)."""
        from graphtrain import __version__

        if record.params is None:
            raise ValueError(f"the {record.stage} run record holds no parameters")
        config, data = record.config, record.data or {}
        shape = data.get("image_shape")
        info = ModelInfo(
            dims=tuple(config.dims), bias=config.bias, dataset=data.get("name", config.dataset),
            image_shape=None if shape is None else tuple(shape), stage=record.stage, seed=config.seed,
            batch=config.batch, lr=config.lr, epochs_trained=record.epochs[-1].epoch,
            test_accuracy=record.test_accuracy, graphtrain_version=__version__)
        return cls(list(record.params), info)


def tensor_names(layer_index: int) -> tuple[str, str]:
    """The nn.Sequential state_dict names of layer i's weight and bias (ReLUs sit between)."""
    return f"{2 * layer_index}.weight", f"{2 * layer_index}.bias"


def state_dict(layers: list[Layer]) -> dict[str, np.ndarray]:
    tensors = {}
    for i, layer in enumerate(layers):
        weight, bias = tensor_names(i)
        tensors[weight] = np.ascontiguousarray(layer.w, dtype=np.float32)
        if layer.b is not None:
            tensors[bias] = np.ascontiguousarray(layer.b, dtype=np.float32)
    return tensors


def expected_shapes(dims, bias: bool) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
        weight, bias_name = tensor_names(i)
        shapes[weight] = (fan_out, fan_in)
        if bias:
            shapes[bias_name] = (fan_out,)
    return shapes


def to_bytes(model: Model) -> bytes:
    from safetensors.numpy import save

    info, tensors = model.info, state_dict(model.layers)
    actual = {name: t.shape for name, t in tensors.items()}
    if actual != expected_shapes(info.dims, info.bias):
        # The caller built the info from the same config that shaped the layers: a bug if not.
        raise ValueError(f"layers {actual} do not match the model {info.describe()}")
    return save(tensors, metadata=info.to_metadata())


def save(path: str | os.PathLike[str], model) -> Path:
    """Write `model` (a `Model`, or the run record `graphtrain.train` returns) to `path`
    atomically: the whole file or none of it. Returns the path."""
    if not isinstance(model, Model):
        model = Model.from_record(model)
    return write_atomic(path, to_bytes(model))


# --------------------------------------------------------------------------------------------
# Loading, with a one-line error for every way a file can be wrong
# --------------------------------------------------------------------------------------------


def _header(data: bytes, path: Path) -> dict:
    """The JSON header, after checking the frame around it: length prefix, size, JSON object."""
    not_safetensors = f"{path}: not a safetensors file"
    if len(data) < 8:
        raise ModelFileError(f"{not_safetensors} ({len(data)} bytes, too short for a header)")
    (length,) = struct.unpack("<Q", data[:8])
    if length > _MAX_HEADER_BYTES:
        raise ModelFileError(f"{not_safetensors} (its first 8 bytes give a header of {length} bytes)")
    if 8 + length > len(data):
        raise ModelFileError(f"{path}: truncated: its header needs {8 + length} bytes, the file has {len(data)}")
    try:
        header = json.loads(data[8:8 + length])
    except (UnicodeDecodeError, ValueError):
        raise ModelFileError(f"{not_safetensors} (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{not_safetensors} (its header is not a JSON object)")
    return header


def _metadata_value(metadata: dict, key: str, path: Path):
    if key not in metadata:
        raise ModelFileError(f"{path}: its metadata lacks {key!r}")
    if key in TEXT_KEYS:
        return metadata[key]
    try:
        return json.loads(metadata[key])
    except (TypeError, ValueError):
        raise ModelFileError(f"{path}: its metadata's {key!r} is not valid ({metadata[key]!r})") from None


def _dims(value, path: Path) -> tuple[int, ...]:
    if (not isinstance(value, list) or len(value) < 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in value)):
        raise ModelFileError(f"{path}: its metadata's dims {value!r} are not a list of two or more sizes")
    return tuple(value)


def _info(metadata, path: Path) -> ModelInfo:
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise ModelFileError(
            f"{path}: a safetensors file, but not a graphtrain model (its metadata has no format "
            f"{FORMAT!r}; graphtrain reads the files `graphtrain run --save` writes)")
    version = _metadata_value(metadata, "format_version", path)
    if version != FORMAT_VERSION:
        raise ModelFileError(f"{path}: model format version {version!r}; this graphtrain reads version "
                             f"{FORMAT_VERSION}")
    dims = _dims(_metadata_value(metadata, "dims", path), path)
    values = {"dims": dims}
    for f in fields(ModelInfo):
        if f.name != "dims" and f.name in metadata:
            values[f.name] = _metadata_value(metadata, f.name, path)
    for name, size in (("in_features", dims[0]), ("classes", dims[-1])):  # dims say it too, for readers
        if name in metadata and (value := _metadata_value(metadata, name, path)) != size:
            raise ModelFileError(f"{path}: its metadata's {name} ({value!r}) disagree with its dims {list(dims)}")
    if not isinstance(values.get("bias"), bool) or not isinstance(values.get("dataset"), str):
        raise ModelFileError(f"{path}: its metadata needs bias (true or false) and dataset (a name)")
    if values.get("image_shape") is not None:
        values["image_shape"] = tuple(values["image_shape"])
    try:
        return ModelInfo(**values)
    except TypeError as exc:  # an unexpected key type is as foreign as a missing key
        raise ModelFileError(f"{path}: unreadable metadata: {exc}") from None


def _tensors(data: bytes, header: dict, info: ModelInfo, path: Path) -> dict[str, np.ndarray]:
    """The tensors, once their names, dtypes, shapes and extent are what `info` says."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    expected = expected_shapes(info.dims, info.bias)
    names = {k for k in header if k != "__metadata__"}
    if names != set(expected):
        missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
        parts = ([f"lacks {', '.join(missing)}"] if missing else []) + \
                ([f"has unexpected {', '.join(extra)}"] if extra else [])
        raise ModelFileError(f"{path}: for a {info.describe()} model it {' and '.join(parts)}")
    for name, shape in expected.items():
        entry = header[name]
        if not isinstance(entry, dict) or entry.get("dtype") != "F32":
            dtype = entry.get("dtype") if isinstance(entry, dict) else None
            raise ModelFileError(f"{path}: tensor {name} is {dtype}, graphtrain models are float32 (F32)")
        found = entry.get("shape")
        if not isinstance(found, list) or tuple(found) != shape:
            found = tuple(found) if isinstance(found, list) else found
            raise ModelFileError(f"{path}: tensor {name} has shape {found}, its metadata's model "
                                 f"{info.describe()} needs {shape}")
    # The tensor bytes follow the header; data_offsets count from there.
    (header_bytes,) = struct.unpack("<Q", data[:8])
    offsets = [header[name].get("data_offsets") for name in expected]
    ends = [o[1] for o in offsets if isinstance(o, list) and len(o) == 2 and isinstance(o[1], int)]
    needed = 8 + header_bytes + max(ends, default=0)
    if len(data) < needed:
        raise ModelFileError(f"{path}: truncated: its tensors need {needed} bytes, the file has {len(data)}")
    try:
        tensors = load(data)
    except SafetensorError as exc:
        raise ModelFileError(f"{path}: corrupted or truncated safetensors data: {exc}") from None
    return tensors


def load(path: str | os.PathLike[str]) -> Model:
    """Read a model saved by `save` (or by `graphtrain run --save`), checking all of it."""
    path = Path(path)
    data = read_input(path, ModelFileError)
    header = _header(data, path)
    info = _info(header.get("__metadata__"), path)
    tensors = _tensors(data, header, info, path)
    layers = []
    for i in range(len(info.dims) - 1):
        weight, bias = tensor_names(i)
        layers.append(Layer(tensors[weight], tensors[bias] if info.bias else None))
    if not all(np.isfinite(layer.w).all() and (layer.b is None or np.isfinite(layer.b).all())
               for layer in layers):
        raise ModelFileError(f"{path}: its parameters hold NaN or infinite values")
    return Model(layers, info, path)


def check_matches(model: Model, path, dims, bias: bool) -> None:
    """The one-line error when a file's model is not the one a run asks for."""
    info = model.info
    if tuple(dims) == info.dims and bias == info.bias:
        return
    asked = expected_shapes(dims, bias)
    held = expected_shapes(info.dims, info.bias)
    differing = [name for name in dict.fromkeys([*asked, *held]) if asked.get(name) != held.get(name)]
    name = differing[0]

    def shape(shapes):
        return str(shapes[name]) if name in shapes else "absent"

    raise ModelFileError(
        f"{path} holds a {info.describe()} model, the run asks for "
        f"{'-'.join(map(str, dims))} {'with' if bias else 'without'} bias: tensor {name} is "
        f"{shape(held)} in the file, {shape(asked)} in the run")


def check_data(model: Model, path, num_features: int, num_classes: int, data_name: str) -> None:
    """A model fits data with its input size whose labels are among its classes."""
    info = model.info
    if num_features != info.in_features or num_classes > info.classes:
        raise ModelFileError(
            f"{path} takes {info.in_features} input features and has {info.classes} classes; "
            f"{data_name} has {num_features} features and {num_classes} classes")


def to_torch(path: str | os.PathLike[str]):
    """The saved model as a PyTorch ``nn.Sequential(Linear, ReLU, ..., Linear)`` on the CPU."""
    try:
        import torch
    except ImportError:
        raise UsageError("graphtrain.to_torch needs PyTorch, which is not installed: "
                         f"{INSTALL_HINTS['torch']}") from None
    model = load(path)
    dims, modules = model.info.dims, []
    for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
        if i:
            modules.append(torch.nn.ReLU())
        modules.append(torch.nn.Linear(fan_in, fan_out, bias=model.info.bias))
    net = torch.nn.Sequential(*modules)
    net.load_state_dict({name: torch.from_numpy(t.copy()) for name, t in state_dict(model.layers).items()})
    return net.eval()
