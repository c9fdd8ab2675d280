"""The row registry (graphtrain.stages.REGISTRY): every row resolves to its classes, every list of
rows and every refusal derives from it, and each class name in the package means one thing."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from graphtrain import stages
from graphtrain.config import MODELS, PRESETS, TrainConfig
from graphtrain.errors import ModelUnsupported, UsageError
from graphtrain.stages.base import Stage

PACKAGE = Path(stages.__file__).resolve().parent.parent
REGISTRY_FILE = Path(stages.__file__).resolve()
ROW_NAMES = {spec.name for spec in stages.REGISTRY}
SLOTS = [(spec, model, data_parallel) for spec in stages.REGISTRY for model in MODELS
         for data_parallel in (False, True)]


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def slot_id(slot) -> str:
    spec, model, data_parallel = slot
    return f"{spec.name}-{model}" + ("-gpus" if data_parallel else "")


@pytest.mark.parametrize("slot", SLOTS, ids=slot_id)
def test_every_row_resolves_to_its_class_and_the_class_says_what_the_registry_says(slot):
    spec, model, data_parallel = slot
    trainer = spec.trainer(model, data_parallel)
    if isinstance(trainer, stages.Refused):
        assert trainer.why
        return
    cls = trainer.load()
    assert issubclass(cls, Stage), cls
    assert (cls.name, cls.model_kind, cls.data_parallel) == (spec.name, model, data_parallel), cls
    assert (cls.uses_gpu, cls.kind, cls.precisions, cls.recipe_refusal, cls.optimizers) == \
        (spec.uses_gpu, spec.kind, trainer.precisions, trainer.recipe_refusal, trainer.optimizers), cls
    if not data_parallel:
        assert stages.get_stage(spec.name, model) is cls


def test_every_row_trains_something_and_its_packs_resolve():
    for spec in stages.REGISTRY:
        assert spec.kind in ("stage", "peer"), spec.name
        trainers = [spec.trainer(model) for model in MODELS]
        assert spec.pack is not None or any(isinstance(t, stages.Trainer) for t in trainers), spec.name
        if spec.pack is not None:
            assert callable(stages.load_target(spec.pack.target)), spec.name
            if spec.pack.check is not None:
                assert callable(stages.load_target(spec.pack.check)), spec.name


def test_the_speedrun_rows_are_the_rows_that_train_its_model():
    """The speedrun times Stage classes, as run and ladder train them: every row with a class for
    the speedrun preset's model, the rungs fastest first, then the peers; its defaults among them."""
    model = PRESETS["speedrun"].model
    names = stages.speedrun_names()
    assert set(names) == set(stages.models_on(model))
    rungs, peers = stages.speedrun_names("stage"), stages.speedrun_names("peer")
    assert names == rungs + peers
    assert rungs == [name for name in reversed(stages.LADDER) if name in rungs]
    assert peers == [name for name in stages.PEERS if name in peers]
    for kind in ("stage", "peer"):
        defaults = stages.speedrun_defaults(kind)
        assert defaults and set(defaults) <= set(stages.speedrun_names(kind))
        assert all(stages.SPECS[name].speedrun_default for name in defaults)
    for name in names:
        cls = stages.get_stage(name, model)
        assert issubclass(cls, Stage) and cls.model_kind == model and cls.restarts(), name
    # the peers that train the cnn do it in `run` too: no "trains MLPs only" for them
    assert {"torch-graph", "jax-scan"} <= set(peers)


def test_a_row_that_trains_some_optimizers_refuses_the_others_before_any_work():
    cls = stages.get_stage("torch-graph", "cnn")
    cls.check_recipe(PRESETS["speedrun"])
    with pytest.raises(ModelUnsupported) as refused:
        cls.check_recipe(PRESETS["speedrun"].replace(optimizer="momentum"))
    assert str(refused.value) == (f"torch-graph trains the cnn with adam or adamw, not --optimizer momentum; "
                                  f"{stages.RECIPE_ROWS}")


def test_the_lists_are_the_registrys():
    assert list(stages.LADDER) + list(stages.PEERS) == list(stages.ROWS)
    assert set(stages.ROWS) | set(stages.PACKED_PEERS) == ROW_NAMES
    assert stages.CHAIN_END in stages.LADDER
    # the recipe's rows, as every refusal of the recipe says them
    recipe_rows = [name for name in stages.ROWS if stages.ROWS[name].mlp.__class__ is stages.Trainer
                   and stages.ROWS[name].mlp.trains_recipes]
    ladder = list(stages.LADDER)
    assert recipe_rows == ["numpy", *ladder[ladder.index("graphs"):ladder.index("device-loop") + 1]]
    assert stages.RECIPE_ROWS.endswith("numpy and on graphs through device-loop")


def test_the_registry_loads_without_numpy_or_cuda():
    code = ("import sys, graphtrain.stages as s; s.speedrun_names(); s.DATA_PARALLEL_RUNGS; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'cuda', 'torch', 'jax')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


# ---- refusals, said by the registry ----------------------------------------------------------


@pytest.mark.parametrize("slot", [s for s in SLOTS if s[0].name in stages.ROWS], ids=slot_id)
def test_every_refusal_says_the_registrys_reason(slot):
    spec, model, data_parallel = slot
    trainer = spec.trainer(model, data_parallel)
    if data_parallel:
        why = stages.data_parallel_refusal(spec.name, model)
        if isinstance(trainer, stages.Refused):
            assert why.endswith(f"{spec.name} cannot: {trainer.why}"), why
            with pytest.raises(UsageError, match=re.escape(trainer.why)):
                stages.get_stage(spec.name, model, data_parallel=True)
        else:
            assert why is None
        return
    if isinstance(trainer, stages.Refused):
        with pytest.raises(UsageError) as refused:
            stages.get_stage(spec.name, model)
        assert str(refused.value).startswith(f"{spec.name} {trainer.why}; the {model} trains on "
                                             f"{', '.join(stages.models_on(model))}"), refused.value
        return
    config = TrainConfig(hidden=(8,), optimizer="adam", schedule="one-cycle")
    if model == "cnn":
        config = config.replace(conv=((4, 3),))
    cls = trainer.load()
    if trainer.trains_recipes:
        cls.check_recipe(config)
    else:
        with pytest.raises(ModelUnsupported) as refused:
            cls.check_recipe(config)
        assert str(refused.value).endswith(f"; {trainer.recipe_refusal}"), refused.value
    wrong = next(p for p in ("fp32", "tf32", "bf16") if p not in trainer.precisions)
    with pytest.raises(UsageError, match=f"^{re.escape(spec.name)} trains in {' or '.join(trainer.precisions)}, "):
        cls.check_precision(wrong)


def test_the_reasons_are_written_only_in_the_registry():
    """A reason typed again elsewhere would drift from the registry's."""
    reasons = {r.why for spec in stages.REGISTRY for model in MODELS for dp in (False, True)
               if isinstance(r := spec.trainer(model, dp), stages.Refused)}
    reasons |= {t.recipe_refusal for spec in stages.REGISTRY for model in MODELS for dp in (False, True)
                if isinstance(t := spec.trainer(model, dp), stages.Trainer) and t.recipe_refusal}
    for path in sources():
        if path == REGISTRY_FILE:
            continue
        text = path.read_text()
        found = [why for why in reasons if why in text]
        assert not found, f"{path.relative_to(PACKAGE.parent)} repeats {found}"


def test_no_row_class_declares_what_the_registry_holds():
    held = {"uses_gpu", "kind", "precisions", "recipe_refusal", "trains_recipes", "optimizers"}
    rows = [p for p in sources() if p.parent.name in ("stages", "peers") and p.name not in ("base.py", "__init__.py")]
    assert len(rows) > 10
    for path in rows:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {t.id for stmt in node.body if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                         for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
                         if isinstance(t, ast.Name)}
                assert not names & held, f"{path.relative_to(PACKAGE.parent)}: {node.name} declares {names & held}"


# ---- the registry is the only list -----------------------------------------------------------


def literal_row_lists(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """(line, names) of every list, tuple, set or dict literal holding 3 or more row names."""
    found = []
    for node in ast.walk(tree):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None) \
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else None
        if items is None:
            continue
        names = [item.value for item in items if isinstance(item, ast.Constant) and item.value in ROW_NAMES]
        if len(names) >= 3:
            found.append((node.lineno, names))
    return found


def test_the_package_lists_no_rows_outside_the_registry():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line} {names}"
                 for path in sources() if path != REGISTRY_FILE
                 for line, names in literal_row_lists(ast.parse(path.read_text()))]
    assert not offenders, offenders


def test_the_check_finds_a_list_of_rungs():
    tree = ast.parse('CNN = {"numpy": 1, "graphs": 2, "device-loop": 3}\nX = ("a", "graphs")\n')
    assert literal_row_lists(tree) == [(1, ["numpy", "graphs", "device-loop"])]


def test_the_scripts_loop_over_no_typed_list_of_rungs():
    scripts = PACKAGE.parent / "scripts"
    for path in sorted(scripts.rglob("*.sh")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            loop = re.match(r"\s*for \w+ in (.*); do", line)
            if loop:
                names = [w for w in loop.group(1).split() if w in ROW_NAMES]
                assert len(names) < 3, f"{path.name}:{number} lists {names}: derive it from graphtrain.stages"


def test_no_cnn_branches_in_the_cli_or_the_trainer():
    for name in ("cli.py", "training.py"):
        text = (PACKAGE / name).read_text()
        assert not re.search(r"""==\s*["']cnn["']|["']cnn["']\s*==|!=\s*["']cnn["']""", text), name
        assert "cnn_rungs" not in text, name


# ---- one class per name ----------------------------------------------------------------------

def test_each_class_name_means_one_thing():
    where: dict[str, list[str]] = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(PACKAGE.parent)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared
