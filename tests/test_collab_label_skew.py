"""The logit-adjusted local loss (``logit_adjust``): centers with label-skewed data train on
``softmax(z + τ log π)`` with ``π`` their own label frequencies.

Independent check: adding a constant ``b`` to the logits inside the loss is the same as training a model
whose last bias is larger by ``b`` with the plain loss (the gradients are identical), so the adjusted run
must equal the plain run started from ``bias + b``, minus ``b`` at the end.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from polyparallel.backends.collab import (
    CenterSpec,
    CollabConfig,
    ModelSpec,
    TorchTrainer,
    initial_params,
    label_log_prior,
    make_trainer,
    run_inprocess,
)

SPECS = {"mlp": (ModelSpec("mlp", (6,), 4, hidden=8), "fc2.bias"),
         "cnn": (ModelSpec("cnn", (1, 8, 8), 4, hidden=4, norm="group"), "fc.bias")}


def _skewed(spec, n=40, seed=0):
    """Inputs and labels drawn 60/30/10/0 %: one class is missing at this center."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *spec.in_shape)).astype(np.float32)
    y = rng.choice(4, size=n, p=[0.6, 0.3, 0.1, 0.0])
    return x, y


def test_label_log_prior_closed_form_and_errors():
    y = np.array([0, 0, 0, 1, 2, 2])
    np.testing.assert_allclose(label_log_prior(y, 4, tau=0.5),
                               0.5 * np.log([3 / 6, 1 / 6, 2 / 6, 1e-6]), rtol=1e-6)
    assert label_log_prior(y, 4).dtype == np.float32
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        label_log_prior(np.array([0, 3]), 3)
    with pytest.raises(ValueError, match="at least one label"):
        label_log_prior(np.array([], np.int64), 3)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_adjusted_loss_equals_plain_training_from_a_shifted_bias(kind):
    spec, bias_name = SPECS[kind]
    x, y = _skewed(spec)
    p0 = initial_params(CollabConfig(centers=(CenterSpec("a"),), model=spec))
    kw = dict(batch_size=8, lr=0.1, momentum=0.9, seed=3, lr_schedule="cosine", rounds=3)
    tau = 1.0
    b = label_log_prior(y, spec.num_classes, tau)
    adj, m_adj = TorchTrainer(spec, x, y, logit_adjust=tau, **kw).train(p0, steps=6, round_idx=2)
    shifted = {**p0, bias_name: p0[bias_name] + b}
    ref, m_ref = TorchTrainer(spec, x, y, **kw).train(shifted, steps=6, round_idx=2)
    ref[bias_name] = ref[bias_name] - b
    for k in p0:
        np.testing.assert_allclose(adj[k], ref[k], atol=2e-5, rtol=1e-5, err_msg=k)
    assert m_adj["train_loss"] == pytest.approx(m_ref["train_loss"], rel=1e-5)
    plain, _ = TorchTrainer(spec, x, y, **kw).train(p0, steps=6, round_idx=2)
    # the adjustment is not a no-op: the missing class's bias is no longer pushed down
    assert np.abs(plain[bias_name] - adj[bias_name]).max() > 1e-2
    assert (adj[bias_name][3] - p0[bias_name][3]) > (plain[bias_name][3] - p0[bias_name][3]) + 1e-2


def test_the_option_reaches_every_center_and_bad_values_are_refused():
    spec, _ = SPECS["mlp"]
    data = {c: _skewed(spec, seed=i) for i, c in enumerate(("a", "b"))}
    cfg = CollabConfig(centers=(CenterSpec("a"), CenterSpec("b")), model=spec, rounds=2, local_steps=3,
                       batch_size=8, lr=0.1, logit_adjust=1.0)
    assert make_trainer(cfg, "b", *data["b"]).logit_adjust == 1.0
    assert CollabConfig.from_json(cfg.to_json()) == cfg
    adjusted = run_inprocess(cfg, data).params
    plain = run_inprocess(replace(cfg, logit_adjust=0.0), data).params
    assert max(float(np.abs(adjusted[k] - plain[k]).max()) for k in plain) > 1e-3
    with pytest.raises(ValueError, match="logit_adjust must be a finite number >= 0"):
        CollabConfig(centers=(CenterSpec("a"),), model=spec, logit_adjust=-1.0)
    with pytest.raises(ValueError, match="logit_adjust must be a finite number >= 0"):
        TorchTrainer(spec, *data["a"], logit_adjust=float("nan"))
