"""Mixture-of-experts: the expert matmul's loop nest, expert parallelism's all-to-alls, memory and plans.

Each number is checked against an independent computation: FLOPs against the closed form of the
Mixtral block, the all-to-all volumes against routing a small batch by hand and counting the rows
that change rank, expert memory against the module's own parameter sizes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from polyparallel import ops
from polyparallel.backends.torch.capabilities import plan_problems
from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models.expert_parallel import expert_all_to_all_elements
from polyparallel.frontends.torch import capture_torch
from polyparallel.ir import Hint, OpKind
from polyparallel.strategy import Strategy, StrategyError
from tests.zoo import BATCH, SEQ, hf_mixtral, lm_data


@pytest.fixture(scope="module")
def mixtral():
    torch.manual_seed(0)
    model = hf_mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture_torch(model, lm_data(0))
    return model, graph


def _expert_ops(graph):
    return [op for op in graph.ops if op.nest is not None and any(d.hint is Hint.EXPERT for d in op.nest.dims)]


def test_mixtral_expert_matmuls_are_loop_nests_with_the_closed_form_flops(mixtral):
    model, graph = mixtral
    cfg = model.model.config
    tokens, d, ff, k, n_exp = BATCH * SEQ, cfg.hidden_size, cfg.intermediate_size, cfg.num_experts_per_tok, \
        cfg.num_local_experts
    assert not [op for op in graph.opaque_ops() if "grouped_mm" in op.target]
    experts = _expert_ops(graph)
    assert len(experts) == 2 * cfg.num_hidden_layers  # gate_up and down per layer
    # per layer: every routed row (tokens x top_k) through gate, up and down, 2·d·ff FLOPs each
    assert sum(op.flops for op in experts) == cfg.num_hidden_layers * tokens * k * 3 * 2 * d * ff
    routers = [op for op in graph.ops if OpKind(op.kind) is OpKind.CONTRACTION and op.module.endswith("mlp.gate")]
    assert [op.flops for op in routers] == [2 * tokens * d * n_exp] * cfg.num_hidden_layers


def test_per_expert_loop_mixtral_is_captured_through_its_grouped_mm_implementation():
    """experts_implementation="eager" (a Python loop over the experts hit: data-dependent control flow
    export cannot trace) is captured as grouped_mm, the same function, and the model is left as it was."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.zoo import VOCAB, _HFLoss

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=SEQ, experts_implementation="eager")
    model = _HFLoss(MixtralForCausalLM(cfg), "input_ids")
    ids, labels = lm_data(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture_torch(model, (ids[:1], labels[:1]))
    assert sum(op.flops for op in _expert_ops(graph)) == SEQ * 2 * 3 * 2 * 32 * 32
    assert model.model.config._experts_implementation == "eager"


def test_grouped_mm_nest_refuses_rows_that_do_not_split_over_the_experts():
    nest = ops.grouped_mm((12, 5), (4, 5, 7), (4,))
    assert nest.flops() == 2 * 12 * 5 * 7
    with pytest.raises(ops.NotModelled):
        ops.grouped_mm((10, 5), (4, 5, 7))


@pytest.mark.parametrize(("experts", "top_k", "tokens", "ep"), [(4, 2, 8, 2), (8, 2, 4, 4), (6, 3, 4, 3)])
def test_all_to_all_volumes_match_routing_a_batch_by_hand(experts, top_k, tokens, ep):
    hidden_in, hidden_out = 5, 3
    # each rank routes its tokens' top_k slots round-robin over the experts, so every expert gets the
    # same rows from every rank (the balanced routing the loop nest assumes); experts are split over
    # the ranks in blocks
    owner = {e: e // (experts // ep) for e in range(experts)}
    moved_rows = [0] * ep
    for rank in range(ep):
        rows = sorted((j * top_k + i) % experts for j in range(tokens) for i in range(top_k))  # expert of each row
        for e in rows:
            if owner[e] != rank:  # a row another rank's experts process: out in the dispatch, back in the combine
                moved_rows[owner[e]] += 1
    received = max(moved_rows)
    rows = tokens * top_k
    assert rows % experts == 0
    dispatch, combine = expert_all_to_all_elements(rows, hidden_in, hidden_out, experts, ep)
    assert dispatch == received * hidden_in
    assert combine == received * hidden_out  # each rank gets back what it sent, as many rows
    assert received == rows * (ep - 1) // ep


def test_expert_parallelism_divides_expert_memory_and_prices_the_all_to_alls(mixtral):
    model, graph = mixtral
    cl = Cluster.resolve("dgx-a100x1")
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = estimate_step(graph, cl, ParallelConfig(dp=4, dtype="fp32", optimizer="sgd"))
    ep = estimate_step(graph, cl, ParallelConfig(dp=4, ep=4, dtype="fp32", optimizer="sgd"))
    w1, w4 = dense.memory[0].term("weights"), ep.memory[0].term("weights")
    assert w1 - w4 == pytest.approx(expert_params * (1 - 1 / 4) * 4)  # fp32 weights, 3/4 of the experts gone
    assert ep.breakdown()["expert_parallel"] > 0
    assert "expert_parallel" not in dense.breakdown()
    assert sum(ep.breakdown().values()) == pytest.approx(ep.step_time)
    with pytest.raises(ValueError, match=r"ep=3 must divide dp\*sp"):
        ParallelConfig(dp=4, ep=3).validate()


def test_torch_backend_refuses_the_expert_parallelism_it_does_not_run_by_name(mixtral):
    _, graph = mixtral
    for cfg in (ParallelConfig(dp=4, ep=2), ParallelConfig(dp=2, tp=2, ep=2, zero_stage=1)):
        why = plan_problems(graph, cfg)
        assert any(w.startswith(f"ep=2 with dp={cfg.dp} tp={cfg.tp}") and "ep = dp" in w for w in why), why
    assert plan_problems(None, ParallelConfig(dp=2, ep=2))  # without the graph, no expert matmul to check
    assert not plan_problems(graph, ParallelConfig(dp=2, ep=2))
    assert not plan_problems(graph, ParallelConfig(dp=2, ep=2, zero_stage=1))  # under FSDP2
    assert not plan_problems(graph, ParallelConfig(dp=2))


@pytest.mark.parametrize("placements", ["torch", "any"])
def test_search_writes_an_ep_plan_the_backend_refuses_only_as_planning_only(mixtral, placements, tmp_path):
    from polyparallel.planning.plan_search import search

    model, _ = mixtral
    ids, labels = lm_data(0)
    s = search(model, (ids[:2], labels[:2]), "local-cpu:4", batch_size=8,
               constraints={"dp": 4, "ep": 2, "microbatches": 1, "zero_stage": 0, "placements": placements})
    assert (s.dp, s.ep) == (4, 2)
    # ep < dp: the executor refuses it, and the plan says so first
    assert "planning only" in s.search.notes[0] and "ep=2 with dp=4" in s.search.notes[0]
    if placements == "any":
        _round_trip(s, tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_expert_parallel_training_matches_one_process(zero_stage):
    """ep = dp = 2 on gloo, under DDP and FSDP2 (the expert shards left unsharded by it): each rank
    holds half the experts, tokens all-to-all dispatched and combined; three SGD steps give the
    single-process losses (a missing 1/replicas on the expert gradients alone shows as a 4e-6
    relative error at this learning rate)."""
    import polyparallel as pp
    from polyparallel.backends.torch import train
    from polyparallel.backends.torch._examples import single_process_losses

    x, y = lm_data(0)
    torch.manual_seed(0)
    s = pp.search(hf_mixtral(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=BATCH,
                  constraints={"dp": 2, "ep": 2, "zero_stage": zero_stage, "microbatches": 1})
    assert (s.dp, s.ep, s.zero_stage) == (2, 2, zero_stage) and not any("planning only" in n for n in s.search.notes)
    log = train(s, "tests.zoo:hf_mixtral", "tests.zoo:lm_data", steps=3, lr=1.0, seed=0, timeout_s=280)
    ref = single_process_losses(hf_mixtral, lm_data, steps=3, lr=1.0, seed=0)
    got = [r["loss"] for r in log]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)) < 1e-6


def _round_trip(s: Strategy, tmp_path) -> None:
    path = tmp_path / "s.json"
    s.to_json(path)
    assert Strategy.from_json(path) == s
    d = s.to_dict()
    del d["ep"]
    assert Strategy.from_dict(d).ep == 1
    d["ep"] = 3
    with pytest.raises(StrategyError, match=r"ep=3 must divide dp\*sp = 4"):
        Strategy.from_dict(d)
