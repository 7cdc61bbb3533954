"""Torch backend: tensor parallelism inside pipeline stages (TP x PP, DP x TP x PP).

The stages are chunks of the model's exported graph, rewritten Megatron-style on local shards
(``backends/torch/_stage_tp``). Each run launches 4 or 8 CPU workers (gloo) and compares the loss
of every step with single-process training on the same seed and global batch (SGD, fp32).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import polyparallel as pp
from polyparallel.backends.torch import Unsupported, plan_for, train
from polyparallel.backends.torch import _examples as ex
from polyparallel.backends.torch._pipeline import split_model
from polyparallel.backends.torch._stage_tp import (
    copy_to_tp,
    local_tensor,
    reduce_from_tp,
    shard_graph,
    vocab_parallel_embedding,
)
from polyparallel.backends.torch._tensor_parallel import strategy_graph
from tests import zoo
from tests.test_torch_backend import LR, SEED, STEPS, _max_rel, _single

pytestmark = pytest.mark.slow


@functools.cache
def _gpt_plan(n: int, dp: int, schedule: str) -> pp.Strategy:
    """Megatron's placements (the rule) for tiny GPT at tp=2, pp=2, 2 micro-batches."""
    x, y = ex.gpt_data(0)
    b = ex.BATCH // (2 * dp)
    return pp.evaluate(ex.tiny_gpt(), (x[:b], y[:b]), f"local-cpu:{n}", batch_size=ex.BATCH, recompute="none",
                       microbatches=2, tp=2, pp=2, dp=dp, schedule=schedule, **({"zero_stage": 3} if dp > 1 else {}))


def _ops(gm: torch.fx.GraphModule, fn) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.target is fn]


def test_stage_graph_rewrite_runs_megatron_on_local_shards() -> None:
    """The plan is checked on the exported graph before launch; per GPT block the rewrite inserts one
    gradient all-reduce before each group of column-parallel Linears (qkv; fc) and one all-reduce
    after each row-parallel one (proj; fc_out), the embeddings are vocabulary-parallel, and a split
    value read whole is refused naming the op."""
    s = _gpt_plan(4, 1, "1f1b")
    model, batch = ex.tiny_gpt(), ex.gpt_data(0)
    plan = plan_for(s, model, batch, graph=strategy_graph(s, ex.tiny_gpt, batch, True))
    assert (plan.pipeline.tp, plan.pipeline.axes) == (2, ("pp", "dp", "tp")) and plan.loss_parallel
    kinds, fused = dict(plan.tp_plan), dict(plan.fused)
    x, y = batch
    holder: dict[str, object] = {}

    def rewrite(gm: torch.fx.GraphModule) -> dict[str, int]:
        split, holder["params"] = shard_graph(gm, kinds, fused, 2, rank=1)
        return split

    split = split_model(model, x[:4], y[:4], plan.pipeline.cuts, rewrite=rewrite)
    first, last = split.chunks
    assert len(_ops(first, copy_to_tp)) == 2 and len(_ops(first, reduce_from_tp)) == 2  # block 0
    assert len(_ops(last, copy_to_tp)) == 3 and len(_ops(last, reduce_from_tp)) == 2  # block 1 and lm_head
    assert len(_ops(first, vocab_parallel_embedding)) == 1  # the token table; the position table stays whole
    # the qkv rows are regrouped, proj and fc_out split by columns, the tied table by rows
    params = holder["params"]
    assert params["h.0.qkv.weight"] == (0, (32, 32, 32)) and params["h.1.proj.weight"] == (1, (32,))
    assert params["lm_head.weight"] == (0, (64,)) and "h.0.ln_1.weight" not in params
    # rank 1 looks up the second half of the vocabulary; views are sized for 2 of the 4 heads
    emb = next(n for n in first.graph.nodes if n.target is vocab_parallel_embedding)
    assert emb.args[2] == 32
    assert [n.args[1] for n in first.graph.nodes if n.name == "split"] == [16]
    # the class-parallel logits reach the loss split along the classes
    assert split.rewritten["flatten"] == 1
    # the split parameters are read through to_local right before the op using them, in its chunk
    assert all(u.op == "call_function" for c in split.chunks for n in c.graph.nodes if n.target is local_tensor
               for u in n.users)
    with pytest.raises(Unsupported, match=r"op 'linear_3' .* reads 'gelu', split over tp, as a whole tensor"):
        split_model(model, x[:4], y[:4], plan.pipeline.cuts,
                    rewrite=lambda gm: shard_graph(gm, {"h.0.fc": "col"}, {}, 2)[0])


@pytest.mark.timeout(240)
def test_searched_tp2_pp2_interleaved_gpt_matches_single_process_and_resumes(tmp_path: Path) -> None:
    """The public path: search pinned to tp=2, pp=2 with Megatron placements writes an interleaved
    plan; train runs it (head-parallel attention over the regrouped qkv, vocabulary-parallel tied
    embedding, class-parallel loss), checkpointed and resumed with another seed."""
    x, y = ex.gpt_data(0)
    s = pp.search(ex.tiny_gpt(), (x,), "local-cpu:4", example_kwargs={"labels": y}, batch_size=ex.BATCH,
                  constraints={"tp": 2, "pp": 2, "placements": "rule", "microbatches": 2,
                               "schedule": "interleaved", "recompute": "none"})
    # (no note but the one on more processes than this machine's cores, where that is so)
    assert (s.tp, s.pp, s.dp, s.schedule) == (2, 2, 1, "interleaved:2")
    assert not [n for n in s.search.notes if "processes on this machine's" not in n]
    assert {"n:tp", "h:tp", "k_0:tp", "k:tp", "v:tp", "c:tp"} <= {p.placement for p in s.placements}
    first = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS - 1, lr=LR, seed=SEED, checkpoint_dir=tmp_path,
                  profile_comm=True)
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED + 1, checkpoint_dir=tmp_path)
    assert log[: STEPS - 1] == first
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"TP2 x PP2 interleaved (searched, resumed): max relative loss difference {err:.2e}; "
          f"rank 0 collectives {first[-1]['comm_ops']}")
    assert err <= 1e-5
    # rank 0 holds chunk 0 (both embeddings) and chunk 2 (block 1): per micro-batch the token table's
    # and 2 row-parallel all-reduces forward (the position table is whole), 2 column-input all-reduces
    # backward; 2 micro-batches, plus the loss statistics and the tied embedding's gradient
    assert first[-1]["comm_ops"]["gloo:all_reduce"] == 2 * 5 + 2


@pytest.mark.timeout(240)
def test_dp2_tp2_pp2_gpt_matches_single_process() -> None:
    """3-D: FSDP2 (ZeRO-3) over dp=2 on top of tp=2 DTensor shards in each of 2 stages, 8 ranks."""
    s = _gpt_plan(8, 2, "1f1b")
    assert [a.name for a in s.mesh.axes if a.size > 1] == ["pp", "dp", "tp"] and s.zero_stage == 3
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"DP2 x TP2 x PP2 (FSDP2, 1F1B): max relative loss difference {err:.2e}")
    assert err <= 1e-5


@pytest.mark.timeout(240)
def test_explicit_attention_tp2_pp2_gpt_matches_single_process() -> None:
    """Attention written out inside pipeline stages: the rewrite keeps q @ k.T, the masked softmax,
    the dropout and p @ v on each rank's heads, views sized for them."""
    x, y = ex.gpt_data(0)
    s = pp.evaluate(ex.tiny_gpt_explicit(), (x[:4], y[:4]), "local-cpu:4", batch_size=ex.BATCH,
                    recompute="none", microbatches=2, tp=2, pp=2, schedule="1f1b", placements="rule")
    assert {"b1:tp", "d1:tp"} <= {p.placement for p in s.placements}
    log = train(s, ex.tiny_gpt_explicit, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    err = _max_rel(log, _single(ex.tiny_gpt_explicit, ex.gpt_data))
    print(f"TP2 x PP2 GPT, attention written out: max relative loss difference {err:.2e}")
    assert err <= 1e-5


@pytest.mark.timeout(240)
def test_hf_llama_tp2_pp2_matches_single_process() -> None:
    """HF LLaMA built from a config (GQA, rotary tables, RMSNorm, padded labels), Megatron's placements:
    head-parallel attention (q, k, v column-parallel reading one copied input, the repeated kv heads
    viewed locally, o row-parallel), SwiGLU MLPs (gate and up column-parallel, down row-parallel), a
    vocabulary-parallel embedding and a class-parallel loss over the untied head; 1F1B, 2 stages."""
    x, y = zoo.lm_data(0)
    s = pp.evaluate(zoo.hf_llama(), (x[:4], y[:4]), "local-cpu:4", batch_size=zoo.BATCH, recompute="none",
                    microbatches=2, tp=2, pp=2, schedule="1f1b")
    assert {"n:tp", "h_0:tp", "k_0:tp", "k:tp", "v:tp", "c:tp"} <= {p.placement for p in s.placements}
    log = train(s, zoo.hf_llama, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED, profile_comm=True)
    ref = ex.single_process_losses(zoo.hf_llama, zoo.lm_data, steps=STEPS, lr=LR, seed=SEED)
    err = _max_rel(log, ref)
    print(f"HF LLaMA TP2 x PP2: max relative loss difference {err:.2e}; rank 0 collectives {log[-1]['comm_ops']}")
    assert err <= 1e-5
    # stage 0 (embedding, block 0) per micro-batch: the embedding's, o's and down's all-reduces forward,
    # q|k|v's and gate|up's backward; 2 micro-batches and the loss statistics
    assert log[-1]["comm_ops"]["gloo:all_reduce"] == 2 * 5 + 1


ODD_VOCAB = 63  # not a multiple of tp=2: torch.chunk gives the ranks 32 and 31 rows of the tied table


def odd_vocab_gpt() -> torch.nn.Module:
    from polyparallel.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab=ODD_VOCAB, seq=16, layers=2, hidden=32, heads=4))


def odd_vocab_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, ODD_VOCAB, (ex.BATCH, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.timeout(240)
def test_vocabulary_not_divisible_by_tp_splits_unevenly_inside_stages() -> None:
    """GPT-3's 50257 words do not divide by tp: the vocabulary-parallel embedding, the class-parallel
    output layer and its loss run on torch.chunk's uneven shards (32 and 31 rows here), with the
    losses of single-process training, where the stage rewrite used to refuse the plan."""
    x, y = odd_vocab_data(0)
    s = pp.evaluate(odd_vocab_gpt(), (x[:4], y[:4]), "local-cpu:4", batch_size=ex.BATCH, recompute="none",
                    microbatches=2, tp=2, pp=2, dp=1, schedule="1f1b")
    assert {"v:tp", "c:tp"} <= {p.placement for p in s.placements}
    ref = _single(odd_vocab_gpt, odd_vocab_data)
    err = _max_rel(train(s, odd_vocab_gpt, odd_vocab_data, steps=STEPS, lr=LR, seed=SEED), ref)
    print(f"TP2 x PP2, vocabulary {ODD_VOCAB}: max relative loss difference {err:.2e}")
    assert err <= 1e-5
    # without a pipeline the same placements run as DTensors, which shard unevenly themselves
    s1 = pp.evaluate(odd_vocab_gpt(), (x[:4], y[:4]), "local-cpu:2", batch_size=ex.BATCH, recompute="none",
                     microbatches=1, tp=2, pp=1, dp=1)
    assert {"v:tp", "c:tp"} <= {p.placement for p in s1.placements}
    assert _max_rel(train(s1, odd_vocab_gpt, odd_vocab_data, steps=STEPS, lr=LR, seed=SEED), ref) <= 1e-5
