"""Data parallelism and pipelines train with the numbers single-process training gives, where a
naive split would not: BatchNorm statistics of the global batch, and a cross entropy over
``-100``-padded labels weighted by the targets each replica and micro-batch saw.

Every distributed run is compared with an independent single-process loop on the whole global
batch (same seed, SGD, fp32), and, so that the comparison can fail, with the naive semantics
(per-replica BatchNorm, the mean of the parts' mean losses), which these data make differ by far
more than the tolerance.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import polyparallel as pp
from polyparallel.backends.torch import _examples as ex
from polyparallel.backends.torch import train

STEPS, LR, SEED, BATCH = 3, 0.1, 0, 8
TOL = 1e-5


# --- models and data (module level: the worker processes import them) ---------------------------

class BNConvNet(nn.Module):
    """Two conv blocks with BatchNorm2d (the second with momentum=None: cumulative averages)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return F.cross_entropy(self.head(h.mean((2, 3))), labels)


class BN1dNet(nn.Module):
    """BatchNorm1d on (N, C, L) after a Conv1d and on (N, C) without affine parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn1 = nn.Conv1d(4, 16, 3), nn.BatchNorm1d(16, momentum=None)
        self.fc, self.bn2 = nn.Linear(16, 32), nn.BatchNorm1d(32, affine=False)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv(x))).mean(2)
        return F.cross_entropy(self.head(F.relu(self.bn2(self.fc(h)))), labels)


def image_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    # the two halves (the dp shares) come from different distributions: per-share statistics differ
    x = torch.randn(BATCH, 3, 6, 6, generator=g)
    x[BATCH // 2:] = x[BATCH // 2:] * 2.0 + 1.0
    return x, torch.randint(0, 4, (BATCH,), generator=g)


def seq_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    x = torch.randn(BATCH, 4, 10, generator=g)
    x[BATCH // 2:] = x[BATCH // 2:] * 3.0 - 1.0
    return x, torch.randint(0, 4, (BATCH,), generator=g)


def padded_gpt_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``gpt_data`` with each sample's labels after a random length set to -100 (unequal per sample,
    and many more in the second half, so the dp shares and micro-batches count different targets)."""
    ids, labels = ex.gpt_data(step)
    g = torch.Generator().manual_seed(5000 + step)
    labels = labels.clone()
    for i in range(BATCH):
        lo, hi = (8, 17) if i < BATCH // 2 else (1, 6)
        keep = int(torch.randint(lo, hi, (1,), generator=g))
        labels[i, keep:] = -100
    return ids, labels


class MSEMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), labels)


def mse_mlp() -> nn.Module:
    return MSEMLP()


def regression_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6000 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 2, generator=g)


def tiny_llama() -> nn.Module:
    return HFCausalLM()


class HFCausalLM(nn.Module):
    """A Hugging Face LLaMA from a tiny config; its loss shifts the labels inside forward."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        self.lm = LlamaForCausalLM(cfg)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels).loss


# --- references ------------------------------------------------------------------------------------

def _single(model_fn, data_fn, parts: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process trains on the whole global batch (``parts=1``: the reference), or, the naive
    semantics a split run must not have, on the mean of the mean losses of ``parts`` contiguous
    chunks of it; returns the per-step losses and the final buffers (BatchNorm running statistics)."""
    torch.manual_seed(SEED)
    m = model_fn()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = data_fn(step)
        opt.zero_grad()
        loss = sum(m(xp, yp) for xp, yp in zip(x.chunk(parts), y.chunk(parts))) / parts
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in m.named_buffers()}


def _rel(log: list[dict], ref: list[float]) -> float:
    assert [r["step"] for r in log] == list(range(STEPS))
    return max(abs(r["loss"] - want) / abs(want) for r, want in zip(log, ref))


def _rel_losses(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _checkpointed_buffers(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model buffers of the latest torch.distributed.checkpoint in ``ckpt``, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = (ckpt / "LATEST").read_text().strip()
    dcp_to_torch_save(ckpt / f"step-{step}", ckpt / "whole.pt")
    state = torch.load(ckpt / "whole.pt", weights_only=False)["model"]
    return {k: v for k, v in state.items() if "running" in k or "num_batches" in k}


@functools.cache
def _dp_strategy(model_fn, data_fn, zero_stage: int) -> pp.Strategy:
    x, y = data_fn(0)
    return pp.search(model_fn(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=BATCH,
                     constraints={"pp": 1, "microbatches": 1, "recompute": "none", "dp": 2, "tp": 1,
                              "zero_stage": zero_stage})


# --- BatchNorm ------------------------------------------------------------------------------------

def _bn_ranks(rank: int, world: int, store_path: str) -> None:
    """Rank ``rank`` of 2 holds an unequal share (3 or 5 samples); its cross-rank BatchNorm must
    give its slice of what one BatchNorm computes on the concatenation: outputs, input gradients,
    summed parameter gradients and running statistics, over two steps."""
    import torch.distributed as dist

    from polyparallel.backends.torch._batchnorm import has_batch_statistics, use_cross_rank_batchnorm

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    configs = [(lambda: nn.BatchNorm1d(6), (6,)), (lambda: nn.BatchNorm1d(6, affine=False), (6, 5)),
               (lambda: nn.BatchNorm2d(6, momentum=None), (6, 4, 4)),
               (lambda: nn.BatchNorm3d(6, track_running_stats=False), (6, 3, 3, 3))]
    shares = (3, 5)
    lo = sum(shares[:rank])
    for make, shape in configs:
        torch.manual_seed(0)
        ref, mine = make(), make()
        if ref.affine:  # not the identity, so that wrong gradients for weight and bias show
            with torch.no_grad():
                ref.weight.uniform_(0.5, 1.5)
                ref.bias.uniform_(-0.5, 0.5)
        mine.load_state_dict(ref.state_dict())
        holder = nn.Sequential(mine)
        assert has_batch_statistics(holder)
        assert use_cross_rank_batchnorm(holder, dist.group.WORLD, world) == 1
        for step in range(2):
            g = torch.Generator().manual_seed(10 + step)
            spread = 1 + torch.arange(sum(shares)).view(-1, *[1] * len(shape))  # the shares' statistics differ
            x = torch.randn(sum(shares), *shape, generator=g) * spread
            w = torch.randn(sum(shares), *shape, generator=g)  # d loss / d out
            xr = x.clone().requires_grad_()
            (ref(xr) * w).sum().backward()
            xm = x[lo:lo + shares[rank]].clone().requires_grad_()
            out = mine(xm)
            (out * w[lo:lo + shares[rank]]).sum().backward()
            with torch.no_grad():
                want = nn.functional.batch_norm(x, None, None, ref.weight, ref.bias, True, 0.0, ref.eps)
            torch.testing.assert_close(out.detach(), want[lo:lo + shares[rank]], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(xm.grad, xr.grad[lo:lo + shares[rank]], rtol=1e-5, atol=1e-5)
            for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
                dist.all_reduce(p.grad)  # data parallelism sums (averages) the replicas' gradients
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
                p.grad = q.grad = None
        for name, buf in ref.named_buffers():
            torch.testing.assert_close(dict(mine.named_buffers())[name], buf, rtol=1e-6, atol=1e-7, msg=name)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # not through interpreter finalization, where gloo's threads can abort a finished rank


@pytest.mark.timeout(60)
def test_cross_rank_batchnorm_equals_one_batchnorm_on_unequal_shares(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(_bn_ranks, args=(2, str(tmp_path / "store")), nprocs=2)


def test_a_batchnorm_with_its_own_forward_is_refused() -> None:
    from polyparallel.backends.torch._batchnorm import has_batch_statistics, use_cross_rank_batchnorm

    assert not has_batch_statistics(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.GroupNorm(1, 2)))
    assert use_cross_rank_batchnorm(nn.Sequential(nn.BatchNorm1d(2)), None, 1) == 0  # one replica: nothing to do
    with pytest.raises(ValueError, match=r"'0' \(SyncBatchNorm\) has its own BatchNorm forward"):
        use_cross_rank_batchnorm(nn.Sequential(nn.SyncBatchNorm(2)), None, 2)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero_stage", [0, 3], ids=["ddp", "fsdp"])
@pytest.mark.parametrize("model_fn, data_fn", [(BNConvNet, image_data), (BN1dNet, seq_data)], ids=["bn2d", "bn1d"])
def test_batchnorm_under_data_parallelism_matches_single_process(model_fn, data_fn, zero_stage: int,
                                                                 tmp_path: Path) -> None:
    s = _dp_strategy(model_fn, data_fn, zero_stage)
    assert (s.dp, s.tp, s.zero_stage) == (2, 1, zero_stage)
    log = train(s, model_fn, data_fn, steps=STEPS, lr=LR, seed=SEED, checkpoint_dir=tmp_path)
    ref, ref_bufs = _single(model_fn, data_fn)
    naive, _ = _single(model_fn, data_fn, parts=2)
    bufs = _checkpointed_buffers(tmp_path)
    assert set(bufs) == set(ref_bufs)
    buf_err = max(float((bufs[k].double() - ref_bufs[k]).abs().max() / ref_bufs[k].double().abs().max())
                  for k in ref_bufs)
    err = _rel(log, ref)
    print(f"{model_fn.__name__} zero={zero_stage}: loss {err:.2e}, running statistics {buf_err:.2e}; "
          f"per-replica statistics would differ by {_rel_losses(naive, ref):.2e}")
    assert err <= TOL and buf_err <= TOL
    assert _rel_losses(naive, ref) > 100 * TOL  # the data make per-replica statistics visible


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_per_replica_batchnorm_is_the_naive_split(tmp_path: Path) -> None:
    """``batchnorm="per_replica"`` normalises each share alone: it trains as the naive reference,
    not as single-process training (so the cross-rank test above can tell them apart)."""
    s = _dp_strategy(BNConvNet, image_data, 0)
    log = train(s, BNConvNet, image_data, steps=STEPS, lr=LR, seed=SEED, batchnorm="per_replica")
    ref, _ = _single(BNConvNet, image_data)
    naive, _ = _single(BNConvNet, image_data, parts=2)
    print(f"per-replica BatchNorm: vs naive {_rel(log, naive):.2e}, vs single process {_rel(log, ref):.2e}")
    assert _rel(log, naive) <= TOL
    assert _rel(log, ref) > 100 * TOL


# --- token-count-weighted loss ------------------------------------------------------------------

def test_target_count_sees_what_the_loss_divides_by() -> None:
    """The count each mean-reduced cross entropy / NLL divides by, from the call's own arguments;
    the mean of means is kept (None) for losses it cannot count."""
    from polyparallel.backends.torch._loss_weighting import TargetCount

    torch.manual_seed(0)
    logits = torch.randn(6, 4, requires_grad=True)
    t = torch.tensor([0, 1, -100, 3, 2, -100])
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def counted(fn):
        c = TargetCount()
        with c:
            loss = fn()
        return c.count_for(loss), loss

    for kw, want in [({}, 4), ({"weight": w}, 1 + 2 + 4 + 3), ({"weight": w, "label_smoothing": 0.1}, 10),
                     ({"label_smoothing": 0.2}, 4)]:
        n, loss = counted(lambda kw=kw: F.cross_entropy(logits, t, **kw))
        assert n == want, kw
        torch.testing.assert_close(loss * n, F.cross_entropy(logits, t, reduction="sum", **kw))
    assert counted(lambda: F.nll_loss(F.log_softmax(logits, -1), t, weight=w))[0] == 10
    assert counted(lambda: nn.CrossEntropyLoss(ignore_index=3)(logits, t.clamp(min=0)))[0] == 5
    assert counted(lambda: F.cross_entropy(logits, torch.softmax(torch.randn(6, 4), -1)))[0] == 6  # probabilities
    # not a single mean cross entropy returned as is: the mean of means stays
    assert counted(lambda: F.mse_loss(logits, torch.zeros(6, 4)))[0] is None
    assert counted(lambda: F.cross_entropy(logits, t) + F.cross_entropy(logits, t.flip(0)))[0] is None
    assert counted(lambda: 2 * F.cross_entropy(logits, t))[0] is None
    assert counted(lambda: F.cross_entropy(logits, t, reduction="sum"))[0] is None
    # every target ignored: the sum (0, with zero gradients) instead of 0/0
    n, loss = counted(lambda: F.cross_entropy(logits, torch.full((6,), -100)))
    loss.backward()
    assert n == 0 and loss.item() == 0 and not logits.grad.any()
    # a Hugging Face causal LM shifts its labels inside forward: the count is of the shifted labels
    ids, labels = padded_gpt_data(0)
    n, _ = counted(lambda: tiny_llama()(ids, labels))
    assert n == int((labels[:, 1:] != -100).sum()) != int((labels != -100).sum())
    # the pipeline's loss tail calls ATen's cross_entropy_loss, counted as well
    from polyparallel.backends.torch._pipeline import split_model

    model = ex.tiny_gpt()
    split = split_model(model, ids[:2], labels[:2], ["linear_5"])
    acts = (ids[:2],)
    for chunk in split.chunks:
        acts = chunk(*acts)
    n, loss = counted(lambda: split.tail(*acts, labels[:2]))
    assert n == int((labels[:2] != -100).sum())
    torch.testing.assert_close(loss, model(ids[:2], labels[:2]))


def _padded_check(log: list[dict], model_fn, parts: int, what: str) -> None:
    ref, _ = _single(model_fn, padded_gpt_data)
    naive, _ = _single(model_fn, padded_gpt_data, parts=parts)
    err = _rel(log, ref)
    print(f"{what}: max relative loss difference {err:.2e}; the mean of the {parts} parts' means would be off by "
          f"{_rel_losses(naive, ref):.2e}")
    assert {r["loss_weighting"] for r in log} == {"tokens"}
    assert err <= TOL
    assert _rel_losses(naive, ref) > 100 * TOL  # the padding makes the naive mean visible


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero_stage", [0, 3], ids=["ddp", "fsdp"])
def test_padded_labels_under_data_parallelism_match_single_process(zero_stage: int) -> None:
    s = _dp_strategy(ex.tiny_gpt, padded_gpt_data, zero_stage)
    log = train(s, ex.tiny_gpt, padded_gpt_data, steps=STEPS, lr=LR, seed=SEED)
    _padded_check(log, ex.tiny_gpt, 2, f"dp=2 zero={zero_stage}")


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("nproc", "dp", "schedule", "microbatches"),
                         [(2, 1, "gpipe", 2), (2, 1, "1f1b", 4), (4, 2, "1f1b", 2)])
def test_padded_labels_in_a_pipeline_match_single_process(nproc: int, dp: int, schedule: str,
                                                          microbatches: int) -> None:
    """Counts summed over micro-batches and dp replicas; every stage scales its gradients alike."""
    x, y = padded_gpt_data(0)
    s = pp.search(ex.tiny_gpt(), (x,), f"local-cpu:{nproc}", example_kwargs={"labels": y}, batch_size=BATCH,
                  constraints={"pp": 2, "tp": 1, "dp": dp, "recompute": "none", "schedule": schedule,
                               "microbatches": microbatches, "zero_stage": 0})
    assert (s.pp, s.dp, s.schedule, s.microbatches) == (2, dp, schedule, microbatches)
    log = train(s, ex.tiny_gpt, padded_gpt_data, steps=STEPS, lr=LR, seed=SEED)
    _padded_check(log, ex.tiny_gpt, dp * microbatches, f"pp=2 dp={dp} {schedule} m={microbatches}")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_padded_labels_of_a_hugging_face_causal_lm_match_single_process() -> None:
    s = _dp_strategy(tiny_llama, padded_gpt_data, 0)
    log = train(s, tiny_llama, padded_gpt_data, steps=STEPS, lr=LR, seed=SEED)
    _padded_check(log, tiny_llama, 2, "HF LLaMA dp=2")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_loss_it_cannot_count_keeps_the_mean_of_means() -> None:
    """A mean-squared error has no ignored targets: equal shares' means average to the global mean,
    and the log says which weighting ran."""
    s = _dp_strategy(mse_mlp, regression_data, 0)
    log = train(s, mse_mlp, regression_data, steps=STEPS, lr=LR, seed=SEED)
    ref, _ = _single(mse_mlp, regression_data)
    assert {r["loss_weighting"] for r in log} == {"mean_of_means"}
    err = _rel(log, ref)
    print(f"MSE dp=2 (mean of means): max relative loss difference {err:.2e}")
    assert err <= TOL


def test_a_pipeline_refuses_batchnorm_even_without_running_statistics() -> None:
    """Micro-batches would each be normalised alone; a BatchNorm without buffers writes nothing the
    export-time check would see, so it is refused by the predicate."""
    from polyparallel.backends.torch import Unsupported
    from polyparallel.backends.torch._pipeline import pipeline_plan

    x, y = ex.gpt_data(0)
    s = pp.search(ex.tiny_gpt(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=BATCH,
                  constraints={"pp": 2, "tp": 1, "dp": 1, "recompute": "none", "schedule": "gpipe", "microbatches": 2})
    model = ex.tiny_gpt()
    model.ln_f = nn.BatchNorm1d(model.ln_f.normalized_shape[0], track_running_stats=False)
    with pytest.raises(Unsupported, match=r"the model has BatchNorm: pipeline micro-batches"):
        pipeline_plan(s, model, (x, y))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("degrees", [{"sp": 2}, {"tp": 2}], ids=["sp2", "tp2"])
def test_padded_labels_under_sequence_and_tensor_parallelism_match_single_process(degrees: dict[str, int]) -> None:
    """Sequence shards count different targets (the padding sits at the end of the sequences);
    tensor-parallel peers see the same labels and must not count them twice."""
    x, y = padded_gpt_data(0)
    s = pp.evaluate(ex.tiny_gpt(), (x, y), "local-cpu:2", batch_size=BATCH, recompute="none", microbatches=1,
                    **degrees)
    assert (s.sp, s.tp) == (degrees.get("sp", 1), degrees.get("tp", 1))
    log = train(s, ex.tiny_gpt, padded_gpt_data, steps=STEPS, lr=LR, seed=SEED)
    ref, _ = _single(ex.tiny_gpt, padded_gpt_data)
    err = _rel(log, ref)
    print(f"{degrees}: max relative loss difference {err:.2e}")
    assert {r["loss_weighting"] for r in log} == {"tokens"}
    assert err <= TOL
