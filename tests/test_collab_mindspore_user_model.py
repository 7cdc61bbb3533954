"""MindSpore centers for the user's own model: the torch ↔ MindSpore map inferred and checked on a forward pass.

The models are defined here and referenced as ``tests.test_collab_mindspore_user_model:NAME``: a CNN with
BatchNorm written in torch as one ``nn.Sequential`` (names ``body.0``, ``body.1``, ...) and in MindSpore as
a cell with its own attribute names (``conv1``, ``bn1``, ...) whose first dense layer keeps its matrix
``[in, out]`` for ``x @ W`` — so the map comes from order, shapes and the transposed layout, not from names.
Wrong MindSpore builders (a missing layer, two same-shape layers registered in the other order, another
kernel size, another BatchNorm momentum) must fail with one line naming the tensor to fix.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore centers need mindspore==2.10.0")
torch = pytest.importorskip("torch")

from mindspore import Parameter, nn, ops  # noqa: E402
from torch import nn as tnn  # noqa: E402

from polyparallel.backends.collab import (  # noqa: E402
    CenterSpec,
    CollabConfig,
    ModelSpec,
    TorchTrainer,
    build_torch_model,
    load_torch_state,
    run_inprocess,
)
from polyparallel.backends.collab._mindspore import (  # noqa: E402  # noqa: E402
    MindSporeTrainer,
    build_mindspore_model,
    load_mindspore_state,
    parameter_map,
    torch_to_mindspore,
    verify_mindspore_map,
)
from polyparallel.backends.collab._models import torch_state  # noqa: E402
from tests.test_collab_mindspore import _perturbed_state  # noqa: E402

HERE = "tests.test_collab_mindspore_user_model"


# ------------------------------------------------------------------------------------------ models
class TorchCNN(tnn.Module):
    """conv 3×3 → BN → ReLU → conv 3×3 → BN → ReLU → max-pool 2 → Linear 128→16 → two Linear 16→16 → Linear 16→4."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def torch_cnn() -> tnn.Module:
    return TorchCNN()


def _body() -> tnn.Sequential:
    return tnn.Sequential(
        tnn.Conv2d(1, 8, 3, padding=1, bias=False), tnn.BatchNorm2d(8), tnn.ReLU(),           # body.0, .1
        tnn.Conv2d(8, 8, 3, padding=1), tnn.BatchNorm2d(8), tnn.ReLU(), tnn.MaxPool2d(2),     # body.3, .4
        tnn.Flatten(), tnn.Linear(128, 16), tnn.ReLU(),                                        # body.8
        tnn.Linear(16, 16), tnn.ReLU(), tnn.Linear(16, 16), tnn.ReLU(),                       # body.10, .12
        tnn.Linear(16, 4))                                                                     # body.14


class XW(nn.Cell):
    """A dense layer kept as ``x @ w + b`` with ``w`` of shape ``[in, out]`` (torch's Linear is ``[out, in]``)."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.w = Parameter(ms.Tensor(np.zeros((i, o), np.float32)), name="w")
        self.b = Parameter(ms.Tensor(np.zeros(o, np.float32)), name="b")

    def construct(self, x):
        return ops.matmul(x, self.w) + self.b


class MsCNN(nn.Cell):
    def __init__(self, missing_bn: bool = False, swap: bool = False, kernel: int = 3, momentum: float = 0.9) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, pad_mode="pad", padding=1, has_bias=False)
        self.bn1 = nn.BatchNorm2d(8, eps=1e-5, momentum=momentum)
        self.conv2 = nn.Conv2d(8, 8, kernel, pad_mode="pad", padding=kernel // 2, has_bias=True)
        self.bn2 = None if missing_bn else nn.BatchNorm2d(8, eps=1e-5, momentum=momentum)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.fc1 = XW(128, 16)
        if swap:  # registered in the other order, applied in the same one: shapes cannot tell
            self.mid2, self.mid1 = nn.Dense(16, 16), nn.Dense(16, 16)
        else:
            self.mid1, self.mid2 = nn.Dense(16, 16), nn.Dense(16, 16)
        self.out = nn.Dense(16, 4)

    def construct(self, x):
        x = self.conv2(ops.relu(self.bn1(self.conv1(x))))
        x = self.pool(ops.relu(x if self.bn2 is None else self.bn2(x)))
        x = ops.relu(self.fc1(x.reshape(x.shape[0], -1)))
        return self.out(ops.relu(self.mid2(ops.relu(self.mid1(x)))))


def ms_cnn() -> nn.Cell:
    return MsCNN()


def ms_missing_layer() -> nn.Cell:
    return MsCNN(missing_bn=True)


def ms_swapped() -> nn.Cell:
    return MsCNN(swap=True)


def ms_wrong_kernel() -> nn.Cell:
    return MsCNN(kernel=5)


def ms_wrong_momentum() -> nn.Cell:
    return MsCNN(momentum=0.1)


def not_a_cell() -> object:
    return torch_cnn()


SPEC = ModelSpec(f"{HERE}:torch_cnn", mindspore=f"{HERE}:ms_cnn")


def _data(n: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, n)


# ------------------------------------------------------------------------------------------ the map
#: the map the built-in kinds had written out by hand, layer by layer; the inferred map must equal it
HAND_WRITTEN = {
    "mlp": ["fc1.weight", "fc1.bias", ("norm.weight", "norm.gamma"), ("norm.bias", "norm.beta"), "fc2.weight",
            "fc2.bias"],
    "cnn": ["conv1.weight", "conv1.bias", ("bn1.weight", "bn1.gamma"), ("bn1.bias", "bn1.beta"),
            ("bn1.running_mean", "bn1.moving_mean"), ("bn1.running_var", "bn1.moving_variance"), "conv2.weight",
            "conv2.bias", ("bn2.weight", "bn2.gamma"), ("bn2.bias", "bn2.beta"),
            ("bn2.running_mean", "bn2.moving_mean"), ("bn2.running_var", "bn2.moving_variance"), "fc.weight",
            "fc.bias"],
    "embbag": [("emb.weight", "emb.embedding_table"), ("norm.weight", "norm.gamma"), ("norm.bias", "norm.beta"),
               "fc.weight", "fc.bias"],
}
BUILT_IN = {"mlp": ModelSpec("mlp", (6,), 3, hidden=8), "cnn": ModelSpec("cnn", (1, 8, 8), 4, hidden=4),
            "embbag": ModelSpec("embbag", (5,), 3, hidden=6, vocab=11)}


@pytest.mark.parametrize("kind", sorted(BUILT_IN))
def test_inferred_map_of_the_built_in_kinds_is_the_hand_written_one(kind):
    got = [(m.torch_name, m.ms_name, m.perm) for m in parameter_map(BUILT_IN[kind])]
    want = [(e, e, None) if isinstance(e, str) else (*e, None) for e in HAND_WRITTEN[kind]]
    assert got == want


def test_user_cnn_map_is_inferred_from_order_shapes_and_layout():
    m = {p.torch_name: p for p in parameter_map(SPEC)}
    assert list(m) == list(torch_state(build_torch_model(SPEC)))  # every exchanged tensor, torch order
    assert (m["body.1.weight"].ms_name, m["body.1.running_var"].ms_name) == ("bn1.gamma", "bn1.moving_variance")
    assert (m["body.4.bias"].ms_name, m["body.4.running_mean"].ms_name) == ("bn2.beta", "bn2.moving_mean")
    assert (m["body.8.weight"].ms_name, m["body.8.weight"].perm) == ("fc1.w", (1, 0))  # [out, in] -> [in, out]
    assert (m["body.10.weight"].ms_name, m["body.12.weight"].ms_name) == ("mid1.weight", "mid2.weight")
    assert all(p.perm is None for k, p in m.items() if k != "body.8.weight")


def test_user_cnn_gives_the_same_output_in_both_frameworks():
    """Independent of the center's check: perturbed parameters through the map, eval mode, one batch."""
    sd = _perturbed_state(SPEC, seed=3)
    tm = build_torch_model(SPEC)
    load_torch_state(tm, sd)
    tm.eval()
    cell = build_mindspore_model(SPEC)
    load_mindspore_state(cell, torch_to_mindspore(sd, parameter_map(SPEC)))
    cell.set_train(False)
    x, _ = _data(8)
    with torch.no_grad():
        want = tm(torch.from_numpy(x)).numpy()
    got = cell(ms.Tensor(x)).asnumpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    x, y = _data(8, seed=1)
    tm2 = build_torch_model(SPEC)
    err = verify_mindspore_map(SPEC, tm2, cell, parameter_map(SPEC, tm2, cell), x, y)
    assert err <= 1e-4


@pytest.mark.parametrize("builder, names", [
    ("ms_missing_layer", [r"torch 'body\.4\.weight' \(8,\) has no MindSpore parameter", r"'fc1\.w' \(128, 16\)"]),
    ("ms_wrong_kernel", [r"torch 'body\.3\.weight' \(8, 8, 3, 3\)", r"'conv2\.weight' \(8, 8, 5, 5\)",
                         r"dimension \[2, 3\]"]),
    ("ms_swapped", [r"first layer whose output differs is torch 'body\.10' \(Linear\) vs MindSpore 'mid2'",
                    r"body\.10\.weight -> mid2\.weight"]),
    ("ms_wrong_momentum", [r"MindSpore 'bn1' is built with momentum=0\.1, .* torch 'body\.1' has momentum 0\.1",
                           r"momentum=0\.9"]),
])
def test_a_wrong_mindspore_builder_is_refused_naming_the_tensor(builder, names):
    spec = ModelSpec(f"{HERE}:torch_cnn", mindspore=f"{HERE}:{builder}")
    x, y = _data()
    with pytest.raises(ValueError) as e:
        MindSporeTrainer(spec, x, y, batch_size=8)
    msg = str(e.value)
    assert "\n" not in msg and f"{HERE}:{builder}" in msg
    for pattern in names:
        assert re.search(pattern, msg), (pattern, msg)


def test_the_builder_reference_is_checked():
    with pytest.raises(TypeError, match=r"must return a mindspore\.nn\.Cell"):
        build_mindspore_model(ModelSpec(f"{HERE}:torch_cnn", mindspore=f"{HERE}:not_a_cell"))
    with pytest.raises(ValueError, match=r"package\.module:function"):
        ModelSpec(f"{HERE}:torch_cnn", mindspore="ms_cnn")
    with pytest.raises(ValueError, match="has its MindSpore model already"):
        ModelSpec("mlp", (4,), 2, mindspore=f"{HERE}:ms_cnn")
    with pytest.raises(ValueError, match=r"mindspore='package\.module:function'"):
        CollabConfig(centers=(CenterSpec("m", framework="mindspore"),), model=ModelSpec(f"{HERE}:torch_cnn"))
    cfg = CollabConfig(centers=(CenterSpec("t"), CenterSpec("m", framework="mindspore")), model=SPEC)
    assert CollabConfig.from_json(cfg.to_json()).model == SPEC  # the reference travels in the job


# ------------------------------------------------------------------------------------------ training
def test_round_one_update_equals_torch():
    """Three SGD steps with momentum and a FedProx term, train-mode BatchNorm, from the same start."""
    x, y = _data()
    sd = _perturbed_state(SPEC, seed=3)
    kw = dict(batch_size=8, lr=0.1, momentum=0.5)
    p_ms, m_ms = MindSporeTrainer(SPEC, x, y, **kw).train(sd, steps=3, round_idx=1, proximal_mu=0.1)
    p_t, m_t = TorchTrainer(SPEC, x, y, **kw).train(sd, steps=3, round_idx=1, proximal_mu=0.1)
    assert abs(m_ms["train_loss"] - m_t["train_loss"]) < 1e-5
    # body.3's bias feeds a train-mode BatchNorm, which subtracts the batch mean: its gradient is zero
    # exactly (any update it shows is rounding), so only the other parameters must have moved
    still = {"body.3.bias"}
    for k in sd:
        upd_ms, upd_t = p_ms[k] - sd[k], p_t[k] - sd[k]
        assert k in still or np.abs(upd_t).max() > 0, k
        np.testing.assert_allclose(upd_ms, upd_t, atol=1e-5, rtol=1e-4, err_msg=k)


def test_mixed_federation_with_the_user_model_matches_all_torch():
    """One torch and one MindSpore center, 2 rounds × 3 steps, with held-out evaluation at each center.

    Tolerance 1e-4 (abs and rel) on the fused parameters, as the built-in cnn's mixed federation in
    test_collab_mindspore: the two frameworks' float32 kernels differ by rounding (~1e-6 per step),
    not by the computation; over a full Fashion-MNIST run that rounding moved accuracy 86.40% vs 86.25%.
    """
    data = {"t": _data(32, seed=5), "m": _data(32, seed=6)}
    kw = dict(model=SPEC, rounds=2, local_steps=3, batch_size=8, lr=0.05, holdout=0.25)
    a = run_inprocess(CollabConfig(centers=(CenterSpec("t"), CenterSpec("m", framework="mindspore")), **kw), data)
    b = run_inprocess(CollabConfig(centers=(CenterSpec("t"), CenterSpec("m")), **kw), data)
    assert [r.accepted for r in a.rounds] == [("t", "m"), ("t", "m")]
    for k in b.params:
        np.testing.assert_allclose(a.params[k], b.params[k], atol=1e-4, rtol=1e-4, err_msg=k)
    for ra, rb in zip(a.rounds, b.rounds):
        assert ra.eval["count"] == rb.eval["count"] == 16
        assert abs(ra.eval["loss"] - rb.eval["loss"]) < 1e-4 and ra.eval["accuracy"] == rb.eval["accuracy"]


# ------------------------------------------------------------------------------------------ CLI
def center_data(center: str) -> tuple[np.ndarray, np.ndarray]:
    """Each center's rows, loaded at the center (``--data MODULE:FUNCTION``)."""
    return _data(32, seed={"t": 5, "m": 6}[center])


def test_cli_trains_the_user_model_on_a_mindspore_center_as_the_api_does(tmp_path, capsys):
    from tests.test_collab_cli import _run as _cli

    argv = ["collab", "--centers", "t,m", "--frameworks", "torch,mindspore", "--model", f"{HERE}:torch_cnn",
            "--data", f"{HERE}:center_data", "--holdout", "0.25", "--rounds", "2", "-H", "3", "--batch-size", "8",
            "--lr", "0.05"]
    code, _, err = _cli([*argv, "--mindspore-model", f"{HERE}:ms_cnn", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    ref = run_inprocess(CollabConfig(centers=(CenterSpec("t", data=f"{HERE}:center_data"),
                                              CenterSpec("m", framework="mindspore", data=f"{HERE}:center_data")),
                                     model=SPEC, rounds=2, local_steps=3, batch_size=8, lr=0.05, holdout=0.25))
    with np.load(tmp_path / "final.npz") as z:
        for k, v in ref.params.items():
            np.testing.assert_array_equal(z[k], v)
    code, _, err = _cli([*argv, "--mindspore-model", f"{HERE}:ms_wrong_kernel"], capsys)
    assert code == 2 and "torch 'body.3.weight' (8, 8, 3, 3)" in err and "Traceback" not in err
    code, _, err = _cli(argv, capsys)
    assert code == 2 and "--mindspore-model" in err


def test_flower_with_a_mindspore_center_fuses_what_the_inprocess_engine_fuses(tmp_path):
    """Every SuperNode imports both builders from the job's references and infers and checks the map itself."""
    pytest.importorskip("flwr")
    from polyparallel.backends.collab._flower import run_flower

    cfg = CollabConfig(centers=(CenterSpec("t", data=f"{HERE}:center_data"),
                                CenterSpec("m", framework="mindspore", data=f"{HERE}:center_data")),
                       model=SPEC, rounds=2, local_steps=3, batch_size=8, lr=0.05, holdout=0.25)
    res = run_flower(cfg, workdir=tmp_path, timeout_s=200)
    ref = run_inprocess(cfg)
    assert [r.accepted for r in res.rounds] == [("t", "m")] * 2
    for k, v in ref.params.items():
        np.testing.assert_array_equal(res.params[k], v, err_msg=k)
    assert [r.eval for r in res.rounds] == [r.eval for r in ref.rounds]
