import pytest

from graphtrain.config import PRESETS, TrainConfig, parse_hidden, preset
from graphtrain.errors import UsageError


def test_presets_match_the_design():
    jhu, mlp, mnist = PRESETS["jhu"], PRESETS["cuda-mlp"], PRESETS["cuda-mnist"]
    assert jhu.dims == (784, 10) and jhu.bias and (jhu.batch, jhu.epochs, jhu.lr) == (128, 20, 0.1)
    assert mlp.dims == (784, 784, 784, 784, 784, 10) and not mlp.bias and (mlp.batch, mlp.epochs) == (64, 10)
    assert mnist.steps == 5000 and mnist.epochs is None and mnist.batch == 32 and mnist.lr == 0.003
    for cfg in PRESETS.values():
        cfg.validate(60000)


@pytest.mark.parametrize("changes,needle", [
    ({"lr": 0.0}, "lr must be > 0"),
    ({"lr": -1.0}, "lr must be > 0"),
    ({"batch": 0}, "batch must be >= 1"),
    ({"hidden": (784, 0)}, "hidden sizes"),
    ({"epochs": 0}, "epochs must be >= 1"),
    ({"metrics_every": 0}, "metrics_every"),
    ({"precision": "fp8"}, "precision"),
])
def test_invalid_values_are_rejected(changes, needle):
    with pytest.raises(UsageError, match=needle):
        PRESETS["jhu"].replace(**changes).validate()


def test_batch_larger_than_dataset_is_rejected():
    with pytest.raises(UsageError, match="larger than the dataset"):
        PRESETS["jhu"].replace(batch=1000).validate(num_train=500)


def test_unknown_preset_names_the_choices():
    with pytest.raises(UsageError, match="jhu"):
        preset("nope")


def test_parse_hidden():
    assert parse_hidden("784,784") == (784, 784)
    assert parse_hidden("none") == ()
    with pytest.raises(UsageError):
        parse_hidden("784,x")
    with pytest.raises(UsageError):
        parse_hidden("784,-2")


def test_steps_schedule_and_epochs_override():
    cfg = PRESETS["cuda-mnist"]
    assert cfg.num_epochs(60000) == 3  # 1875 batches per epoch, 5000 steps
    assert [cfg.batches_in_epoch(e, 60000) for e in range(3)] == [1875, 1875, 1250]
    assert cfg.replace(epochs=2).steps is None
    assert PRESETS["jhu"].replace(steps=10).epochs is None


def test_sparse_metrics_schedule_includes_the_last_epoch():
    cfg = TrainConfig(epochs=25, metrics_every=10)
    assert [e for e in range(25) if cfg.metrics_due(e, 25)] == [9, 19, 24]
