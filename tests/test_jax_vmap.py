"""The jax-vmap peer on the CPU (jax's CPU device; skipped where jax is not installed): each packed
model equal to the same JAX step run on it alone, and to graphtrain's float64 NumPy reference
over its first steps, the cnn (the speedrun recipe) and the MLP (SGD and the recipe); what it
refuses. Tiny workloads: 300 images of random pixels, batch 64, two epochs of 4 full batches
and a tail, two models differing in lr and seed.

Random pixels rather than clipped or blank ones keep the max-pools free of near-ties, where a
float32 rounding may route a gradient to another position than float64 does."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from graphtrain import reference, reference_cnn  # noqa: E402
from graphtrain.config import PRESETS, TrainConfig, cnn_spec  # noqa: E402
from graphtrain.data import Dataset  # noqa: E402
from graphtrain.errors import ModelUnsupported  # noqa: E402
from graphtrain.peers import jax_functions as jax_cnn, jax_vmap  # noqa: E402
from graphtrain.plan import RunPlan  # noqa: E402
from graphtrain.recipe import normalise, recipe_of  # noqa: E402

GRID = ((0.01, 3), (0.006, 4))  # (lr, seed) of the two packed models
CPU = jax.devices("cpu")[0]
# the cnn's test set in chunks of 30 rows (4 chunks, the last padded by 20): the chunking checked
CNN_EVAL_FLOATS = 30 * len(GRID) * 24 * 24 * 24
# ‖out − ref‖ / ‖ref‖ of every parameter after the 10 float32 steps, by optimizer: against the
# float64 reference (measured: SGD 8e-8; Adam 1.1e-5 the cnn, 4.6e-6 the MLP: Adam divides each
# gradient by its own running size, which carries float32's error into every update), and against
# the same step alone, both float32, differing only in how XLA orders the sums (measured: SGD 1e-9;
# Adam 4.5e-6 the cnn, 4e-8 the MLP). A wrong rate, order or model shows at 1e-2 and more.
REFERENCE_BOUND = {"sgd": 1e-6, "adam": 1e-4}
ALONE_BOUND = {"sgd": 1e-7, "adam": 5e-5}


def random_pixels(seed: int = 5) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset.from_arrays(rng.random((300, 28, 28), np.float32), rng.permutation(np.arange(300) % 10),
                               rng.random((100, 28, 28), np.float32), rng.permutation(np.arange(100) % 10))


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ over every parameter at once, in float64."""
    out = np.concatenate([np.ravel(a).astype(np.float64) for a in out])
    ref = np.concatenate([np.ravel(a).astype(np.float64) for a in ref])
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def flat(layers) -> list[np.ndarray]:
    return [a for layer in layers for a in (layer.w, layer.b) if a is not None]


def pack(config: TrainConfig, data, device=CPU):
    """The plans of GRID's models of `config`, and their records trained as one pack on `device`
    (None: the GPU)."""
    plans = [RunPlan.for_data(config.replace(lr=lr, seed=seed), data) for lr, seed in GRID]
    return plans, jax_vmap.train_vmapped(plans, data, device=device)


@pytest.fixture(scope="module")
def data():
    return random_pixels()


@pytest.fixture(scope="module")
def cnn_pack(data):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax_vmap, "EVAL_FLOATS", CNN_EVAL_FLOATS)
        return pack(PRESETS["speedrun"].replace(batch=64, epochs=2, precision="fp32"), data)


MLP_RECIPES = {"sgd": dict(lr=0.1), "adam-one-cycle": dict(optimizer="adam", schedule="one-cycle", lr=0.01)}


@pytest.fixture(scope="module", params=list(MLP_RECIPES))
def mlp_pack(request, data):
    return pack(TrainConfig(hidden=(32,), batch=64, epochs=2, **MLP_RECIPES[request.param]), data)


def alone(plans, k: int, data) -> list[np.ndarray]:
    """Model k of the plans trained by itself: the pack's own step and epoch, jitted without vmap."""
    model = jax_vmap.pack_model(plans, data)
    plan = plans[k]
    recipe = recipe_of(plan.config, sum(plan.batches), plan.num_epochs)
    epoch = jax.jit(jax_vmap.model_epoch(jax_vmap.recipe_step(model, recipe)))
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a[k]), model.params)
    state = (params, jax_cnn.init_slots(recipe.optimizer, params))
    x, y = jnp.asarray(model.train_x), jnp.asarray(data.train_labels.astype(np.int32))
    with jax.default_matmul_precision("highest"):
        for e in range(plan.num_epochs):
            full_idx, tail_idx = jax_vmap.epoch_indices(plans, e)
            state = epoch(state, jnp.float32(plan.config.lr), jnp.int32(sum(plan.batches[:e])),
                          None if full_idx is None else full_idx[k], None if tail_idx is None else tail_idx[k], x, y)[0]
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(state[0])]


def reference_run(plan, data):
    """Plan's model trained by graphtrain's float64 NumPy reference with its recipe: (the
    parameters, each epoch's mean loss); the cnn on the normalised images."""
    cfg = plan.config
    recipe = recipe_of(cfg, sum(plan.batches), plan.num_epochs)
    cnn = cfg.model == "cnn"
    images = (normalise(data.train_images) if cnn else data.train_images).astype(np.float64)
    layers = [layer.copy(np.float64) for layer in plan.initial]
    params = flat(layers) if cnn else reference.parameters(layers)
    state, t, losses = recipe.optimizer.init_state(params), 0, []

    def update(layers, grads, lr):  # the MLP's: the recipe's optimizer at step t (1-based)
        recipe.optimizer.step(reference.parameters(layers), reference.parameters(grads), state, t, lr)

    for epoch in range(plan.num_epochs):
        loss_sum = 0.0
        for lo, hi in plan.epoch_bounds(epoch):
            idx, lr = plan.orders[epoch][lo:hi], recipe.schedule.at(t)
            t += 1
            if cnn:
                loss = reference_cnn.train_step(cnn_spec(cfg), params, images[idx], data.train_labels[idx],
                                                recipe.optimizer, state, t, lr) * (hi - lo)
            else:
                loss = reference.train_step(layers, images[idx], data.train_labels[idx], lr, update)[0]
            loss_sum += loss
        losses.append(loss_sum / plan.samples_seen(plan.batches[epoch]))
    return params, losses


def check_against_alone(plans, records, data) -> None:
    """Each packed model's weights against the same model trained alone by the same step."""
    for k, (plan, record) in enumerate(zip(plans, records)):
        where = f"{plan.config.model} {plan.config.optimizer} lr {plan.config.lr} seed {plan.config.seed}"
        err = rel_err(flat(record.params), alone(plans, k, data))
        assert err < ALONE_BOUND[plan.config.optimizer], f"{where}: packed vs alone, relative error {err:.2e}"


def check_against_reference(plans, records, data) -> None:
    """Each packed model's weights and epoch losses against the float64 reference's, and its test
    accuracy (counted in chunks) against the reference's count on the same weights."""
    for plan, record in zip(plans, records):
        where = f"{plan.config.model} {plan.config.optimizer} lr {plan.config.lr} seed {plan.config.seed}"
        params, losses = reference_run(plan, data)
        err = rel_err(flat(record.params), params)
        assert err < REFERENCE_BOUND[plan.config.optimizer], f"{where}: relative error {err:.2e} against float64"
        assert [e.train_loss for e in record.epochs] == pytest.approx(losses, rel=1e-5), where
        weights = [a.astype(np.float64) for a in flat(record.params)]
        if plan.config.model == "cnn":
            expected = reference_cnn.accuracy(cnn_spec(plan.config), weights, normalise(data.test_images),
                                              data.test_labels)
        else:
            expected = reference.accuracy([layer.copy(np.float64) for layer in record.params], data.test_images,
                                          data.test_labels)
        assert record.test_accuracy == expected, where


def test_each_packed_cnn_equals_the_same_step_alone(cnn_pack, data):
    check_against_alone(*cnn_pack, data)


def test_each_packed_cnn_follows_the_float64_reference(cnn_pack, data):
    """Adam (betas 0.7, 0.9) at the one-cycle rate over 10 steps, the tail batches included, each
    model from its own initial weights in its own order; the test set counted in 4 chunks."""
    plans, records = cnn_pack
    assert {record.precision for record in records} == {"fp32"}
    check_against_reference(plans, records, data)
    pack = records[0].pack
    assert pack["models"] == 2 and 0 < pack["compile_ms"] < pack["setup_ms"]


def test_each_packed_mlp_equals_its_step_alone_and_the_float64_reference(mlp_pack, data):
    plans, records = mlp_pack
    assert {record.precision for record in records} == {"fp32"}
    check_against_alone(plans, records, data)
    check_against_reference(plans, records, data)


@pytest.mark.parametrize("config, why", [
    (PRESETS["speedrun"].replace(batch=64, precision="bf16"),
     "jax-vmap trains the cnn in tf32 or fp32, not --precision bf16"),
    (TrainConfig(hidden=(8,), batch=64, precision="tf32"),
     "jax-vmap trains the MLP in fp32 or bf16, not --precision tf32"),
])
def test_a_precision_it_does_not_train_in_is_refused_before_any_work(config, why, data):
    plans = [RunPlan.for_data(config.replace(lr=lr, seed=seed), data) for lr, seed in GRID]
    with pytest.raises(ModelUnsupported, match=f"^{why}$"):
        jax_vmap.train_vmapped(plans, data, device=CPU)


def test_a_pack_of_models_differing_in_more_than_lr_and_seed_is_a_bug(data):
    plans = [RunPlan.for_data(TrainConfig(hidden=(h,), batch=64), data) for h in (8, 16)]
    with pytest.raises(ValueError, match="share everything but the learning rate and the seed"):
        jax_vmap.train_vmapped(plans, data, device=CPU)


def test_the_default_precisions_are_the_graphs_rows():
    """The cnn packs at TF32 as the graphs rung trains it by default, the MLP at fp32 ("highest")."""
    from graphtrain import stages

    data = random_pixels()
    cnn = [RunPlan.for_data(PRESETS["speedrun"].replace(batch=64, seed=s), data) for s in (0, 1)]
    mlp = [RunPlan.for_data(TrainConfig(hidden=(8,), batch=64, seed=s), data) for s in (0, 1)]
    assert jax_vmap.pack_model(cnn, data).precision == stages.SPECS["graphs"].cnn.precisions[0] == "tf32"
    assert jax_vmap.pack_model(mlp, data).precision == stages.SPECS["graphs"].mlp.precisions[0] == "fp32"
    assert jax_vmap.MATMUL_PRECISION["tf32"] == "tensorfloat32"


def test_the_sweep_command_packs_the_cnns_beside_the_numpy_rung(tmp_path, monkeypatch, data):
    """`sweep --preset speedrun --peer jax-vmap` end to end, jax's CPU standing in for the GPU: one
    pack of both models, from the numpy rows' initial weights in their order (the epoch's losses
    agree), its line under the table giving XLA's compile apart."""
    import json

    from test_cli import invoke

    from graphtrain.peers import jax_scan

    monkeypatch.setattr(jax_scan, "import_jax", lambda: (jax, CPU))
    path = tmp_path / "pixels.npz"
    np.savez(path, x_train=data.train_images.reshape(-1, 28, 28), y_train=data.train_labels,
             x_test=data.test_images.reshape(-1, 28, 28), y_test=data.test_labels)
    result = invoke("sweep", "--preset", "speedrun", "--data", str(path), "--batch", "64", "--lrs", "0.006,0.01",
                    "--stages", "numpy", "--peer", "jax-vmap", "--json", str(tmp_path / "grid.json"))
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "grid.json").read_text())["records"]
    assert [(r["stage"], r["config"]["lr"]) for r in rows] == [
        ("numpy", 0.006), ("jax-vmap", 0.006), ("numpy", 0.01), ("jax-vmap", 0.01)]
    assert all("error" not in r for r in rows), rows
    numpy_rows, vmapped = rows[0::2], rows[1::2]
    assert [r["packed"]["models"] for r in vmapped] == [2, 2] and {r["precision"] for r in vmapped} == {"tf32"}
    for mine, theirs in zip(vmapped, numpy_rows):
        assert mine["epochs"][0]["train_loss"] == pytest.approx(theirs["epochs"][0]["train_loss"], rel=1e-5)
    assert "of them XLA's compile" in " ".join(result.output.split())
