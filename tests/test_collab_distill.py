"""Distillation in the fine-tuning rounds after a pruning job's cut (``PruneSpec.distill``, issue 35): the
loss against a hand computation, the center's first step against plain SGD, the teacher each option
keeps, ``distill=0`` bit for bit the path without it, and the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch_pruning")

import torch
from torch import nn

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec
from polyparallel.backends.collab._center import TorchTrainer, center_round
from polyparallel.backends.collab._distill import Distill, distill_loss
from polyparallel.backends.collab._objective import TorchObjective
from polyparallel.backends.collab._pruning import PruneError, PruneSpec
from polyparallel.backends.collab._wire import decode_update
from tests.test_collab_cli import _run  # the command's exit code, stdout and stderr
from tests.test_collab_pruning import _write_digits

HERE = "tests.test_collab_distill"


class Net(nn.Module):
    """No BatchNorm, no dropout: train and eval mode compute the same function."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def net() -> nn.Module:
    return Net()


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_loss_is_the_hand_written_formula():
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(5, 4)) * 3, rng.normal(size=(5, 4)) * 3
    y = rng.integers(0, 4, 5)
    for a, temp in ((0.5, 4.0), (0.9, 2.0), (0.3, 1.0)):
        ce = -np.mean(np.log(_softmax(s)[np.arange(5), y]))
        pt, ps = _softmax(t / temp), _softmax(s / temp)
        kl = np.mean(np.sum(pt * (np.log(pt) - np.log(ps)), 1))
        want = (1 - a) * ce + a * temp ** 2 * kl
        st = torch.tensor(s, dtype=torch.float64)
        got = distill_loss(st, torch.tensor(t), nn.functional.cross_entropy(st, torch.tensor(y)), a, temp)
        assert float(got) == pytest.approx(want, rel=1e-12)
    # through the center's objective: the same numbers from the models' outputs
    student, teacher = Net().double(), Net().double()
    x = torch.tensor(rng.normal(size=(5, 6)))
    loss, ce = Distill(teacher, 0.5, 4.0).loss(TorchObjective(student, "auto"), student, x, torch.tensor(y))
    with torch.no_grad():
        so, to = student(x).numpy(), teacher(x).numpy()
    pt, ps = _softmax(to / 4), _softmax(so / 4)
    hand_ce = -np.mean(np.log(_softmax(so)[np.arange(5), y]))
    assert float(ce.detach()) == pytest.approx(hand_ce, rel=1e-12)
    hand_kl = np.mean(np.sum(pt * np.log(pt / ps), 1))
    assert float(loss.detach()) == pytest.approx(0.5 * hand_ce + 0.5 * 16 * hand_kl, rel=1e-10)


def _config(**prune) -> CollabConfig:
    return CollabConfig(centers=(CenterSpec("a"), CenterSpec("b")), model=ModelSpec(f"{HERE}:net"), rounds=4,
                        local_steps=1, batch_size=8, lr=0.2, momentum=0.0, fusion="fedavg",
                        prune=PruneSpec(0.5, rounds=1, **prune))


def _trainer(lr: float = 0.2) -> TorchTrainer:
    rng = np.random.default_rng(1)
    t = TorchTrainer(ModelSpec(f"{HERE}:net"), rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 4, 8),
                     batch_size=8, lr=lr)
    t._pruned_by = [["fc1", True, [0]]]  # as after the cut (the plan itself is not read here)
    return t


def _globals(seed: int) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    return {k: v.numpy().copy() for k, v in Net().state_dict().items()}


def _update(payload: dict, cfg: CollabConfig) -> dict[str, np.ndarray]:
    return decode_update({k: v for k, v in payload.items() if not k.startswith("p/")}, cfg.compression)


def test_first_step_after_the_cut_is_sgd_on_the_weighted_cross_entropy_and_the_teacher_is_kept():
    """The teacher starts as the model received, so the KL term's gradient is 0 at the first step: one
    step at lr is one plain step at (1 - a)·lr. ``cut`` keeps that teacher for the later rounds,
    ``round`` takes each round's fused model."""
    a, g2, g3 = 0.75, _globals(2), _globals(3)
    plain = _trainer(lr=0.2 * (1 - a))
    want = _update(center_round(plain, g2, round_idx=2, config=_config(), nonce=None)[0], _config())
    for teacher in ("cut", "round"):
        cfg = _config(distill=a, distill_teacher=teacher)
        t = _trainer()
        got = _update(center_round(t, g2, round_idx=2, config=cfg)[0], cfg)
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-7)
        center_round(t, g3, round_idx=3, config=cfg)
        kept = {k: v.numpy() for k, v in t.__dict__["_pp_teacher"].state_dict().items()}
        for k in kept:
            np.testing.assert_array_equal(kept[k], (g2 if teacher == "cut" else g3)[k])
        assert not any(p.requires_grad for p in t.__dict__["_pp_teacher"].parameters())
    # a later step does feel the teacher: with a = 0.75 the round-3 update differs from the plain one
    t_kd, t_plain = _trainer(), _trainer()
    cfg = _config(distill=a)
    center_round(t_kd, g2, round_idx=2, config=cfg)
    kd = _update(center_round(t_kd, g3, round_idx=3, config=cfg)[0], cfg)
    pl = _update(center_round(t_plain, g3, round_idx=3, config=_config())[0], cfg)
    assert not all(np.allclose(kd[k], pl[k], rtol=1e-4) for k in kd)


def test_distill_zero_is_the_path_without_it_bit_for_bit():
    g = _globals(4)
    base, off = _trainer(), _trainer()
    want = center_round(base, g, round_idx=2, config=_config())[0]
    got = center_round(off, g, round_idx=2, config=_config(distill=0.0, distill_temperature=2.0))[0]
    assert set(got) == set(want) and "_pp_teacher" not in off.__dict__
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    # before the cut (no plan yet) a distilling job trains as one without
    early = _trainer()
    early._pruned_by = None
    got = center_round(early, g, round_idx=2, config=_config(distill=0.5))[0]
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_spec_and_config_refuse_what_cannot_distill():
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(PruneError, match=r"distillation weight must be in \[0, 1\)"):
            PruneSpec(0.5, distill=bad)
    with pytest.raises(PruneError, match="temperature"):
        PruneSpec(0.5, distill=0.5, distill_temperature=0)
    with pytest.raises(PruneError, match="unknown distillation teacher"):
        PruneSpec(0.5, distill=0.5, distill_teacher="oracle")
    with pytest.raises(ValueError, match=r"torch centers only; centers \['b'\] are MindSpore"):
        CollabConfig(centers=(CenterSpec("a"), CenterSpec("b", framework="mindspore")), model=ModelSpec("mlp", (6,), 4),
                     rounds=3, fusion="fedavg", prune=PruneSpec(0.5, rounds=1, distill=0.5))
    cfg = _config(distill=0.5, distill_temperature=2.0, distill_teacher="round")
    assert CollabConfig.from_json(cfg.to_json()) == cfg


def test_a_model_without_class_logits_is_refused_at_its_first_distilled_step():
    t = _trainer()
    t._objective = TorchObjective(t._model, "mse")
    with pytest.raises(ValueError, match=r"needs a classifier.*loss is 'mse'"):
        center_round(t, _globals(5), round_idx=2, config=_config(distill=0.5))


@pytest.mark.parametrize("extra, message", [
    (["--prune", "0.5", "--prune-distill", "1.2"], "distillation weight must be in [0, 1)"),
    (["--prune-distill", "0.5"], "go with --prune RATIO"),
    (["--prune", "0.5", "--prune-distill", "0.5", "--frameworks", "torch,mindspore,torch", "--model", "mlp",
      "--in-shape", "1,8,8"], "are MindSpore"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, message):
    argv = ["collab", *_write_digits(tmp_path, rows=40), "--model", "tests.test_collab_pruning:resnet",
            "--rounds", "2", "--local-steps", "1", *extra]
    code, out, err = _run(argv, capsys)
    assert code == 2, (out, err)
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distillation_over_flower_is_the_inprocess_one_bit_for_bit(tmp_path):
    """The Flower engine's centers keep their teacher in their long-lived processes: 3 centers on digits,
    the cut after round 1, two distilled fine-tuning rounds (``cut``: the second round's teacher is the
    first's), the same model as in-process, bit for bit, and not the model without distillation."""
    pytest.importorskip("flwr", reason="the Flower engine needs flwr==1.42.0")
    from polyparallel.backends.collab import run_inprocess
    from polyparallel.backends.collab._flower import run_flower
    from tests.test_collab_pruning import _config as pruning_config
    from tests.test_collab_pruning import _digits

    data, _ = _digits(rows=200)
    spec = PruneSpec(0.5, rounds=1, score="fisher", score_batches=2, distill=0.5, distill_temperature=2.0)
    cfg = pruning_config(rounds=3, local_steps=6, round_timeout_s=120, prune=spec)
    res = run_flower(cfg, data, workdir=tmp_path / "flwr", timeout_s=240)
    ref = run_inprocess(cfg, data)
    plain = run_inprocess(pruning_config(rounds=3, local_steps=6, prune=PruneSpec(0.5, rounds=1, score="fisher",
                                                                                  score_batches=2)), data)
    assert [r.accepted for r in res.rounds] == [("a", "b", "c")] * 3
    for k, v in ref.params.items():
        np.testing.assert_array_equal(res.params[k], v)
    assert not all(np.array_equal(plain.params[k], v) for k, v in ref.params.items())
