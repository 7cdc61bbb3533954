"""Gradient accumulation (``microbatches > 1`` without pipeline stages) trains with single-process numbers.

Each rank cuts its share of the global batch into equal micro-batches, backpropagates them one by
one with the replicas' gradient reduction only in the last one's backward (DDP ``no_sync``, FSDP2
``set_requires_gradient_sync``), and weights a cross entropy over ``-100``-padded labels by the
targets counted over all micro-batches and replicas. Every run is compared with an independent
single-process loop over the whole global batch (same seed, SGD, fp32); so that the comparison can
fail, the padding makes the naive semantics (the mean of the micro-batches' mean losses) differ from
it by far more than the tolerance.
"""

from __future__ import annotations

import functools

import pytest
import torch

import polyparallel as pp
from polyparallel.backends.torch import Unsupported, plan_for, train
from polyparallel.backends.torch import _examples as ex
from tests import zoo
from tests.test_exact_semantics import BATCH, LR, SEED, STEPS, TOL, _single  # the same references and tolerance
from tests.test_exact_semantics import _rel_losses as _rel


def padded_gpt_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``gpt_data`` with each sample's labels after a random length (1..16) set to -100: every
    micro-batch counts a different number of targets."""
    ids, labels = ex.gpt_data(step)
    g = torch.Generator().manual_seed(7000 + step)
    labels = labels.clone()
    for i in range(BATCH):
        labels[i, int(torch.randint(1, 17, (1,), generator=g)):] = -100
    return ids, labels


@functools.cache
def _reference(model_fn, data_fn, parts: int = 1) -> list[float]:
    return _single(model_fn, data_fn, parts)[0]


def _check(log: list[dict], model_fn, data_fn, parts: int, what: str) -> float:
    assert [r["step"] for r in log] == list(range(STEPS))
    ref = _reference(model_fn, data_fn)
    naive = _rel(_reference(model_fn, data_fn, parts), ref)
    err = _rel([r["loss"] for r in log], ref)
    print(f"{what}: max relative loss difference {err:.2e} (the mean of the {parts} micro-batches' means: {naive:.2e})")
    assert {r["loss_weighting"] for r in log} == {"tokens"}
    assert err <= TOL
    assert naive > 10 * TOL  # the padding makes the naive mean visible
    return err


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("zero_stage", [0, 3], ids=["ddp", "fsdp"])
@pytest.mark.parametrize("microbatches", [2, 4])
def test_accumulation_under_data_parallelism_matches_single_process(zero_stage: int, microbatches: int) -> None:
    x, y = padded_gpt_data(0)
    s = pp.evaluate(ex.tiny_gpt(), (x, y), "local-cpu:2", batch_size=BATCH, dp=2, microbatches=microbatches,
                    zero_stage=zero_stage, recompute="none", dtype="fp32")
    assert (s.dp, s.pp, s.microbatches, s.zero_stage) == (2, 1, microbatches, zero_stage)
    log = train(s, ex.tiny_gpt, padded_gpt_data, steps=STEPS, lr=LR, seed=SEED)
    assert {r["microbatches"] for r in log} == {microbatches}
    assert {tuple(r["rank0_input_shape"]) for r in log} == {(BATCH // 2, 16)}  # the rank's share, then cut
    _check(log, ex.tiny_gpt, padded_gpt_data, 2 * microbatches, f"dp=2 zero={zero_stage} m={microbatches}")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_accumulation_under_tensor_parallelism_matches_single_process() -> None:
    """Tensor-parallel peers hold copies of one loss: its targets are counted once."""
    x, y = padded_gpt_data(0)
    s = pp.evaluate(ex.tiny_gpt(), (x, y), "local-cpu:2", batch_size=BATCH, dp=1, tp=2, microbatches=2,
                    recompute="none", dtype="fp32")
    assert (s.tp, s.dp, s.microbatches) == (2, 1, 2)
    log = train(s, ex.tiny_gpt, padded_gpt_data, steps=STEPS, lr=LR, seed=SEED)
    _check(log, ex.tiny_gpt, padded_gpt_data, 2, "tp=2 m=2")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_search_writes_accumulation_plans_that_train_runs() -> None:
    """A Hugging Face LLaMA (its loss shifts the labels inside forward) on padded labels."""
    x, y = zoo.lm_data(0)
    s = pp.search(zoo.hf_llama(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=BATCH,
                  constraints={"microbatches": 2, "pp": 1, "recompute": "none"})
    assert (s.pp, s.microbatches) == (1, 2)
    log = train(s, zoo.hf_llama, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED)
    _check(log, zoo.hf_llama, zoo.lm_data, 2 * s.dp * s.sp, f"search: dp={s.dp} tp={s.tp} sp={s.sp} m=2")


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 8))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(x), labels)


def test_batchnorm_with_accumulated_micro_batches_is_refused_before_launch() -> None:
    """Each micro-batch would be normalised with its own statistics."""
    from polyparallel.backends.torch._tensor_parallel import capture_for_strategy

    x, y = ex.mlp_data(0)
    s = pp.evaluate(BNNet(), (x, y), "local-cpu:2", batch_size=BATCH, dp=2, microbatches=2, recompute="none",
                    dtype="fp32")
    graph = capture_for_strategy(BNNet, (x[:2], y[:2]))
    with pytest.raises(Unsupported, match="normalise with batch statistics"):
        plan_for(s, BNNet(), graph=graph)
