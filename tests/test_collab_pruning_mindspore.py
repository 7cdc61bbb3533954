"""Online pruning with MindSpore centers (issue 35): a MindSpore center scores through the parameter map,
and after the cut trains its full-size cell with the removed channels held at zero, which must compute
what the pruned torch model computes: checked on a forward (as at enrolment) and on local training
against a torch center of the pruned model given the same batches."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch_pruning")
ms = pytest.importorskip("mindspore", reason="MindSpore centers need mindspore==2.10.0")

import torch  # noqa: E402
from mindspore import nn, ops  # noqa: E402
from torch import nn as tnn  # noqa: E402

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, collaborate  # noqa: E402
from polyparallel.backends.collab import _pruning as P  # noqa: E402
from polyparallel.backends.collab._center import TorchTrainer  # noqa: E402
from polyparallel.backends.collab._foreign import VERIFY_RTOL  # noqa: E402
from polyparallel.backends.collab._mindspore import MindSporeTrainer  # noqa: E402
from polyparallel.backends.collab._models import build_torch_model, torch_state  # noqa: E402
from polyparallel.backends.collab._pruning import PruneSpec  # noqa: E402
from polyparallel.backends.collab._pruning_foreign import conform, expand, kept_indices, shrink  # noqa: E402
from tests.test_collab_pruning import _digits  # noqa: E402

HERE = "tests.test_collab_pruning_mindspore"


class DigitsCNN(tnn.Module):
    """conv-BN-ReLU, conv(+bias)-BN-ReLU, global mean, a hidden linear layer, the classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = tnn.Conv2d(1, 8, 3, padding=1, bias=False), tnn.BatchNorm2d(8)
        self.conv2, self.bn2 = tnn.Conv2d(8, 16, 3, padding=1), tnn.BatchNorm2d(16)
        self.fc1, self.fc2 = tnn.Linear(16, 24), tnn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x))).mean((2, 3))
        return self.fc2(torch.relu(self.fc1(x)))


class MsDigitsCNN(nn.Cell):
    """The same architecture as a MindSpore cell (the map is inferred from order and shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, pad_mode="pad", padding=1, has_bias=False)
        self.bn1 = nn.BatchNorm2d(8, eps=1e-5, momentum=0.9)
        self.conv2 = nn.Conv2d(8, 16, 3, pad_mode="pad", padding=1, has_bias=True)
        self.bn2 = nn.BatchNorm2d(16, eps=1e-5, momentum=0.9)
        self.fc1, self.fc2 = nn.Dense(16, 24), nn.Dense(24, 10)

    def construct(self, x):
        x = ops.relu(self.bn1(self.conv1(x)))
        x = ops.relu(self.bn2(self.conv2(x))).mean((2, 3))
        return self.fc2(ops.relu(self.fc1(x)))


def torch_digits() -> tnn.Module:
    return DigitsCNN()


def ms_digits() -> nn.Cell:
    return MsDigitsCNN()


SPEC = ModelSpec(f"{HERE}:torch_digits", mindspore=f"{HERE}:ms_digits")


def _plan(ratio: float = 0.5, seed: int = 0) -> list:
    """A cut of ``ratio`` of every group's channels by random scores, on the spec's torch model."""
    model = build_torch_model(SPEC, 0)
    ex = torch.zeros(2, 1, 8, 8)
    layout = P.group_scores(model, ex, P.saliency(model, "magnitude"))
    rng = np.random.default_rng(seed)
    return P.mask_and_plan(model, ex, ratio, {k: rng.random(len(v)) for k, v in layout.items()})


def test_kept_indices_gather_what_the_cut_keeps():
    """Shrinking a full model's state by the indices is the state the real cut leaves; expanding puts it back
    with zeros where channels went."""
    plan = _plan()
    full = build_torch_model(SPEC, 3)
    state = torch_state(full)
    cut = build_torch_model(SPEC, 3)
    P.apply_plan(cut, torch.zeros(2, 1, 8, 8), plan)
    want = torch_state(cut)
    kept = kept_indices(SPEC, 0, torch.zeros(2, 1, 8, 8), plan)
    shapes = {k: v.shape for k, v in want.items()}
    got = shrink(state, shapes, kept)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)
    back = expand(got, {k: v.shape for k, v in state.items()}, kept)
    assert back["conv2.weight"].shape == (16, 8, 3, 3) and np.count_nonzero(back["conv2.weight"][:, :, 1, 1]) \
        == got["conv2.weight"].shape[0] * got["conv2.weight"].shape[1]
    np.testing.assert_array_equal(shrink(back, shapes, kept)["fc1.weight"], want["fc1.weight"])


@pytest.mark.slow
def test_mindspore_center_trains_the_pruned_model_as_a_torch_center_does():
    """After the cut: the MindSpore center's masked twin (forward within VERIFY_RTOL of the pruned torch
    model) trains 6 local steps to the parameters a torch center of the pruned model reaches on the same
    batches, within float32 rounding; and it scores and takes part in a pruning federation."""
    data, ev = _digits(rows=200)
    x, y = data["a"]
    plan = _plan()
    kw = dict(center_index=1, batch_size=32, lr=0.1, momentum=0.9, seed=0)
    t = TorchTrainer(SPEC, x, y, **kw)
    m = MindSporeTrainer(SPEC, x, y, **kw)
    for tr in (t, m):
        conform(tr, plan)
    cut = build_torch_model(SPEC, 5)
    P.apply_plan(cut, torch.zeros(2, 1, 8, 8), plan)
    start = torch_state(cut)
    want, _ = t.train(start, steps=6, round_idx=1)
    got, _ = m.train(start, steps=6, round_idx=1)
    assert m.twin_error[0] < VERIFY_RTOL
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=2e-5, err_msg=k)
    assert not np.allclose(want["fc1.weight"], start["fc1.weight"])  # it did train
    np.testing.assert_allclose(m.evaluate(want, *ev)["loss"], t.evaluate(want, *ev)["loss"], rtol=1e-4)

    # a federation with center b on MindSpore prunes as the all-torch one does: the same plan (b's scores
    # are its torch twin's), the same fused model within float32 rounding of b's training
    res = {}
    for fw in ("torch", "mindspore"):
        cfg = CollabConfig(centers=(CenterSpec("a"), CenterSpec("b", framework=fw), CenterSpec("c")), model=SPEC,
                           rounds=3, local_steps=15, batch_size=32, lr=0.1, momentum=0.9, fusion="fedavg",
                           prune=PruneSpec(0.5, rounds=2, score="fisher", score_batches=2))
        res[fw] = collaborate(cfg, data, eval_data=ev)
    assert [r.accepted for r in res["mindspore"].rounds] == [("a", "b", "c")] * 3  # b's scores and updates taken
    assert res["mindspore"].pruning["plan"] == res["torch"].pruning["plan"]
    assert res["mindspore"].params["conv2.weight"].shape[0] < 16
    for k, v in res["torch"].params.items():
        np.testing.assert_allclose(res["mindspore"].params[k], v, rtol=1e-3, atol=1e-4, err_msg=k)
