"""Torch backend: sequence parallelism (Ulysses) inside pipeline stages (SP x PP).

The stages are chunks of the model's graph exported at the local sequence length, rewritten by
``backends/torch/_stage_sp`` (Ulysses all-to-alls around each attention, positions offset by the
shard's first position, HF's causal mask folded into ``is_causal``, the labels' shift across shard
boundaries). Each run launches 4 CPU workers (gloo) and compares the loss of every step with
single-process training on the same seed and global batch (SGD, fp32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import polyparallel as pp
from polyparallel.backends.torch import Unsupported, plan_for, train
from polyparallel.backends.torch import _examples as ex
from polyparallel.backends.torch._pipeline import _sp_rewrite, split_model
from polyparallel.backends.torch._sequence_parallel import sp_problems
from polyparallel.backends.torch._stage_sp import label_shard, ulysses_attention
from polyparallel.backends.torch._tensor_parallel import strategy_graph
from polyparallel.backends.torch.capabilities import plan_problems
from tests import zoo
from tests.test_torch_backend import LR, SEED, STEPS, _max_rel, _single
from tests.test_torch_tp import sharp_llama as _sharp_llama

pytestmark = pytest.mark.slow


class _PaddedAttention(nn.Module):
    """One attention over a padding mask read from the ids: not a mask of positions alone."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(16, 8), nn.Linear(8, 24), nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(ids)).view(ids.shape[0], ids.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        mask = (ids != 0)[:, None, None, :].expand(-1, 2, ids.shape[1], -1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        logits = self.out(a.transpose(1, 2).reshape(ids.shape[0], ids.shape[1], 8))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_stage_graph_rewrite_for_sequence_shards() -> None:
    """HF LLaMA exported at the local length 8 of 16, for sp rank 1: each attention is Ulysses', its
    causal mask built from aranges folded into is_causal, the rotary positions are 8..15, and the
    loss tail's label pad is replaced by the next shard's first label; a padding mask is refused."""
    x, y = zoo.lm_data(0)
    n = zoo.SEQ // 2
    split = split_model(zoo.hf_llama(), x[:4, :n], y[:4, :n], [], rewrite=_sp_rewrite(2, 1, n))
    sp = split.rewritten
    assert len(sp.attentions) == 2 and sp.halo == (1, -100.0)
    (gm,) = split.chunks
    attn = [node for node in gm.graph.nodes if node.target is ulysses_attention]
    assert len(attn) == 2 and all(a.args[3] is None and a.args[5] is True for a in attn)
    assert [node.args for node in gm.graph.nodes if node.name in sp.positions] == [(n, 2 * n)]
    assert not any("pad" in str(node.target) for node in split.tail.graph.nodes)
    # the last shard's halo is the model's own pad value; the first's is the next shard's first label
    assert label_shard(y, 2, 1, sp.halo)[:, -1].eq(-100).all()
    assert torch.equal(label_shard(y, 2, 0, sp.halo)[:, -1], y[:, n])
    with pytest.raises(Unsupported, match=r"mask .* depends on the model inputs"):
        split_model(_PaddedAttention(), x[:4, :n] % 16, y[:4, :n] % 16, [], rewrite=_sp_rewrite(2, 0, n))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seq", ["sp", "cp"])
def test_sequence_and_tensor_parallelism_inside_pipeline_stages_match_single_process(seq: str) -> None:
    """sp=2 (or cp=2) x tp=2 x pp=2 on 8 processes, FSDP2 over the stages' replicas: the tensor-parallel
    pass splits the heads, then the sequence pass wraps each attention on the rank's heads (Ulysses
    all-to-alls of h/tp heads, or ring attention over the cp shards)."""
    x, y = ex.gpt_data(0)
    s = pp.evaluate(ex.tiny_gpt(), (x[:4], y[:4]), "local-cpu:8", batch_size=ex.BATCH, recompute="none",
                    microbatches=2, pp=2, tp=2, zero_stage=1, schedule="gpipe", placements="rule", **{seq: 2})
    assert (s.pp, s.tp, s.sp * s.cp) == (2, 2, 2) and not any("planning only" in n for n in s.search.notes)
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"{seq.upper()}2 x TP2 x PP2 GPT: max relative loss difference {err:.2e}")
    assert err <= 1e-5


@pytest.mark.timeout(120)
def test_searched_sp2_pp2_gpt_matches_single_process(tmp_path: Path) -> None:
    """The public path: a search pinned to sp=2, pp=2 on local-cpu:4 writes a plan (to JSON and
    back) that train runs: Ulysses all-to-alls inside both stages, learned positions offset."""
    x, y = ex.gpt_data(0)
    s = pp.search(ex.tiny_gpt(), (x,), "local-cpu:4", example_kwargs={"labels": y}, batch_size=ex.BATCH,
                  constraints={"sp": 2, "pp": 2, "schedule": "1f1b", "recompute": "none"})
    # a plan train runs (1F1B at one micro-batch is left out, and said so)
    assert (s.sp, s.pp, s.dp, s.tp) == (2, 2, 1, 1) and not any("planning only" in n for n in s.search.notes)
    s.to_json(tmp_path / "strategy.json")
    s = pp.Strategy.from_json(tmp_path / "strategy.json")
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED, profile_comm=True)
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"SP2 x PP2 GPT (searched, {s.schedule}, m={s.microbatches}): max relative loss difference {err:.2e}; "
          f"rank 0 collectives {log[-1]['comm_ops']}")
    assert err <= 1e-5
    # rank 0 holds block 0: per micro-batch its attention exchanges q, k, v and the output forward, and
    # their gradients backward; 2 micro-batches
    assert log[-1]["comm_ops"]["gloo:all_to_all"] == 2 * 8


@pytest.mark.timeout(120)
def test_hf_llama_sp2_pp2_gpipe_matches_single_process() -> None:
    """HF LLaMA from a config (GQA, rotary tables from positions, a causal mask built from aranges,
    labels shifted inside the loss with a ragged -100 tail): GPipe, 2 stages of 2 sequence shards."""
    x, y = zoo.lm_data(0)
    s = pp.evaluate(zoo.hf_llama(), (x[:4], y[:4]), "local-cpu:4", batch_size=zoo.BATCH, recompute="none",
                    microbatches=2, sp=2, pp=2, schedule="gpipe")
    assert [a.name for a in s.mesh.axes if a.size > 1] == ["pp", "sp"]
    # without stages the rotary positions and the mask's aranges are refused; the stage pass runs them
    g = strategy_graph(s, zoo.hf_llama, zoo.lm_data(0), True)
    assert any("builds a tensor from the sequence length" in p for p in sp_problems(g, 2, 2))
    assert plan_problems(g, s) == []
    log = train(s, zoo.hf_llama, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED)
    ref = ex.single_process_losses(zoo.hf_llama, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED)
    err = _max_rel(log, ref)
    print(f"HF LLaMA SP2 x PP2 (GPipe): max relative loss difference {err:.2e}")
    assert err <= 1e-5 and log[-1]["loss_weighting"] == "tokens"


def sharp_llama() -> nn.Module:  # picklable for the workers
    return _sharp_llama(layers=2)


@pytest.mark.timeout(120)
def test_llama_rotary_tables_sp2_pp2_matches_single_process() -> None:
    """The project's LLaMA keeps its rotary tables as buffers read from position 0 at the local
    length (``cos[:S]``): each sequence shard holds its rows before the stages are exported, so the
    second half is rotated by its own angles (queries and keys scaled so the angles move the loss)."""
    x, y = ex.gpt_data(0)
    s = pp.evaluate(sharp_llama(), (x, y), "local-cpu:4", batch_size=ex.BATCH, recompute="none", microbatches=2,
                    sp=2, pp=2, schedule="gpipe")
    g = strategy_graph(s, sharp_llama, ex.gpt_data(0), True)
    assert plan_problems(g, s) == [] and plan_for(s, sharp_llama(), ex.gpt_data(0), graph=g).tables
    log = train(s, sharp_llama, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    err = _max_rel(log, _single(sharp_llama, ex.gpt_data))
    print(f"LLaMA (rotary tables) SP2 x PP2 (GPipe): max relative loss difference {err:.2e}")
    assert err <= 1e-5
