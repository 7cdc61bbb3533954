"""MindSpore centers: the torch <-> MindSpore parameter map, forward and training equivalence, mixed federations."""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore centers need mindspore==2.10.0")
torch = pytest.importorskip("torch")

from polyparallel.backends.collab import (  # noqa: E402
    CenterSpec,
    CollabConfig,
    ModelSpec,
    TorchTrainer,
    build_torch_model,
    load_torch_state,
    run_inprocess,
)
from polyparallel.backends.collab._mindspore import (  # noqa: E402
    MindSporeTrainer,
    build_mindspore_model,
    load_mindspore_state,
    mindspore_state,
    mindspore_to_torch,
    parameter_map,
    torch_to_mindspore,
)
from tests.collab_fixtures import perturbed_state  # noqa: E402

SPECS = {
    "mlp": ModelSpec("mlp", (6,), 3, hidden=8),                     # Linear, LayerNorm
    "cnn": ModelSpec("cnn", (1, 8, 8), 4, hidden=4),                # Conv2d, BatchNorm2d (+ moving stats), Linear
    "embbag": ModelSpec("embbag", (5,), 3, hidden=6, vocab=11),     # Embedding, LayerNorm, Linear
}


_perturbed_state = perturbed_state  # torch state with non-default values everywhere, so the map is tested


def _inputs(spec, n=4, seed=1):
    rng = np.random.default_rng(seed)
    if spec.kind == "embbag":
        return rng.integers(0, spec.vocab, size=(n, *spec.in_shape)).astype(np.float32)
    return rng.normal(size=(n, *spec.in_shape)).astype(np.float32)


def test_the_map_names_every_layer_type():
    got = {(m.layer, m.torch_name.rsplit(".", 1)[1], m.ms_name.rsplit(".", 1)[1])
           for s in SPECS.values() for m in parameter_map(s)}
    assert {("Linear", "weight", "weight"), ("Conv2d", "bias", "bias"), ("BatchNorm2d", "weight", "gamma"),
            ("BatchNorm2d", "running_mean", "moving_mean"), ("BatchNorm2d", "running_var", "moving_variance"),
            ("LayerNorm", "bias", "beta"), ("Embedding", "weight", "embedding_table")} <= got


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_round_trip_torch_mindspore_torch_is_exact(kind):
    spec = SPECS[kind]
    sd = _perturbed_state(spec)
    mapping = parameter_map(spec)
    cell = build_mindspore_model(spec)
    load_mindspore_state(cell, torch_to_mindspore(sd, mapping))
    assert set(mindspore_state(cell)) == {m.ms_name for m in mapping}  # nothing unmapped on either side
    back = mindspore_to_torch(mindspore_state(cell), mapping)
    assert set(back) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k])
        assert back[k].dtype == np.float32


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_same_forward_output(kind):
    spec = SPECS[kind]
    sd = _perturbed_state(spec)
    tm = build_torch_model(spec)
    load_torch_state(tm, sd)
    tm.eval()
    cell = build_mindspore_model(spec)
    load_mindspore_state(cell, torch_to_mindspore(sd, parameter_map(spec)))
    cell.set_train(False)
    x = _inputs(spec)
    with torch.no_grad():
        want = tm(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(cell(ms.Tensor(x)).asnumpy(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tau", [0.0, 1.0])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_local_training_agrees_across_frameworks(kind, tau):
    """Two SGD steps (train-mode BatchNorm, FedProx term; with tau > 0 the logit-adjusted loss of skewed
    labels with a class missing) in each framework from the same start."""
    spec = SPECS[kind]
    sd = _perturbed_state(spec)
    x = _inputs(spec, n=8)
    y = np.random.default_rng(2).integers(0, spec.num_classes - (tau > 0), 8)
    kw = dict(batch_size=4, lr=0.1, momentum=0.5, logit_adjust=tau)
    p_ms, m_ms = MindSporeTrainer(spec, x, y, **kw).train(sd, steps=2, round_idx=1, proximal_mu=0.1)
    p_t, m_t = TorchTrainer(spec, x, y, **kw).train(sd, steps=2, round_idx=1, proximal_mu=0.1)
    assert abs(m_ms["train_loss"] - m_t["train_loss"]) < 1e-5
    for k in sd:
        np.testing.assert_allclose(p_ms[k], p_t[k], atol=2e-5, rtol=1e-4, err_msg=k)
        assert not np.array_equal(p_t[k], sd[k]) or "running" in k or k.endswith("emb.weight")


def test_mixed_federation_in_process_matches_all_torch():
    spec = SPECS["cnn"]
    rng = np.random.default_rng(5)
    data = {c: (rng.normal(size=(24, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, 24)) for c in ("t", "m")}
    kw = dict(model=spec, rounds=2, local_steps=3, batch_size=8, lr=0.05, fusion="fedavg")
    mixed = CollabConfig(centers=(CenterSpec("t"), CenterSpec("m", framework="mindspore")), **kw)
    torch_only = CollabConfig(centers=(CenterSpec("t"), CenterSpec("m")), **kw)
    a = run_inprocess(mixed, data)
    b = run_inprocess(torch_only, data)
    assert [r.accepted for r in a.rounds] == [("t", "m"), ("t", "m")]
    for k in b.params:
        np.testing.assert_allclose(a.params[k], b.params[k], atol=1e-4, rtol=1e-4, err_msg=k)


def test_missing_parameters_are_named():
    mapping = parameter_map(SPECS["mlp"])
    with pytest.raises(KeyError, match=r"fc2\.bias"):
        torch_to_mindspore({m.torch_name: np.zeros(1) for m in mapping if m.torch_name != "fc2.bias"}, mapping)
