"""PaddlePaddle and TensorFlow centers: the inferred parameter map, checked against torch on the same weights,
local training against torch's, the user's model given once per framework, and mixed federations.

Paddle and TensorFlow share a process with MindSpore only when imported in the order torch, mindspore,
paddle, tensorflow, so the fixture below imports what is installed in that order before any test here
runs (collection imports none of them). The user's models are defined here and referenced as
``tests.test_collab_paddle_tf:NAME``: a torch ``nn.Sequential`` (names ``0``, ``1``, ...), a Paddle layer
with its own attribute names, and a Keras ``Sequential`` that permutes NCHW rows to channels-last and back.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyparallel.backends.collab import (  # noqa: E402
    CenterSpec,
    CollabConfig,
    ModelSpec,
    TorchTrainer,
    build_torch_model,
    load_torch_state,
    run_inprocess,
    torch_state,
)
from tests.collab_fixtures import perturbed_state  # noqa: E402

HAVE = {fw: importlib.util.find_spec(m) is not None
        for fw, m in (("mindspore", "mindspore"), ("paddle", "paddle"), ("tensorflow", "tensorflow"))}
_REQ = {"paddle": "paddlepaddle==3.3.1", "tensorflow": "tensorflow-cpu==2.21.0"}
FRAMEWORKS = [pytest.param(fw, marks=pytest.mark.skipif(not HAVE[fw], reason=f"{fw} centers need {_REQ[fw]} (pip "
                                                         "install 'polyparallel[paddle,tensorflow]')"))
              for fw in ("paddle", "tensorflow")]
ALL_FOUR = pytest.mark.skipif(not all(HAVE.values()), reason="needs mindspore, paddlepaddle and tensorflow-cpu: "
                              "pip install 'polyparallel[mindspore,paddle,tensorflow]' -c constraints.txt")
HERE = "tests.test_collab_paddle_tf"
SPECS = {
    "mlp": ModelSpec("mlp", (6,), 3, hidden=8),                     # Linear, LayerNorm
    "cnn": ModelSpec("cnn", (1, 8, 8), 4, hidden=4),                # Conv2d, BatchNorm2d (+ statistics), Linear
    "embbag": ModelSpec("embbag", (5,), 3, hidden=6, vocab=11),     # Embedding, LayerNorm, Linear
}


@pytest.fixture(scope="module", autouse=True)
def _frameworks():
    from polyparallel.backends.collab._foreign import import_frameworks

    import_frameworks([fw for fw, ok in HAVE.items() if ok])


def _inputs(spec, n=4, seed=1):
    rng = np.random.default_rng(seed)
    if spec.kind == "embbag":
        return rng.integers(0, spec.vocab, size=(n, *spec.in_shape)).astype(np.float32)
    return rng.normal(size=(n, *spec.in_shape)).astype(np.float32)


def _torch_out(spec, sd, x):
    tm = build_torch_model(spec)
    load_torch_state(tm, sd)
    tm.eval()
    with torch.no_grad():
        return tm(torch.from_numpy(x)).numpy()


# ------------------------------------------------------------------------------------------ the map
WANT = {  # (torch leaf, paddle leaf, paddle perm, keras leaf, keras perm) per layer type
    "Linear": {"weight": ("weight", (1, 0), "kernel", (1, 0)), "bias": ("bias", None, "bias", None)},
    "Conv2d": {"weight": ("weight", None, "kernel", (2, 3, 1, 0)), "bias": ("bias", None, "bias", None)},
    "BatchNorm2d": {"weight": ("weight", None, "gamma", None), "bias": ("bias", None, "beta", None),
                    "running_mean": ("_mean", None, "moving_mean", None),
                    "running_var": ("_variance", None, "moving_variance", None)},
    "LayerNorm": {"weight": ("weight", None, "gamma", None), "bias": ("bias", None, "beta", None)},
    "Embedding": {"weight": ("weight", None, "embeddings", None)},
}


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_the_inferred_map_of_the_built_in_kinds(fw, kind):
    from polyparallel.backends.collab._foreign import parameter_map

    spec = SPECS[kind]
    got = parameter_map(spec, fw, sample=_inputs(spec, 1))
    assert [m.torch_name for m in got] == list(torch_state(build_torch_model(spec)))
    col = 0 if fw == "paddle" else 2
    for m in got:
        leaf, perm = WANT[m.layer][m.torch_name.rsplit(".", 1)[1]][col:col + 2]
        assert (m.ms_name, m.perm) == (f"{m.torch_path}.{leaf}", perm), m


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_same_weights_same_output_as_torch(fw, kind):
    """Perturbed torch weights through the map; eval-mode outputs equal torch's (independent of the
    center's own check); the round trip back to torch names is exact."""
    from polyparallel.backends.collab._foreign import build_foreign_model, framework, parameter_map
    from polyparallel.backends.collab._param_map import apply_map, invert_map

    spec = SPECS[kind]
    sd = perturbed_state(spec)
    x = _inputs(spec)
    f = framework(fw)
    model = build_foreign_model(spec, fw, sample=x)
    mapping = parameter_map(spec, fw, model=model)
    f.load(model, apply_map(sd, mapping))
    assert set(f.state(model)) == {m.ms_name for m in mapping}  # nothing unmapped on either side
    np.testing.assert_allclose(f.forward(model, x), _torch_out(spec, sd, x), atol=1e-5, rtol=1e-5)
    back = invert_map(f.state(model), mapping)
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k])


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_local_training_agrees_with_torch(fw, kind):
    """Two SGD steps with momentum, a FedProx term and the logit-adjusted loss, train-mode BatchNorm, from the
    same start (the running variances too: Paddle and Keras blend in the biased batch variance, which the
    center corrects to torch's unbiased one after each step)."""
    from polyparallel.backends.collab._foreign import ForeignTrainer

    spec = SPECS[kind]
    sd = perturbed_state(spec)
    x = _inputs(spec, n=8)
    y = np.random.default_rng(2).integers(0, spec.num_classes - 1, 8)
    kw = dict(batch_size=4, lr=0.1, momentum=0.5, logit_adjust=1.0)
    tr = ForeignTrainer(spec, x, y, framework=fw, **kw)
    assert tr.verify_error <= 1e-5
    p_f, m_f = tr.train(sd, steps=2, round_idx=1, proximal_mu=0.1)
    p_t, m_t = TorchTrainer(spec, x, y, **kw).train(sd, steps=2, round_idx=1, proximal_mu=0.1)
    assert abs(m_f["train_loss"] - m_t["train_loss"]) < 1e-5
    for k in sd:
        np.testing.assert_allclose(p_f[k], p_t[k], atol=2e-5, rtol=1e-4, err_msg=k)
        # the conv biases feed a train-mode BatchNorm: their gradient is zero, any update rounding
        assert not np.array_equal(p_t[k], sd[k]) or "running" in k or k.endswith(("emb.weight", "conv1.bias",
                                                                                    "conv2.bias")), k
    ev_f, ev_t = tr.evaluate(sd, x, y), TorchTrainer(spec, x, y, **kw).evaluate(sd, x, y)
    assert abs(ev_f["loss"] - ev_t["loss"]) < 1e-5 and ev_f["accuracy"] == ev_t["accuracy"]


# ------------------------------------------------------------------------------------------ user models
def torch_digits():
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 10))


def _paddle_digits(kernel=3, momentum=0.9):
    from paddle import nn

    class Digits(nn.Layer):  # its own names: order and shapes decide the map
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2D(1, 8, kernel, padding=kernel // 2)
            self.n1 = nn.BatchNorm2D(8, momentum=momentum, epsilon=1e-5)
            self.d1 = nn.Linear(8 * 4 * 4, 16)
            self.d2 = nn.Linear(16, 10)

        def forward(self, x):
            x = nn.functional.max_pool2d(nn.functional.relu(self.n1(self.c1(x))), 2)
            return self.d2(nn.functional.relu(self.d1(x.flatten(1))))

    return Digits()


def paddle_digits():
    return _paddle_digits()


def paddle_wrong_kernel():
    return _paddle_digits(kernel=5)


def paddle_wrong_momentum():
    return _paddle_digits(momentum=0.1)


def _keras_digits(back_to_nchw=True):
    import keras
    from keras import layers

    return keras.Sequential([keras.Input((1, 8, 8)), layers.Permute((2, 3, 1)), layers.Conv2D(8, 3, padding="same"),
                             layers.BatchNormalization(momentum=0.9, epsilon=1e-5), layers.ReLU(),
                             layers.MaxPooling2D(2), *([layers.Permute((3, 1, 2))] if back_to_nchw else []),
                             layers.Flatten(), layers.Dense(16), layers.ReLU(), layers.Dense(10)])


def keras_digits():
    return _keras_digits()


def keras_channels_last_flatten():
    return _keras_digits(back_to_nchw=False)


def ms_digits():
    from mindspore import nn, ops

    class Digits(nn.Cell):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 8, 3, pad_mode="pad", padding=1, has_bias=True)
            self.bn = nn.BatchNorm2d(8, eps=1e-5, momentum=0.9)
            self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
            self.fc1 = nn.Dense(8 * 4 * 4, 16)
            self.fc2 = nn.Dense(16, 10)

        def construct(self, x):
            x = self.pool(ops.relu(self.bn(self.conv(x))))
            return self.fc2(ops.relu(self.fc1(x.reshape(x.shape[0], -1))))

    return Digits()


BUILDERS = {"mindspore": f"{HERE}:ms_digits", "paddle": f"{HERE}:paddle_digits", "tensorflow": f"{HERE}:keras_digits"}
USER = ModelSpec(f"{HERE}:torch_digits", loss="cross_entropy", builders=BUILDERS)


def digits(n=None, seed=0):
    """scikit-learn's 8x8 digits as (N, 1, 8, 8) float32 in [0, 1], int64 labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.images / 16.0).astype(np.float32)[:, None], d.target.astype(np.int64)
    idx = np.random.default_rng(seed).permutation(len(y))[:n]
    return x[idx], y[idx]


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_user_model_map_is_inferred_and_reproduces_torch(fw):
    from polyparallel.backends.collab._foreign import ForeignTrainer, build_foreign_model, framework, parameter_map
    from polyparallel.backends.collab._param_map import apply_map

    x, y = digits(16)
    m = {p.torch_name: p for p in parameter_map(USER, fw, sample=x)}
    assert list(m) == list(torch_state(build_torch_model(USER)))
    if fw == "paddle":
        assert (m["0.weight"].ms_name, m["1.running_var"].ms_name, m["5.weight"].perm) == \
            ("c1.weight", "n1._variance", (1, 0))
    else:  # Sequential without the Input layer: Permute 0, Conv2D 1, BatchNorm 2, ..., Dense 7 and 9
        assert (m["0.weight"].ms_name, m["0.weight"].perm, m["1.running_var"].ms_name, m["7.weight"].ms_name) == \
            ("1.kernel", (2, 3, 1, 0), "2.moving_variance", "9.kernel")
    sd = perturbed_state(USER, seed=3)
    model = build_foreign_model(USER, fw, sample=x)
    framework(fw).load(model, apply_map(sd, tuple(m.values())))
    np.testing.assert_allclose(framework(fw).forward(model, x), _torch_out(USER, sd, x), atol=1e-5, rtol=1e-5)
    assert ForeignTrainer(USER, x, y, framework=fw, batch_size=8).verify_error <= 1e-5


@pytest.mark.parametrize("fw, builder, patterns", [
    pytest.param("paddle", "paddle_wrong_kernel", [r"torch '0\.weight' \(8, 1, 3, 3\)", r"'c1\.weight' \(8, 1, 5, 5\)",
                                                   r"dimension \[2, 3\]"], marks=FRAMEWORKS[0].marks),
    pytest.param("paddle", "paddle_wrong_momentum", [r"PaddlePaddle 'n1' is built with momentum=0\.1",
                                                     r"momentum=0\.9"], marks=FRAMEWORKS[0].marks),
    pytest.param("tensorflow", "keras_channels_last_flatten",
                 [r"first layer whose output differs is torch '5' \(Linear\) vs TensorFlow '6'",
                  r"5\.weight -> 6\.kernel \(transposed \(1, 0\)\)"], marks=FRAMEWORKS[1].marks),
])
def test_a_wrong_builder_is_refused_naming_the_tensor(fw, builder, patterns):
    from polyparallel.backends.collab._foreign import ForeignTrainer

    spec = ModelSpec(f"{HERE}:torch_digits", builders={fw: f"{HERE}:{builder}"})
    x, y = digits(16)
    with pytest.raises(ValueError) as e:
        ForeignTrainer(spec, x, y, framework=fw, batch_size=8)
    msg = str(e.value)
    assert "\n" not in msg and f"{HERE}:{builder}" in msg
    for p in patterns:
        assert re.search(p, msg), (p, msg)


def test_builders_travel_in_the_job_and_are_required():
    cfg = CollabConfig(centers=(CenterSpec("t"), CenterSpec("p", framework="paddle")), model=USER)
    assert CollabConfig.from_json(cfg.to_json()).model == USER
    assert USER.mindspore == BUILDERS["mindspore"] and USER.builder_for("tensorflow") == BUILDERS["tensorflow"]
    with pytest.raises(ValueError, match=r"--builder paddle=MODULE:FUNCTION"):
        CollabConfig(centers=(CenterSpec("p", framework="paddle"),), model=ModelSpec(f"{HERE}:torch_digits"))
    with pytest.raises(ValueError, match="one of"):
        ModelSpec(f"{HERE}:torch_digits", builders={"jax": f"{HERE}:x"})
    with pytest.raises(ValueError, match="has its model in every framework"):
        ModelSpec("mlp", (4,), 2, builders={"paddle": f"{HERE}:paddle_digits"})
    # a job without builders writes the JSON it wrote before they existed
    assert "builders" not in CollabConfig(centers=(CenterSpec("t"),), model=SPECS["mlp"]).to_json()


# ------------------------------------------------------------------------------------------ federations
def _max_rel(a, b, keys):
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-12)) for k in keys)


@pytest.mark.slow
@ALL_FOUR
def test_four_framework_federation_matches_all_torch():
    """One center per framework, every center on the same digits rows (so all start equal and train on the same
    data): after one round the fused model equals the all-torch federation's within float32 rounding, the
    BatchNorm statistics included. After three rounds the accuracy on held-out digits is within 1 point."""
    x, y = digits()
    xtr, ytr, xte, yte = x[:1400], y[:1400], x[1400:], y[1400:]
    names = ("t", "m", "p", "k")
    data = dict.fromkeys(names, (xtr, ytr))
    kw = dict(model=USER, rounds=1, local_steps=10, batch_size=32, lr=0.05, momentum=0.5, fusion="fedavg")
    mixed = CollabConfig(centers=tuple(CenterSpec(n, framework=f) for n, f in
                                       zip(names, ("torch", "mindspore", "paddle", "tensorflow"))), **kw)
    ref = CollabConfig(centers=tuple(CenterSpec(n) for n in names), **kw)
    a, b = run_inprocess(mixed, data), run_inprocess(ref, data)
    assert [r.accepted for r in a.rounds] == [names]
    assert _max_rel(a.params, b.params, list(b.params)) < 1e-5  # measured 3.7e-6 (a running mean)
    from dataclasses import replace

    a3 = run_inprocess(replace(mixed, rounds=3), data, eval_data=(xte, yte))
    b3 = run_inprocess(replace(ref, rounds=3), data, eval_data=(xte, yte))
    assert abs(a3.rounds[-1].eval["accuracy"] - b3.rounds[-1].eval["accuracy"]) <= 0.01
    assert b3.rounds[-1].eval["accuracy"] > 0.6  # it learns (chance: 0.1)


def center_digits(center):
    x, y = digits(200, seed={"t": 1, "m": 2, "p": 3, "k": 4}[center])
    return x, y


@pytest.mark.slow
@ALL_FOUR
def test_cli_four_frameworks_with_the_user_model_as_the_api(tmp_path, capsys):
    from tests.test_collab_cli import _run as _cli

    argv = ["collab", "--centers", "t,m,p,k", "--frameworks", "torch,mindspore,paddle,tensorflow", "--model",
            f"{HERE}:torch_digits", "--loss", "cross_entropy", "--data", f"{HERE}:center_digits", "--rounds", "2",
            "-H", "3", "--batch-size", "16"]
    builders = ["--mindspore-model", BUILDERS["mindspore"], "--builder", f"paddle={BUILDERS['paddle']}",
                "--builder", f"tensorflow={BUILDERS['tensorflow']}"]
    code, _, err = _cli([*argv, *builders, "--out", str(tmp_path)], capsys)
    assert code == 0, err
    cfg = CollabConfig(centers=tuple(CenterSpec(n, framework=f, data=f"{HERE}:center_digits") for n, f in
                                     zip("tmpk", ("torch", "mindspore", "paddle", "tensorflow"))),
                       model=USER, rounds=2, local_steps=3, batch_size=16)
    ref = run_inprocess(cfg)
    with np.load(tmp_path / "final.npz") as z:
        for k, v in ref.params.items():
            np.testing.assert_array_equal(z[k], v)
    code, _, err = _cli([*argv, *builders[:4]], capsys)
    assert code == 2 and "--builder tensorflow=MODULE:FUNCTION" in err and "Traceback" not in err
    code, _, err = _cli([*argv, *builders, "--builder", "jax=m:f"], capsys)
    assert code == 2 and "--builder 'jax=m:f'" in err


@pytest.mark.slow
@pytest.mark.skipif(not (HAVE["paddle"] and HAVE["tensorflow"]), reason="needs paddlepaddle and tensorflow-cpu")
def test_the_import_order_is_enforced_with_the_fix():
    """TensorFlow loaded first: a Paddle center is refused with the order and the fix (importing Paddle then
    would crash the process), in a fresh interpreter."""
    code = ("import tensorflow\nfrom polyparallel.backends.collab._foreign import import_frameworks\n"
            "try:\n    import_frameworks(['paddle'])\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "PaddlePaddle must be imported before TensorFlow" in out.stdout
    assert "torch -> mindspore -> paddle -> tensorflow" in out.stdout and "--engine flower" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not (HAVE["paddle"] and HAVE["tensorflow"]), reason="needs paddlepaddle and tensorflow-cpu")
def test_flower_paddle_and_tensorflow_centers_each_in_its_own_process(tmp_path):
    """Over Flower every center is its own SuperNode and executor process, which imports only its framework;
    the fused model is the in-process engine's (one process, all frameworks) within float32 rounding."""
    pytest.importorskip("flwr")
    from polyparallel.backends.collab._flower import run_flower

    spec = ModelSpec(f"{HERE}:torch_digits", loss="cross_entropy",
                     builders={k: v for k, v in BUILDERS.items() if k != "mindspore"})
    cfg = CollabConfig(centers=tuple(CenterSpec(n, framework=f, data=f"{HERE}:center_digits") for n, f in
                                     (("t", "torch"), ("p", "paddle"), ("k", "tensorflow"))),
                       model=spec, rounds=2, local_steps=3, batch_size=16, holdout=0.25)
    res = run_flower(cfg, workdir=tmp_path, timeout_s=200)
    ref = run_inprocess(cfg)
    assert [r.accepted for r in res.rounds] == [("t", "p", "k")] * 2
    assert _max_rel(res.params, ref.params, list(ref.params)) < 1e-5
    for ra, rb in zip(res.rounds, ref.rounds):
        assert ra.eval["count"] == rb.eval["count"] and abs(ra.eval["loss"] - rb.eval["loss"]) < 1e-5


def test_center_command_refuses_a_framework_it_cannot_train(capsys):
    from tests.test_collab_cli import _run as _cli

    code, _, err = _cli(["center", "--name", "p", "--superlink", "127.0.0.1:1", "--data", f"{HERE}:center_digits",
                         "--framework", "jax"], capsys)
    assert code == 2 and "no center trainer for framework(s) ['jax']" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAVE["paddle"], reason="needs paddlepaddle==3.3.1")
def test_deployed_paddle_center_joins_with_polyparallel_center(tmp_path):
    """`polyparallel serve` with a torch center and a `polyparallel center --framework paddle` (each its own
    process tree): every round fuses both, and the model is the in-process engine's within float32 rounding."""
    pytest.importorskip("flwr")
    import signal

    from polyparallel.backends.collab._flower import free_port, read_outputs
    from tests.test_collab_faults import _cli as _proc
    from tests.test_collab_faults import _rounds, _until

    cfg = CollabConfig(centers=(CenterSpec("t"), CenterSpec("p", framework="paddle")),
                       model=ModelSpec("cnn", (1, 8, 8), 10, hidden=4), rounds=2, local_steps=3, batch_size=16,
                       round_timeout_s=120)
    (tmp_path / "job.json").write_text(cfg.to_json())
    data = {c: center_digits(c) for c in ("t", "p")}
    for c, (x, y) in data.items():
        np.savez(tmp_path / f"{c}.npz", x=x, y=y)
    port = free_port()
    procs = []
    try:
        procs.append(serve := _proc(["serve", "--config", "job.json", "--port", str(port), "--host", "127.0.0.1",
                                     "--out", "out", "--workdir", "srv"], tmp_path, tmp_path / "serve.log"))
        _until(lambda: "waiting for 2 centers" in (tmp_path / "serve.log").read_text(), 60, "the SuperLink")
        for c, extra in (("t", []), ("p", ["--framework", "paddle"])):
            procs.append(_proc(["center", "--name", c, "--superlink", f"127.0.0.1:{port}", "--data", f"{c}.npz",
                                "--workdir", f"w-{c}", *extra], tmp_path, tmp_path / f"{c}.log"))
        assert serve.wait(200) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        got = _rounds(tmp_path / "out")
        assert [r["round"] for r in got] == [1, 2] and all(r["accepted"] == ["t", "p"] for r in got)
        ref = run_inprocess(cfg, data)
        assert _max_rel(read_outputs(tmp_path / "out").params, ref.params, list(ref.params)) < 1e-5
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(20)
