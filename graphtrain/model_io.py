"""Trained models on disk: safetensors files that PyTorch loads as they are.

A model is a sequence of PyTorch modules, and the file is the state_dict of that

    nn.Sequential(Linear(d0, d1), ReLU(), Linear(d1, d2), ReLU(), ..., Linear(dk-1, dk))   an MLP
    nn.Sequential(Conv2d(1, 24, 5), MaxPool2d(2), ReLU(), Conv2d(24, 32, 3), MaxPool2d(2),
                  ReLU(), Flatten(), Linear(800, 256), ReLU(), Linear(256, 10))            a cnn

module i's weight is ``f"{i}.weight"`` and its bias ``f"{i}.bias"`` (Linear (out, in), Conv2d
(out, in, kh, kw)); the pools, ReLUs and Flatten hold no parameters; all float32. So in PyTorch
``model.load_state_dict(safetensors.torch.load_file(path))`` needs no conversion, and `to_torch`
builds that model for you.

The safetensors metadata (a string-to-string map) holds what it takes to use the model, text as
it is and numbers, booleans and lists as JSON. Keys: ``format`` (graphtrain.mlp or graphtrain.cnn)
and ``format_version``; the model: ``layers`` (the modules in order, each ``{"type": its
torch.nn class, ...its constructor's keyword arguments}``, so ``nn.Sequential(*(getattr(nn,
m.pop("type"))(**m) for m in layers))`` rebuilds it), ``dims`` (the linear layers' sizes: an
MLP's whole chain, a cnn's from its flattened features), ``bias``, ``in_features``, ``classes``,
and for a cnn ``input_shape`` (channels, height, width of a sample); its inputs (``dataset``,
``image_shape``, ``preprocessing``, see `graphtrain.data.images`, and ``normalisation``,
``{"mean": m, "std": s}``: the features x the preprocessing gives are fed to the model as
(x − m) / s, as the cnn recipe trains on them; absent, x as it is); and how it was trained
(``stage``, ``seed``, ``batch``, ``lr``, ``optimizer``, ``schedule``, ``epochs_trained``,
``test_accuracy``, ``graphtrain_version``).
`epochs_trained` counts the epochs whose sample order training has used (a last one cut short by
--steps included), so that a run resumed from the file (`--init`) goes on with the next epoch's.
Files written before ``layers`` was added (MLPs) are read from their ``dims`` and ``bias``.

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
from graphtrain.data import images
from graphtrain.data.images import PREPROCESSING
from graphtrain.reference import Layer
from graphtrain.reference_cnn import CnnSpec, ConvLayer

FORMATS = {False: "graphtrain.mlp", True: "graphtrain.cnn"}  # by whether the model has conv layers
FORMAT = FORMATS[False]
FORMAT_VERSION = 1
# A safetensors file starts with the length of its JSON header, a little-endian u64. Real headers
# are kilobytes; a length beyond this says the file is something else.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


# Metadata keys whose values are plain text; every other value is JSON.
TEXT_KEYS = frozenset({"format", "dataset", "preprocessing", "stage", "optimizer", "schedule",
                       "graphtrain_version"})
# ModelInfo fields the metadata holds under other keys, or in another form (`layers`, `normalisation`).
_DERIVED = frozenset({"convs", "normalisation"})


class ModelFileError(UsageError):
    """A model file is unreadable, damaged, foreign, or not the model asked for."""


# --------------------------------------------------------------------------------------------
# The model as PyTorch modules
# --------------------------------------------------------------------------------------------


def modules(dims, bias: bool, convs=(), input_shape=None) -> list[dict]:
    """The model's nn.Sequential modules in order, each {"type": its torch.nn class, **its
    keyword arguments}: per conv layer Conv2d, MaxPool2d (a pool of 1 is none), ReLU (the order
    of `graphtrain.reference_cnn`; max-pool and ReLU commute), then Flatten; then the linear
    layers `dims` with a ReLU between each two."""
    out = []
    channels = input_shape[0] if convs else None
    for conv in convs:
        out.append({"type": "Conv2d", "in_channels": channels, "out_channels": conv.out_channels,
                    "kernel_size": conv.kernel, "stride": conv.stride, "padding": conv.padding, "bias": True})
        if conv.pool > 1:
            out.append({"type": "MaxPool2d", "kernel_size": conv.pool})
        out.append({"type": "ReLU"})
        channels = conv.out_channels
    if convs:
        out.append({"type": "Flatten"})
    for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:])):
        if i:
            out.append({"type": "ReLU"})
        out.append({"type": "Linear", "in_features": fan_in, "out_features": fan_out, "bias": bias})
    return out


def parameter_shapes(layers: list[dict]) -> dict[str, tuple[int, ...]]:
    """The state_dict of `modules`' model: name -> shape, in order."""
    shapes = {}
    for i, m in enumerate(layers):
        if m["type"] == "Conv2d":
            k = m["kernel_size"]
            shapes[f"{i}.weight"] = (m["out_channels"], m["in_channels"], k, k)
            bias = (m["out_channels"],)
        elif m["type"] == "Linear":
            shapes[f"{i}.weight"] = (m["out_features"], m["in_features"])
            bias = (m["out_features"],)
        else:
            continue
        if m["bias"]:
            shapes[f"{i}.bias"] = bias
    return shapes


def describe(dims, bias: bool, convs=()) -> str:
    chain = f"{'-'.join(map(str, dims))} {'with' if bias else 'without'} bias"
    if not convs:
        return chain
    return "conv " + ",".join(conv_text(c) for c in convs) + f", {chain}"


def conv_text(conv: ConvLayer) -> str:
    """A conv layer as --conv writes it (24x5); stride, padding and pool where not the default."""
    text = f"{conv.out_channels}x{conv.kernel}"
    extras = [f"{name} {value}" for name, value, default in
              (("stride", conv.stride, 1), ("padding", conv.padding, 0), ("pool", conv.pool, 2)) if value != default]
    return text + (f" ({', '.join(extras)})" if extras else "")


@dataclass(frozen=True)
class ModelInfo:
    """What a saved model is (`dims`: its linear layers' sizes, `bias`; a cnn's `convs` before
    them over samples of `input_shape`), what it takes as input, and how it was trained."""

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
    convs: tuple[ConvLayer, ...] = ()
    input_shape: tuple[int, int, int] | None = None  # a cnn's (channels, height, width)
    normalisation: tuple[float, float] | None = None  # (mean, std) the features are fed through
    optimizer: str | None = None
    schedule: str | None = None

    @property
    def in_features(self) -> int:
        return int(np.prod(self.input_shape)) if self.convs else self.dims[0]

    @property
    def classes(self) -> int:
        return self.dims[-1]

    @property
    def hidden(self) -> tuple[int, ...]:
        return tuple(self.dims[1:-1])

    @property
    def spec(self) -> CnnSpec:
        """A cnn's model, as `graphtrain.reference_cnn` computes it."""
        channels, height, width = self.input_shape
        return CnnSpec(self.convs, self.hidden, self.classes, channels, height, width)

    def modules(self) -> list[dict]:
        return modules(self.dims, self.bias, self.convs, self.input_shape)

    def describe(self) -> str:
        return describe(self.dims, self.bias, self.convs)

    def to_metadata(self) -> dict[str, str]:
        """Text values as they are, numbers, booleans and lists as JSON; unknowns left out."""
        values = {"format": FORMATS[bool(self.convs)], "format_version": FORMAT_VERSION,
                  "in_features": self.in_features, "classes": self.classes, "layers": self.modules(),
                  **{f.name: getattr(self, f.name) for f in fields(self) if f.name not in _DERIVED}}
        if self.normalisation is not None:
            values["normalisation"] = dict(zip(("mean", "std"), self.normalisation))
        return {key: value if key in TEXT_KEYS else json.dumps(list(value) if isinstance(value, tuple) else value)
                for key, value in values.items() if value is not None}


@dataclass
class Model:
    """A trained model: its parameterised layers in order (float32 `reference.Layer`s: a cnn's
    conv layers, weight (out, in, k, k), then the linear ones, weight (out, in)) and `info`.

        model = graphtrain.load("m.safetensors")
        model.predict(images)        # the class of each image (uint8 0-255 or floats 0-1)
    """

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
            **architecture(config), dataset=data.get("name", config.dataset),
            image_shape=None if shape is None else tuple(shape), stage=record.stage, seed=config.seed,
            batch=config.batch, lr=config.lr, optimizer=config.optimizer, schedule=config.schedule,
            epochs_trained=record.epochs[-1].epoch, test_accuracy=record.test_accuracy,
            graphtrain_version=__version__)
        return cls(list(record.params), info)

    def logits(self, features: np.ndarray) -> np.ndarray:
        """float32 logits of float32 features (N, in_features) in [0, 1] (`graphtrain.data.images`'
        preprocessing): normalised as the model was trained, then the forward pass of the numpy
        stage (the same float32 operations, in the same chunks)."""
        from graphtrain import reference, reference_cnn

        if self.info.normalisation is not None:
            features = images.normalise(features, *self.info.normalisation)
        if not self.info.convs:
            return reference.logits(self.layers, features)
        params = [a for layer in self.layers for a in (layer.w, layer.b)]
        return reference_cnn.logits(self.info.spec, params, features)

    def features(self, inputs: np.ndarray, what: str = "the input") -> np.ndarray:
        """Images as the model takes them: (N, in_features) or (N, *image_shape) (a cnn's also
        (N, C, H, W), and (N, H, W) of one channel), uint8 0-255 or floats 0-1, as float32
        features; a DataError (naming `what`) otherwise."""
        inputs, info = np.asarray(inputs), self.info
        cnn_shapes = [info.input_shape, *([info.input_shape[1:]] if info.input_shape[0] == 1 else [])] \
            if info.convs else []
        if tuple(inputs.shape[1:]) not in cnn_shapes:  # a cnn's (C, H, W), or (H, W) of one channel
            images.check_sample_shape(inputs, info.in_features, info.image_shape, what)
        return images.to_features(inputs, what)

    def predict(self, inputs: np.ndarray) -> np.ndarray:
        """The predicted class of each image in `inputs` (see `features`), int64."""
        return self.logits(self.features(inputs)).argmax(axis=1)


def architecture(config) -> dict:
    """The ModelInfo fields that say which model a TrainConfig trains (its in_features and
    classes taken from the data): dims, bias, and a cnn's convs, input shape and normalisation."""
    if config.model != "cnn":
        return {"dims": tuple(config.dims), "bias": config.bias}
    from graphtrain.config import cnn_spec

    spec = cnn_spec(config)
    # The cnn's layers always have biases; the cnn rungs normalise the features with MNIST's.
    return {"dims": spec.dims, "bias": True, "convs": spec.convs,
            "input_shape": (spec.channels, spec.height, spec.width), "normalisation": images.MNIST_NORMALISATION}


def state_dict(layers: list[Layer], info: ModelInfo) -> dict[str, np.ndarray]:
    """The file's tensors: the parameterised layers' in the order of `info`'s modules."""
    arrays = [a for layer in layers for a in (layer.w, layer.b) if a is not None]
    names = list(parameter_shapes(info.modules()))
    if len(arrays) != len(names):
        # The caller built the info from the same config that shaped the layers: a bug if not.
        raise ValueError(f"{len(arrays)} parameter arrays for the model {info.describe()}, which has {len(names)}")
    return {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in zip(names, arrays)}


def expected_shapes(dims, bias: bool, convs=(), input_shape=None) -> dict[str, tuple[int, ...]]:
    return parameter_shapes(modules(dims, bias, convs, input_shape))


def to_bytes(model: Model) -> bytes:
    from safetensors.numpy import save

    info = model.info
    tensors = state_dict(model.layers, info)
    actual = {name: t.shape for name, t in tensors.items()}
    if actual != parameter_shapes(info.modules()):
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


def _sizes(value, key: str, path: Path, least: int) -> tuple[int, ...]:
    if (not isinstance(value, list) or len(value) < least
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in value)):
        raise ModelFileError(f"{path}: its metadata's {key} {value!r} are not a list of {least} or more sizes")
    return tuple(value)


def _convs(layers, input_shape: tuple[int, ...], path: Path) -> tuple[tuple[ConvLayer, ...], tuple[int, ...]]:
    """A cnn's conv layers and linear sizes, read from its `layers`; they must be exactly the
    modules `modules` writes for them (the model graphtrain computes), nothing else."""
    def foreign(why: str) -> ModelFileError:
        return ModelFileError(f"{path}: its metadata's layers are not a cnn graphtrain computes ({why})")

    if not isinstance(layers, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                               for m in layers):
        raise foreign("a list of modules, each with its 'type', expected")
    types = [m["type"] for m in layers]
    if "Flatten" not in types:
        raise foreign("no Flatten between the conv layers and the linear ones")
    flat = types.index("Flatten")

    def expect(i: int, kind: str) -> dict:
        if types[i] != kind:
            raise foreign(f"module {i} is {types[i]}, where {kind} belongs")
        return layers[i]

    convs, i = [], 0
    try:
        while i < flat:  # Conv2d, MaxPool2d (where it pools), ReLU
            conv, pool = expect(i, "Conv2d"), 1
            if types[i + 1] == "MaxPool2d":
                pool = layers[i + 1]["kernel_size"]
                i += 1
            expect(i + 1, "ReLU")
            i += 2
            convs.append(ConvLayer(conv["out_channels"], conv["kernel_size"], conv.get("stride", 1),
                                   conv.get("padding", 0), pool))
        dims = [expect(j, "Linear")["in_features"] for j in range(flat + 1, len(layers), 2)]
        dims.append(layers[-1]["out_features"])
        bias = layers[-1].get("bias", True)
    except (KeyError, IndexError, TypeError) as exc:
        raise foreign(f"{type(exc).__name__}: {exc}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for c in convs
               for v in (c.out_channels, c.kernel, c.stride, c.padding, c.pool)):
        raise foreign("conv sizes must be integers")
    dims = _sizes(dims, "linear sizes", path, 2)
    convs = tuple(convs)
    problems = CnnSpec(convs, dims[1:-1], dims[-1], *input_shape).problems() if convs else ["no conv layer"]
    if problems:
        raise foreign("; ".join(problems))
    flat_features = CnnSpec(convs, (), dims[-1], *input_shape).flat_features
    if flat_features != dims[0]:
        raise foreign(f"the conv layers give {flat_features} features, the first linear layer takes {dims[0]}")
    if layers != modules(dims, bias, convs, input_shape):
        raise foreign(f"they differ from those of the model {describe(dims, bias, convs)} over {list(input_shape)} "
                      "samples")
    return convs, dims


def _info(metadata, path: Path) -> ModelInfo:
    kind = metadata.get("format") if isinstance(metadata, dict) else None
    if kind not in FORMATS.values():
        raise ModelFileError(
            f"{path}: a safetensors file, but not a graphtrain model (its metadata has no format "
            f"{' or '.join(map(repr, FORMATS.values()))}; graphtrain reads the files `graphtrain run --save` writes)")
    version = _metadata_value(metadata, "format_version", path)
    if version != FORMAT_VERSION:
        raise ModelFileError(f"{path}: model format version {version!r}; this graphtrain reads version "
                             f"{FORMAT_VERSION}")
    values = {f.name: _metadata_value(metadata, f.name, path) for f in fields(ModelInfo)
              if f.name in metadata and f.name not in _DERIVED}
    if kind == FORMATS[True]:
        values["input_shape"] = _sizes(_metadata_value(metadata, "input_shape", path), "input_shape", path, 3)
        if len(values["input_shape"]) != 3:
            raise ModelFileError(f"{path}: its metadata's input_shape {list(values['input_shape'])} is not "
                                 "(channels, height, width)")
        values["convs"], dims = _convs(_metadata_value(metadata, "layers", path), values["input_shape"], path)
        if "dims" in values and _sizes(values["dims"], "dims", path, 2) != dims:
            raise ModelFileError(f"{path}: its metadata's dims {values['dims']} disagree with its layers' "
                                 f"{list(dims)}")
        values["dims"] = dims
        if "normalisation" in metadata:
            values["normalisation"] = _normalisation(_metadata_value(metadata, "normalisation", path), path)
    else:
        values["dims"] = _sizes(_metadata_value(metadata, "dims", path), "dims", path, 2)
        values.pop("input_shape", None)
    dims = values["dims"]
    if not isinstance(values.get("bias"), bool) or not isinstance(values.get("dataset"), str):
        raise ModelFileError(f"{path}: its metadata needs bias (true or false) and dataset (a name)")
    if values.get("image_shape") is not None:
        values["image_shape"] = tuple(values["image_shape"])
    try:
        info = ModelInfo(**values)
    except TypeError as exc:  # an unexpected key type is as foreign as a missing key
        raise ModelFileError(f"{path}: unreadable metadata: {exc}") from None
    for name, size in (("in_features", info.in_features), ("classes", info.classes)):  # said twice, for readers
        if name in metadata and (value := _metadata_value(metadata, name, path)) != size:
            raise ModelFileError(f"{path}: its metadata's {name} ({value!r}) disagree with its dims {list(dims)}")
    return info


def _check_layers(metadata: dict, info: ModelInfo, path: Path) -> None:
    """An MLP's `layers`, where the file has them, are those its dims and bias give (a cnn's
    were read from them)."""
    if "layers" in metadata and _metadata_value(metadata, "layers", path) != info.modules():
        raise ModelFileError(f"{path}: its metadata's layers disagree with its dims {list(info.dims)} and bias")


def _normalisation(value, path: Path) -> tuple[float, float]:
    if (not isinstance(value, dict) or set(value) != {"mean", "std"}
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in value.values())
            or value["std"] <= 0):
        raise ModelFileError(f"{path}: its metadata's normalisation {value!r} is not "
                             '{"mean": a number, "std": a number > 0}')
    return float(value["mean"]), float(value["std"])


def _tensors(data: bytes, header: dict, info: ModelInfo, path: Path) -> dict[str, np.ndarray]:
    """The tensors, once their names, dtypes, shapes and extent are what `info` says."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    expected = parameter_shapes(info.modules())
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
    _check_layers(header["__metadata__"], info, path)
    layers = [Layer(tensors[f"{i}.weight"], tensors.get(f"{i}.bias"))
              for i, m in enumerate(info.modules()) if m["type"] in ("Conv2d", "Linear")]
    if not all(np.isfinite(layer.w).all() and (layer.b is None or np.isfinite(layer.b).all())
               for layer in layers):
        raise ModelFileError(f"{path}: its parameters hold NaN or infinite values")
    return Model(layers, info, path)


def check_matches(model: Model, path, dims, bias: bool, convs=(), input_shape=None) -> None:
    """The one-line error when a file's model is not the one a run asks for (`dims`, `bias`,
    and a cnn's `convs` over samples of `input_shape`)."""
    info = model.info
    if (tuple(dims), bias, tuple(convs)) == (info.dims, info.bias, info.convs) and \
            (not convs or tuple(input_shape) == info.input_shape):
        return
    asked = expected_shapes(dims, bias, convs, input_shape)
    held = parameter_shapes(info.modules())
    differing = [name for name in dict.fromkeys([*asked, *held]) if asked.get(name) != held.get(name)]
    wanted = describe(dims, bias, convs)
    if not differing:  # the same tensors, other modules between them (a pool, the input's size)
        raise ModelFileError(f"{path} holds a {info.describe()} model over {info.in_features} features, the run "
                             f"asks for {wanted} over {int(np.prod(input_shape)) if convs else dims[0]}")
    name = differing[0]

    def shape(shapes):
        return str(shapes[name]) if name in shapes else "absent"

    raise ModelFileError(
        f"{path} holds a {info.describe()} model, the run asks for {wanted}: tensor {name} is "
        f"{shape(held)} in the file, {shape(asked)} in the run")


def check_config(model: Model, path, config) -> None:
    """`check_matches` for the model a TrainConfig trains (in_features and classes the data's)."""
    check_matches(model, path, **{k: v for k, v in architecture(config).items() if k != "normalisation"})


def check_data(model: Model, path, num_features: int, num_classes: int, data_name: str) -> None:
    """A model fits data with its input size whose labels are among its classes."""
    info = model.info
    if num_features != info.in_features or num_classes > info.classes:
        raise ModelFileError(
            f"{path} takes {info.in_features} input features and has {info.classes} classes; "
            f"{data_name} has {num_features} features and {num_classes} classes")


def to_torch(path: str | os.PathLike[str]):
    """The saved model as a PyTorch ``nn.Sequential`` of the file's modules on the CPU, its
    state_dict the file's. An MLP's takes the features (N, in_features) as graphtrain does; a
    cnn's is a Sequential that also takes them, flat or (N, C, H, W), in [0, 1] (the
    preprocessing's), and normalises and reshapes them before its first module."""
    try:
        import torch
    except ImportError:
        raise UsageError("graphtrain.to_torch needs PyTorch, which is not installed: "
                         f"{INSTALL_HINTS['torch']}") from None
    model = load(path)
    info = model.info
    built = [getattr(torch.nn, m["type"])(**{k: v for k, v in m.items() if k != "type"}) for m in info.modules()]
    net = torch.nn.Sequential(*built) if info.normalisation is None and not info.convs else \
        _input_sequential(torch)(built, info.input_shape if info.convs else None, info.normalisation)
    net.load_state_dict({name: torch.from_numpy(t.copy()) for name, t in state_dict(model.layers, info).items()})
    return net.eval()


def _input_sequential(torch):
    class InputSequential(torch.nn.Sequential):
        """nn.Sequential whose input, the features in [0, 1], is first normalised as graphtrain
        feeds the model, (x − mean) / std, and reshaped to (N, *input_shape); no parameters of its own,
        so its state_dict is its modules', the file's."""

        def __init__(self, modules, input_shape, normalisation):
            super().__init__(*modules)
            self.input_shape, self.normalisation = input_shape, normalisation

        def forward(self, x):
            if self.normalisation is not None:
                mean, std = self.normalisation
                x = (x - mean) / std
            if self.input_shape is not None:
                x = x.reshape(len(x), *self.input_shape)
            return super().forward(x)

        def extra_repr(self) -> str:
            return f"input_shape={self.input_shape}, normalisation={self.normalisation}"

    return InputSequential
