"""Tensor parallelism whose rank-local blocks are read off the graph's accesses: a fused ``[gate; up]``
projection (Phi-3's ``gate_up_proj``, any GLU whose two halves come out of one Linear), QK-norm (Qwen3:
each head normalised over its own features), soft-capped attention scores (Gemma-2), GPT-J's rotary
embedding of interleaved pairs (``stack((-x2, x1), -1)``); and Hugging Face's ``Conv1D`` (GPT-2's
projections, ``addmm(b, x, w)`` with ``w`` stored ``(inputs, outputs)``).

Megatron's rule splits the fused Linear's outputs over ``tp`` and the down projection's inputs: rank
``r`` of the down projection reads the ``r``-th block of the activation, which the elementwise product
computed from the ``r``-th block of *each* half. The blocks are read off the graph's accesses
(``paired_blocks``) and the projection's rows regrouped as a fused ``q|k|v`` is; a plain column split
would hand rank 0 the whole gate and rank 1 the whole up. Before, the pair was refused ("not a Megatron
pair") and evaluate(tp=2) wrote such models planning-only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel.backends.torch import Unsupported, plan_for
from polyparallel.backends.torch import _examples as ex
from polyparallel.backends.torch._tensor_parallel import capture_for_strategy, paired_blocks, qkv_rows
from tests.test_torch_tp import _loss_gap

WIDTH, INNER = 32, 64


class GluMLP(nn.Module):
    """A residual GLU block over one fused ``[gate; up]`` Linear, its halves taken ``style``-wise, then a
    classifier: ``chunk`` (sizes from the tensor), ``slice`` (sizes from the configuration, as Phi-3's
    attention slices its fused ``qkv``), ``interleaved`` (gate and up features alternate), ``overlap``
    (halves that share features: not two blocks)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.gate_up = nn.Linear(WIDTH, 2 * INNER)
        self.down = nn.Linear(INNER, WIDTH)
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.gate_up(x)
        if self.style == "chunk":
            gate, up = h.chunk(2, dim=-1)
        elif self.style == "slice":
            gate, up = h[..., :INNER], h[..., INNER:]
        elif self.style == "interleaved":
            gate, up = h[..., ::2], h[..., 1::2]
        else:
            gate, up = h[..., :INNER], h[..., INNER // 2: INNER // 2 + INNER]
        return nn.functional.cross_entropy(self.head(x + self.down(nn.functional.silu(gate) * up)), labels)


def _built(style: str) -> GluMLP:
    torch.manual_seed(0)
    return GluMLP(style)


def glu_chunk() -> GluMLP:
    return _built("chunk")


def glu_slice() -> GluMLP:
    return _built("slice")


def glu_interleaved() -> GluMLP:
    return _built("interleaved")


def glu_overlap() -> GluMLP:
    return _built("overlap")


def _plan(model_fn, data_fn=ex.mlp_data):
    """Megatron's tp=2 as evaluate prices it, and the torch backend's plan for it."""
    x, y = data_fn(0)
    s = pp.evaluate(model_fn(), (x, y), "local-cpu:2", batch_size=ex.BATCH, tp=2, dp=1, microbatches=1,
                    recompute="none")
    return s, plan_for(s, model_fn(), (x, y), graph=capture_for_strategy(model_fn, (x, y)))


def test_the_blocks_of_a_fused_gate_up_projection_are_read_off_the_graph() -> None:
    """Brute force: rank r of the down projection needs features [32r, 32r + 32) of the gate and the same
    of the up half, i.e. rows [32r, 32r + 32) and [64 + 32r, 64 + 32r + 32) of gate_up: the regrouping
    (64, 64) gives it exactly those rows; interleaved halves are a rank's plain block of the features."""
    x, y = ex.mlp_data(0)
    want = {"chunk": (INNER, INNER), "slice": (INNER, INNER), "interleaved": (2 * INNER,)}
    for style, blocks in want.items():
        g = capture_for_strategy(lambda style=style: _built(style), (x, y))
        assert paired_blocks(g, "gate_up", "down", 2) == blocks, style
    rows = qkv_rows((INNER, INNER), 2)
    for r in range(2):
        need = [*range(32 * r, 32 * r + 32), *range(INNER + 32 * r, INNER + 32 * r + 32)]
        assert rows[INNER * r: INNER * (r + 1)] == need
    g = capture_for_strategy(glu_overlap, (x, y))
    why = paired_blocks(g, "gate_up", "down", 2)
    assert isinstance(why, str) and "do not tile" in why


def test_the_plan_regroups_the_fused_projection_and_refuses_halves_that_overlap() -> None:
    _, plan = _plan(glu_chunk)
    assert dict(plan.tp_plan)["gate_up"] == "col" and dict(plan.tp_plan)["down"] == "row"
    assert plan.fused == (("gate_up", (INNER, INNER)),) and plan.pipeline is None  # the model's own forward
    _, plan = _plan(glu_interleaved)
    assert plan.fused == () and plan.pipeline is None  # a plain column split
    with pytest.raises(Unsupported, match=r"not a Megatron pair.*do not tile"):
        _plan(glu_overlap)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_fn", [glu_chunk, glu_slice, glu_interleaved])
def test_a_fused_gate_up_projection_under_tp2_trains_as_one_process(model_fn) -> None:
    """``chunk`` runs the model's own forward on the regrouped shards; ``slice`` sizes its halves from the
    configuration, which fails on a rank's shards, so it runs as the exported graph rewritten on them
    (each slice of whole blocks becomes the local blocks' offsets); ``interleaved`` is a plain split."""
    s, plan = _plan(model_fn)
    assert (plan.pipeline is not None) == (model_fn is glu_slice)
    assert _loss_gap(s, model_fn, ex.mlp_data, f"fused gate/up ({model_fn.__name__})") <= 1e-5


class HeadLocalAttention(nn.Module):
    """Attention written out, as Gemma-2's and Qwen3's eager code: ``q``, ``k`` normalised per head over
    their features (``qk_norm="head"``), over all heads' features at once (``"all"``: OLMo-2's, which
    tensor parallelism cannot split by heads), or not; scores soft-capped by ``tanh``; ``mix_heads``
    adds the mean over the heads to every head's scores (talking heads: not head-local)."""

    def __init__(self, qk_norm: str = "head", mix_heads: bool = False, width: int = 32, heads: int = 4,
                 rotary: bool = False) -> None:
        super().__init__()
        self.qk_norm, self.mix_heads, self.rotary = qk_norm, mix_heads, rotary
        self.d, self.heads = width // heads, heads
        self.wte = nn.Embedding(64, width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.scale = nn.Parameter(torch.ones(self.d if qk_norm == "head" else width))
        self.head = nn.Linear(width, 64, bias=False)

    def _norm(self, z: torch.Tensor) -> torch.Tensor:
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        b, t, _ = x.shape
        q, k = self.q(x), self.k(x)
        if self.qk_norm == "all":
            q, k = self._norm(q), self._norm(k)
        # with rotary, the heads are sized from the configuration (GPT-J's _split_heads): the forward
        # fails on a rank's shards and the plan runs as the rewritten graph
        q, k, v = (z.view(b, t, self.heads if self.rotary else -1, self.d).transpose(1, 2) for z in (q, k, self.v(x)))
        if self.qk_norm == "head":
            q, k = self._norm(q), self._norm(k)
        if self.rotary:  # GPT-J's rotate_every_two: pairs of features (2i, 2i + 1) turned by one angle each
            angle = torch.arange(t).float()[:, None] / 100.0 ** (torch.arange(self.d // 2).float() / self.d)
            cos, sin = angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)
            q, k = ((z * cos + torch.stack((-z[..., 1::2], z[..., ::2]), dim=-1).flatten(-2) * sin) for z in (q, k))
        scores = torch.tanh((q @ k.transpose(-2, -1)) * self.d ** -0.5 / 5.0) * 5.0
        if self.mix_heads:
            scores = scores + scores.mean(1, keepdim=True)
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, -1)
        h = x + self.o(out)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def head_local_attention() -> HeadLocalAttention:
    torch.manual_seed(0)
    return HeadLocalAttention()


def rotary_every_two() -> HeadLocalAttention:
    torch.manual_seed(0)
    return HeadLocalAttention(qk_norm="none", rotary=True)


def test_qk_norm_per_head_and_soft_capped_scores_are_head_local() -> None:
    """The mean over each head's features reads within the head; the ``tanh`` between ``q @ k.T`` and
    the softmax reads the rank's own scores. Refused before ("comes from op 'mean' (reduce)", "comes
    from op 'matmul' (contraction)"). A norm over every head's features, and scores mixed across the
    heads, are not split by heads, naming why (the rule keeps a projection normalised over all its
    features whole, so its plan is refused too)."""
    from polyparallel.backends.torch._tensor_parallel import head_split
    from polyparallel.backends.torch.op_roles import local_dims, op_role

    _, plan = _plan(head_local_attention, ex.gpt_data)
    kinds = dict(plan.tp_plan)
    assert (kinds["q"], kinds["k"], kinds["v"], kinds["o"]) == ("col", "col", "col", "row")
    x, y = ex.gpt_data(0)
    for model_fn, why in [(head_local_attention, None),
                          (lambda: HeadLocalAttention(qk_norm="all"), "along other axes than a block of its features"),
                          (lambda: HeadLocalAttention(mix_heads=True), "read outside the rank's heads")]:
        g = capture_for_strategy(model_fn, (x, y))
        heads = [(op.name, local_dims(op)[0]) for op in g.ops if op_role(g, op) == "heads"]
        splits, problems = head_split(g, heads, 2)
        assert (problems[0] if why else splits) and (why is None or why in problems[0]), problems
        if why:
            with pytest.raises(Unsupported):
                _plan(model_fn, ex.gpt_data)


def test_gptj_rotary_of_interleaved_pairs_is_head_local() -> None:
    """``stack((-x2, x1), dim=-1)`` was opaque to the capture (no loop nest), so the heads could not be
    traced through it ("comes from op 'stack_1' (opaque)"); it is a concat along a new dim. The heads
    are sized from the configuration, so the plan runs as the rewritten graph, which stacks the local
    halves."""
    _, plan = _plan(rotary_every_two, ex.gpt_data)
    kinds = dict(plan.tp_plan)
    assert (kinds["q"], kinds["k"], kinds["o"]) == ("col", "col", "row") and plan.pipeline is not None


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("model_fn", [head_local_attention, rotary_every_two])
def test_head_local_attention_under_tp2_trains_as_one_process(model_fn) -> None:
    s, _ = _plan(model_fn, ex.gpt_data)
    assert _loss_gap(s, model_fn, ex.gpt_data, model_fn.__name__) <= 1e-5


def test_hf_gpt2_conv1d_projections_are_megatron_pairs_run_as_the_rewritten_graph() -> None:
    """HF GPT-2's projections are ``Conv1D``: Megatron's rule was written planning only ("only nn.Linear
    ... are tensor-parallel"). They pair as Linears do (``c_attn`` column-parallel with its q|k|v rows
    regrouped, ``c_proj`` row-parallel; ``c_fc``/``c_proj`` of the MLP); torch's parallel styles would
    cut the transposed weight along the wrong dim, so the plan runs as the exported graph rewritten on
    local shards, and a run calling the model's own forward is refused with that reason."""
    from polyparallel.backends.torch._tensor_parallel import eager_tp_problem
    from tests import zoo

    model_fn, data_fn = zoo.ZOO["gpt2"]
    s, plan = _plan(model_fn, data_fn)
    kinds = dict(plan.tp_plan)
    h = "model.transformer.h.0"
    assert [kinds[f"{h}.{m}"] for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")] == [
        "col", "row", "col", "row"]
    assert dict(plan.fused)[f"{h}.attn.c_attn"] == (32, 32, 32) and plan.pipeline is not None
    assert not any(n.startswith("planning only") for n in s.search.notes)
    why = eager_tp_problem(model_fn(), kinds, 2, data_fn(0))
    assert why is not None and "Conv1D" in why


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hf_gpt2_under_tp2_trains_as_one_process() -> None:
    from tests import zoo

    model_fn, data_fn = zoo.ZOO["gpt2"]
    s, _ = _plan(model_fn, data_fn)
    assert _loss_gap(s, model_fn, data_fn, "HF GPT-2 (Conv1D)") <= 1e-5
