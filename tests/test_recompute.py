"""Activation recomputation in the torch backend (``backends/torch/_recompute.py``).

* It recomputes: a checkpointed layer's forward (``full``), its attention (``selective``) or what
  torchtitan's operator policy does not keep (``op``: every second matrix product, the norms and
  elementwise ops) runs again in the backward, and the gradients equal those of training without
  recomputation, bit for bit.
* It keeps what the memory model counts: the bytes one forward leaves alive for the backward
  (``retained_activation_bytes``) against the ``activations`` term the search prices for the same
  graph and micro-batch (``benchmarks/recompute_memory.py`` prints the whole table).
* The search writes recompute plans (``constraints={"recompute": ...}``) that ``train`` runs on 2
  processes with the losses of single-process training (fp32, 3 SGD steps, rel <= 1e-5).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import polyparallel as pp
from polyparallel.backends.torch import _examples as ex
from polyparallel.backends.torch import plan_for, train
from polyparallel.backends.torch._recompute import apply_recompute, recompute_blocks, retained_activation_bytes
from polyparallel.backends.torch._tensor_parallel import capture_for_strategy
from polyparallel.backends.torch.capabilities import plan_problems
from polyparallel.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.recompute_memory import measured, predicted

STEPS, LR, SEED = 3, 0.1, 0


class _CountAttention(TorchDispatchMode):
    """Counts the attention kernels run (forward and recomputed forward; not their backward), and
    the matrix products with a bias (``addmm``: the GPT's linears, forward and recomputed)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.addmm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.n += "scaled_dot_product" in name and "backward" not in name
        self.addmm += func is torch.ops.aten.addmm.default
        return func(*args, **(kwargs or {}))


def _step(mode: str) -> tuple[float, torch.Tensor, int, int, int]:
    """Loss, gradients, attention kernels run, calls of layer h.0 and matrix products in one step
    under ``mode``."""
    torch.manual_seed(0)
    m = ex.tiny_gpt()
    x, y = ex.gpt_data(0)
    calls = [0]
    m.h[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    m.h[0].fc.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 100))
    apply_recompute(m, mode, recompute_blocks(pp.capture(ex.tiny_gpt(), (x, y))))
    with _CountAttention() as count:
        loss = m(x, y)
        loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in m.parameters()]), count.n, calls[0], count.addmm


def test_recomputation_reruns_forwards_and_keeps_the_gradients() -> None:
    ref_loss, ref, n_att, calls, mm = _step("none")
    assert (n_att, calls, mm) == (2, 101, 8)  # two layers' attention once; h.0 and its fc once; 4 linears a layer
    loss, g, n_att, calls, _ = _step("selective")
    assert (n_att, calls) == (4, 101)  # the attention again in the backward, nothing else
    assert loss == ref_loss and torch.equal(g, ref)
    loss, g, n_att, calls, _ = _step("full")
    assert (n_att, calls) == (4, 201)  # the whole layer again, inside its checkpoint (fc's hook)
    assert loss == ref_loss and torch.equal(g, ref)
    loss, g, n_att, calls, mm = _step("op")
    # the attention's and the 1st and 3rd linear's outputs are kept; of the 2nd and 4th, the
    # recomputation stops before the 4th (fc_out), whose output no saved tensor needs: one more a layer
    assert (n_att, mm) == (2, 10)
    assert loss == ref_loss and torch.equal(g, ref)


def test_operator_policy_prices_what_the_backend_recomputes() -> None:
    """The ops the cost model prices as recomputed under ``op`` are those the backend reruns: per
    layer the first norm, the heads' views, the 2nd linear (proj), the residual add, the second norm
    and the activation; the kept outputs are the 1st and 3rd linears' and the attention's."""
    from polyparallel.cost_models.activations import op_policy_recomputed, op_policy_saved

    x, y = ex.gpt_data(0)
    g = pp.capture(ex.tiny_gpt(), (x, y))
    again, kept = op_policy_recomputed(g), op_policy_saved(g)
    layer0 = [i for i, op in enumerate(g.ops) if (op.module or "").startswith("h.0")]
    linears = [i for i in layer0 if g.ops[i].kind == "contraction"]
    assert [g.ops[i].module for i in linears] == ["h.0.qkv", "h.0.proj", "h.0.fc", "h.0.fc_out"]
    assert [kept[i] for i in linears] == [True, False, True, False]
    assert [again[i] for i in linears] == [False, True, False, False]
    assert {g.ops[i].kind for i in layer0 if again[i]} == {"norm", "view", "split", "contraction", "elementwise"}
    assert not any(again[i] for i in range(len(g.ops)) if not (g.ops[i].module or "").startswith("h."))


def test_full_recomputation_checkpoints_the_planners_layers() -> None:
    x, y = ex.gpt_data(0)
    assert recompute_blocks(pp.capture(ex.tiny_gpt(), (x, y))) == ["h.0", "h.1"]
    with pytest.raises(ValueError, match=r"no module 'h\.7'"):
        apply_recompute(ex.tiny_gpt(), "full", ["h.7"])


class _Flat(torch.nn.Module):
    """No numbered layers: the cost model's full recomputation cuts it into runs of √n ops."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.down(torch.relu(self.up(x))), labels)


def _plan(**kw: object) -> Plan:
    return Plan(dp=2).replace(**kw)


def test_what_recomputation_the_backend_refuses() -> None:
    x, y = ex.gpt_data(0)
    gpt = pp.capture(ex.tiny_gpt(), (x, y))
    mx, my = ex.mlp_data(0)
    mlp = pp.capture(_Flat(), (mx, my))
    assert plan_problems(gpt, _plan(recompute="full")) == []
    assert plan_problems(gpt, _plan(recompute="op")) == []
    assert plan_problems(gpt, _plan(recompute="selective")) == []
    assert plan_problems(mlp, _plan(recompute="selective")) == []
    why = plan_problems(mlp, _plan(recompute="full"))
    assert len(why) == 1 and "no numbered layers" in why[0]
    assert "no numbered layers" in plan_problems(mlp, _plan(recompute="op"))[0]
    # inside pipeline stages too (tests/test_recompute_pipeline.py)
    assert plan_problems(gpt, _plan(recompute="full", dp=1, pp=2, microbatches=2)) == []
    assert plan_problems(gpt, _plan(recompute="selective", dp=1, pp=2, microbatches=2)) == []
    assert any("no numbered layers" in w for w in plan_problems(mlp, _plan(recompute="full", dp=1, pp=2,
                                                                               microbatches=2)))
    assert any("could not be captured" in w for w in plan_problems(None, _plan(recompute="full")))


# --------------------------------------------------------------------------------------------
# memory: what is kept is what the memory model counts


def _table(model_fn, data_fn) -> dict[str, tuple[int, float]]:
    x, y = data_fn(0)
    return {mode: (measured(model_fn, x, y, mode), predicted(model_fn(), x, y, mode))
            for mode in ("none", "selective", "op", "full")}


@pytest.fixture(scope="module")
def gpt_table() -> dict[str, tuple[int, float]]:
    return _table(ex.tiny_gpt, ex.gpt_data)


def test_measured_bytes_follow_the_recomputation(gpt_table) -> None:
    none, sel, op, full = (gpt_table[m][0] for m in ("none", "selective", "op", "full"))
    assert full < op < sel  # the operator policy keeps the layers' inputs and some outputs
    # selective drops each attention's softmax statistics (B·heads·S fp32 logsumexp, 2 layers);
    # full keeps the layers' inputs and what lies outside them
    assert none - sel == 2 * 8 * 4 * 16 * 4
    assert full < 0.2 * none
    torch.manual_seed(0)
    x, y = ex.gpt_data(0)
    assert retained_activation_bytes(ex.tiny_gpt(), x, y) == none  # no wrapper: the bytes of "none"


@pytest.mark.parametrize("mode", ["none", "op", "full"])
def test_memory_model_matches_kept_bytes_gpt(gpt_table, mode: str) -> None:
    meas, pred = gpt_table[mode]
    print(f"tiny GPT {mode}: measured {meas} B, predicted {pred:.0f} B ({pred / meas - 1:+.1%})")
    assert abs(pred / meas - 1) <= 0.10


def _explicit_gpt_with_dropout() -> pp.models.GPT:
    return pp.models.GPT(pp.models.GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, attention="explicit",
                                             dropout=0.1))


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("mode", ["none", "op", "full"])
def test_memory_model_matches_kept_bytes_explicit_attention(mode: str, dropout: bool) -> None:
    """Attention written out: autograd keeps the projection, the softmax's output and the boolean
    mask, not the scaled scores (a multiply by a constant saves the constant, masked_fill its mask);
    the model counted both, +18.8% without recomputation. With dropout (0.1 on the embeddings, the
    probabilities and both residual branches) each dropout keeps its mask: on a CPU torch's float
    noise tensor, and the probabilities before the dropout for the softmax's backward (-20.8% before)."""
    fn = _explicit_gpt_with_dropout if dropout else ex.tiny_gpt_explicit
    x, y = ex.gpt_data(0)
    torch.manual_seed(0)
    meas, pred = measured(fn, x, y, mode), predicted(fn(), x, y, mode)
    print(f"tiny GPT, attention written out, dropout {dropout}, {mode}: measured {meas} B, predicted {pred:.0f} B "
          f"({pred / meas - 1:+.1%})")
    assert abs(pred / meas - 1) <= 0.03


def test_memory_model_matches_kept_bytes_gpt_selective(gpt_table) -> None:
    """SDPA keeps its output and log-sum-exp, never the S×S scores, so selective recomputation of it
    drops the log-sum-exp only; the model counts that (it priced unfused scores before, 23% off)."""
    meas, pred = gpt_table["selective"]
    none_meas, none_pred = gpt_table["none"]
    print(f"tiny GPT selective: measured {meas} B, predicted {pred:.0f} B ({pred / meas - 1:+.1%})")
    assert abs(pred / meas - 1) <= 0.10
    assert none_pred - pred == none_meas - meas == 2 * 8 * 4 * 16 * 4  # 2 layers' B·heads·S fp32 log-sum-exp


@pytest.mark.slow
def test_memory_model_matches_kept_bytes_hf_llama() -> None:
    """HF LLaMA (GQA, rotary, RMSNorm, SwiGLU): every recomputation mode within 10%."""
    from benchmarks.recompute_memory import hf_llama_training
    from tests.zoo import ZOO

    table = _table(hf_llama_training, ZOO["llama"][1])
    for mode, (meas, pred) in table.items():
        print(f"HF LLaMA {mode}: measured {meas} B, predicted {pred:.0f} B ({pred / meas - 1:+.1%})")
        assert abs(pred / meas - 1) <= 0.10


# --------------------------------------------------------------------------------------------
# search => train, exactly


def _single(model_fn, data_fn) -> list[float]:
    return ex.single_process_losses(model_fn, data_fn, steps=STEPS, lr=LR, seed=SEED)


def _max_rel(log: list[dict[str, float]], ref: list[float]) -> float:
    assert [r["step"] for r in log] == list(range(STEPS))
    return max(abs(r["loss"] - want) / abs(want) for r, want in zip(log, ref))


def _search(model_fn, data_fn, batch: int, **constraints: object) -> pp.Strategy:
    x, y = data_fn(0)
    return pp.search(model_fn(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=batch,
                     constraints={"pp": 1, "microbatches": 1, **constraints})


def _trains_exactly(s: pp.Strategy, model_fn, data_fn, label: str) -> None:
    err = _max_rel(train(s, model_fn, data_fn, steps=STEPS, lr=LR, seed=SEED), _single(model_fn, data_fn))
    print(f"{label}: max relative loss difference {err:.2e}")
    assert err <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_full_recompute_dp2_gpt_trains_exactly() -> None:
    s = _search(ex.tiny_gpt, ex.gpt_data, ex.BATCH, recompute="full", dp=2, zero_stage=0)
    assert (s.dp, s.recompute) == (2, "full")
    plan = plan_for(s, ex.tiny_gpt(), graph=capture_for_strategy(ex.tiny_gpt, ex.gpt_data(0)))
    assert (plan.recompute, plan.recompute_blocks) == ("full", ("h.0", "h.1"))  # what each worker checkpoints
    _trains_exactly(s, ex.tiny_gpt, ex.gpt_data, "full recompute DP2 GPT")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_selective_recompute_tp2_gpt_trains_exactly() -> None:
    s = _search(ex.tiny_gpt, ex.gpt_data, ex.BATCH, recompute="selective", tp=2, placements="rule")
    assert (s.tp, s.recompute) == (2, "selective")
    assert {"h:tp", "k_0:tp"} <= {p.placement for p in s.placements}  # attention really is head-parallel
    _trains_exactly(s, ex.tiny_gpt, ex.gpt_data, "selective recompute TP2 GPT")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_operator_policy_recompute_fsdp2_gpt_trains_exactly() -> None:
    s = _search(ex.tiny_gpt, ex.gpt_data, ex.BATCH, recompute="op", dp=2, zero_stage=3)
    assert (s.dp, s.zero_stage, s.recompute) == (2, 3, "op")
    _trains_exactly(s, ex.tiny_gpt, ex.gpt_data, "operator-policy recompute FSDP2 DP2 GPT")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_full_recompute_fsdp2_hf_llama_trains_exactly() -> None:
    from tests.zoo import BATCH, ZOO

    model_fn, data_fn = ZOO["llama"]
    s = _search(model_fn, data_fn, BATCH, recompute="full", dp=2, zero_stage=3)
    assert (s.dp, s.zero_stage, s.recompute) == (2, 3, "full")
    _trains_exactly(s, model_fn, data_fn, "full recompute FSDP2 DP2 HF LLaMA")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_full_recompute_turns_off_an_hf_models_cache() -> None:
    """HF BLOOM with its default use_cache=True: the checkpointed layers' recomputation used to see
    the cache the first run filled (ALiBi broadcast against twice the length, a crash at step 0);
    the backend turns the cache off, as HF's own gradient checkpointing does, and trains exactly."""
    from tests.zoo import BATCH, hf_bloom, lm_data

    assert hf_bloom().model.config.use_cache
    s = _search(hf_bloom, lm_data, BATCH, recompute="full", dp=1)
    assert s.recompute == "full"
    _trains_exactly(s, hf_bloom, lm_data, "full recompute HF BLOOM")
