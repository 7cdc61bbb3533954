"""A recipe as a user writes it (issue 31): execution options, pinned schedules and micro-batches,
and evaluate's refusals, each checked against an independent computation (the cost model called
directly, a brute force over micro-batch counts, the same module computed another way)."""

from __future__ import annotations

import doctest
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models import parallel_config as pc
from polyparallel.models import GPT, GPTConfig
from polyparallel.planning import evaluate, search
from polyparallel.planning.model_graphs import ModelGraphs
from polyparallel.planning.plan_search import Constraints, _micro_order


def _gpt(**kw):
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab=128, seq=32, layers=4, hidden=64, heads=4, **kw))
    ids = torch.zeros(2, 32, dtype=torch.long)
    return m, (ids,), {"labels": ids}


def test_parallel_config_docstring_examples_run():
    res = doctest.testmod(pc)
    assert res.attempted >= 2 and res.failed == 0


@pytest.mark.parametrize(("items", "match"), [
    (["grad_overlapp=0"], "unknown execution option.*grad_overlap"),
    (["grad_overlap"], "give KEY=VALUE"),
    (["grad_overlap=yes"], "overlapped share in \\[0, 1\\]"),
    (["fused_dropout=none"], "give true or false"),
    (["pipeline_p2p=mpi"], "give one of"),
])
def test_bad_execution_options_name_the_fix(items, match):
    with pytest.raises(ValueError, match=match):
        pc.parse_execution(items)


def test_execution_options_parse_to_what_the_cost_model_reads():
    got = pc.parse_execution(["grad_overlap=0.5", "fused_elementwise=None", "optimizer=sgd", "fused_dropout=False"])
    assert got == {"grad_overlap": 0.5, "fused_elementwise": None, "optimizer": "sgd", "fused_dropout": False}
    assert pc.execution_options(got) == tuple(sorted(got.items()))
    assert set(pc.EXECUTION_FIELDS) <= set(ParallelConfig.__dataclass_fields__)


def test_explicit_attention_computes_what_sdpa_computes():
    """The explicit attention path (scores, mask, softmax, weighted sum) is the same function."""
    a, _, _ = _gpt()
    b, _, _ = _gpt(attention="explicit")
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 128, (3, 32))
    torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="use 'sdpa' or 'explicit'"):
        GPTConfig(attention="flash")
    with pytest.raises(ValueError, match="probability in \\[0, 1\\)"):
        GPTConfig(dropout=1.0)
    assert GPT(GPTConfig(vocab=128, seq=32, layers=1, hidden=64, heads=4, positions=False)).wpe is None


def test_evaluate_with_recipe_options_equals_the_cost_model_called_directly():
    m, a, k = _gpt(attention="explicit", dropout=0.1)
    execution = {"grad_overlap": 0.0, "fused_dropout": False, "fused_elementwise": True}
    s = evaluate(m, a, "dgx-a100x1", example_kwargs=k, dp=2, tp=2, pp=2, microbatches=4, batch_size=16,
                 schedule="interleaved", chunks=2, zero_stage=1, recompute="none", sequence_parallel=True,
                 partition="layers", execution=execution)
    assert (s.dp, s.tp, s.pp, s.microbatches, s.schedule) == (2, 2, 2, 4, "interleaved:2")
    cl = Cluster.preset("dgx-a100x1")
    cfg = ParallelConfig(dp=2, tp=2, pp=2, microbatches=4, schedule="interleaved", chunks=2, zero_stage=1,
                         recompute="none", dtype=s.dtype, devices=tuple(range(8)), sequence_parallel=True,
                         partition="layers", **execution)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = ModelGraphs(m, a, k).graph(2)
    assert estimate_step(g, cl, cfg).step_time == pytest.approx(s.estimate.step_time_s, rel=1e-9)


def test_unfused_dropout_is_priced_only_where_the_model_has_dropout():
    """Megatron-LM runs its attention dropout as its own kernel after the fused softmax
    (``fused_dropout=False``): the extra time is that of streaming each dropout's tensor once more,
    forward and backward, which bounds it from both sides by HBM bandwidth (model big enough that the
    device, not the host's dispatch, sets the step)."""
    B, S, H, heads, layers = 8, 1024, 1024, 8, 2
    cl = Cluster.preset("dgx-a100x1")
    dt = next(iter(cl.device_types.values())) if isinstance(cl.device_types, dict) else cl.device_types[0]
    cfg = ParallelConfig(dp=8, microbatches=1, dtype="bf16", devices=tuple(range(8)), fused_elementwise=True)
    extra = {}
    for p in (0.0, 0.1):
        with torch.device("meta"):
            m = GPT(GPTConfig(vocab=1024, seq=S, layers=layers, hidden=H, heads=heads, attention="explicit",
                              dropout=p))
        ids = torch.zeros(2, S, dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = ModelGraphs(m, (ids,), {"labels": ids}).graph(B)
        t = [estimate_step(g, cl, replace(cfg, fused_dropout=f)).breakdown()["compute"] for f in (True, False)]
        extra[p] = t[1] - t[0]
    assert extra[0.0] == 0.0  # no dropout op: nothing changes
    # one read and one write of 2-byte values per dropped element, forward and backward, at most at
    # peak bandwidth; at most twice that (a mask byte each way too) at half of it
    elements = layers * (B * heads * S * S + 2 * B * S * H) + B * S * H
    low = 2 * elements * (2 + 2) / dt.memory_bandwidth
    assert low <= extra[0.1] <= 2 * 2 * elements * (2 + 2 + 2) / (0.5 * dt.memory_bandwidth)


def test_pinned_schedule_spellings_agree():
    assert Constraints(schedule="interleaved:4").pinned_schedule() == ("interleaved", 4)
    assert Constraints(schedule="interleaved", chunks=4).pinned_schedule() == ("interleaved", 4)
    assert Constraints(chunks=1).pinned_schedule() == (None, 1)
    with pytest.raises(ValueError, match=r"needs a chunked schedule \(interleaved"):
        Constraints(schedule="gpipe", chunks=2)
    with pytest.raises(ValueError, match="a chunked schedule runs at least 2 model chunks per stage"):
        Constraints(schedule="looped_bfs", chunks=1)
    assert Constraints(schedule="looped_bfs:4").pinned_schedule() == ("looped_bfs", 4)
    with pytest.raises(ValueError, match="pin tp > 1"):
        Constraints(tp=1, sequence_parallel=True)


def test_micro_batch_order_with_a_pipeline_keeps_deep_pipelining():
    """Megatron's 145.6B recipe: 96 samples per replica over 8 stages. The sizes giving at least
    8, 16 and 32 micro-batches, the most micro-batches and the whole batch are all tried (the
    earlier rule kept only powers of two equal to 96/8k, none of which divides: m = 1, GPipe)."""
    sizes = [1, 2, 3, 4, 6, 8, 96]
    assert _micro_order(sizes, 96, 8, Constraints(), False) == [96, 8, 6, 3, 1]
    assert _micro_order(sizes, 96, 1, Constraints(), False) == sorted(sizes, reverse=True)
    assert _micro_order(sizes, 96, 8, Constraints(microbatches=16), False) == [6]
    assert _micro_order(sizes, 96, 8, Constraints(microbatches=7), False) == []


def test_every_divisor_is_a_micro_batch_and_a_pinned_count_is_always_honoured():
    m, a, k = _gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mdl = ModelGraphs(m, a, k)
    assert mdl.micro_sizes(12, False) == [1, 2, 3, 4, 6]
    assert mdl.micro_sizes(12, False, whole=True) == [1, 2, 3, 4, 6, 12]
    assert mdl.micro_sizes(96, False, pinned=4) == [24]  # above MAX_MICRO, but asked for
    assert mdl.micro_sizes(96, False, pinned=5) == []
    # MPT-7B's published micro-batch 6, and one above 8: priced, not refused
    for micro in (6, 12):
        s = evaluate(m, a, "dgx-a100x1", example_kwargs=k, dp=8, batch_size=8 * micro, microbatches=1)
        assert s.global_batch // (s.dp * s.microbatches) == micro and s.estimate.step_time_s > 0


def test_pinned_pipeline_search_still_searches_the_micro_batches():
    """dp=2 tp=2 pp=2 with 24 samples per replica (no power of two gives 2, 4 or 8 micro-batches of
    it): the search's choice is as fast as the best of the same search with each micro-batch count
    pinned too (a brute force over the unpinned knob, under the same executability rules)."""
    with torch.device("meta"):  # big enough that the device, not the host's dispatch, sets the step
        m = GPT(GPTConfig(vocab=1024, seq=1024, layers=4, hidden=1024, heads=8))
    ids = torch.zeros(2, 1024, dtype=torch.long)
    a, k = (ids,), {"labels": ids}
    pins = {"dp": 2, "pp": 2, "tp": 2}
    s = search(m, a, "dgx-a100x1", example_kwargs=k, batch_size=48, constraints=pins)
    assert (s.dp, s.pp, s.tp) == (2, 2, 2) and s.microbatches > 1
    brute = [search(m, a, "dgx-a100x1", example_kwargs=k, batch_size=48,
                    constraints={**pins, "microbatches": count}).estimate.step_time_s
             for count in (1, 2, 3, 4, 6, 8, 12, 24)]
    assert s.estimate.step_time_s == pytest.approx(min(brute), rel=1e-9)


@pytest.mark.parametrize(("kw", "match"), [
    ({"dp": 1, "pp": 8}, "pp=8 exceeds the model's 4 repeated layers"),
    ({"dp": 1, "microbatches": 5, "batch_size": 12}, "5 micro-batches do not divide the 12 samples per replica"),
])
def test_evaluate_says_why_it_cannot_price_a_recipe(kw, match):
    m, a, k = _gpt()
    with pytest.raises(ValueError, match=match):
        evaluate(m, a, "dgx-a100x1", example_kwargs=k, **kw)


def test_cli_recipe_flags_and_their_errors():
    exe = [sys.executable, "-m", "polyparallel", "evaluate", "gpt-tiny", "-c", "dgx-a100x1", "-b", "16"]
    ok = subprocess.run([*exe, "--tp", "2", "--sequence-parallel", "-x", "grad_overlap=0", "-x", "fused_dropout=false",
                         "--json"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([*exe, "-x", "grad_overlapp=0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown execution option" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_uneven_shards_inside_stages_are_named_before_export():
    """Inside pipeline stages a vocabulary is cut as torch.chunk cuts it (GPT-3's 50257 words over
    tp=4; training equals single-process: tests/test_torch_tp_pipeline.py), any other dim must
    divide; what cannot be cut is refused with the fix, before the model is exported."""
    from torch import nn

    from polyparallel.backends.torch._tensor_parallel import uneven_shards
    from polyparallel.backends.torch.capabilities import chunked_evenly

    assert chunked_evenly(50257, 4) and chunked_evenly(63, 2) and not chunked_evenly(5, 4)
    assert [n for n in range(1, 40) if chunked_evenly(n, 4)] == [n for n in range(1, 40)
                                                              if len(torch.arange(n).chunk(4)) == 4]
    m = nn.ModuleDict({"wte": nn.Embedding(101, 8), "fc": nn.Linear(8, 7), "tiny": nn.Embedding(5, 8)})
    assert uneven_shards(m, {"wte": "emb_row"}, 2) == []
    (why,) = uneven_shards(m, {"wte": "emb_row", "fc": "col"}, 2)
    assert "'fc.weight' ((7, 8)) does not split over tp=2" in why and "multiple of 2" in why
    assert len(uneven_shards(m, {"tiny": "emb_row"}, 4)) == 1



def test_the_search_splits_a_vocabulary_that_does_not_divide_by_tp():
    """The solver may cut an odd vocabulary (8191 words over tp=2) as the executor now runs it:
    the plan keeps the vocabulary-parallel embedding and class-parallel loss, priced as the even
    vocabulary's within 0.1%, and passes the backend's pre-launch check (the search's last step)."""
    prices = {}
    for vocab in (8191, 8192):
        with torch.device("meta"):
            m = GPT(GPTConfig(vocab=vocab, seq=1024, layers=4, hidden=1024, heads=8))
        ids = torch.zeros(2, 1024, dtype=torch.long)
        s = search(m, (ids,), "dgx-a100x1", example_kwargs={"labels": ids}, batch_size=32,
                   constraints={"tp": 2, "pp": 2})
        placed = {p.placement for p in s.placements}
        assert any("v:tp" in x for x in placed) and any("c:tp" in x for x in placed), placed
        assert not [n for n in s.search.notes if "refuses" in n]
        prices[vocab] = s.estimate.step_time_s
    assert prices[8191] == pytest.approx(prices[8192], rel=1e-3)


def test_zero3_gathered_tensor_by_tensor_costs_its_collectives_and_copies_exposed():
    """``zero3_gather="parameter"`` (DeepSpeed's ZeRO-3 of 2021): each FSDP unit's ``n`` parameter
    tensors are gathered one by one, each followed by one copy kernel per rank, none hidden: the
    exposed data-parallel time is that sum, by hand from the collective prices (GPT block: 12
    tensors; root: wte (tied with lm_head), wpe, ln_f's two)."""
    from polyparallel.cost_models import data_parallel as dpar
    from polyparallel.cost_models import step as st
    from polyparallel.cost_models.comm import collective_time

    with torch.device("meta"):
        m = GPT(GPTConfig(vocab=1024, seq=256, layers=2, hidden=256, heads=4))
    ids = torch.zeros(2, 256, dtype=torch.long)
    g = ModelGraphs(m, (ids,), {"labels": ids}).graph(2)
    cl = Cluster.preset("dgx-a100x2")
    devs = tuple(range(16))
    cfg = ParallelConfig(dp=16, microbatches=1, dtype="bf16", devices=devs, zero_stage=3, zero3_gather="parameter")
    assert dpar.unit_tensors(g, cfg, 0) == (4, 12, 12)
    widths = [w for w, _ in dpar.fsdp_units(g, cfg, st._stage_terms(g, cl, cfg, 1), 0)]
    launch = next(iter(cl.device_types.values())).launch_overhead if isinstance(cl.device_types, dict) else \
        cl.device_types[0].launch_overhead

    def ag(w: float, n: int) -> float:
        return n * (collective_time(cl, "all_gather", w / n * 2, devs).seconds + 16 * launch)

    gathers = [ag(w, n) for w, n in zip(widths, (4, 12, 12))]
    rs_root = collective_time(cl, "reduce_scatter", widths[0] * 4, devs).seconds
    rs_layers = sum(collective_time(cl, "reduce_scatter", w * 4, devs).seconds for w in widths[1:])
    loss = collective_time(cl, "all_reduce", 32.0, devs).seconds  # the step's loss and target count
    est = estimate_step(g, cl, cfg)
    # the layers' reduce-scatters hide behind the backward (grad_overlap 1 on accelerators), slowing
    # it by sigma = 24 / (108 - 24) while they run (NCCL's 24 channels on an A100's 108 SMs)
    backward = st._stage_terms(g, cl, cfg, 1).bwd[0]
    slowed = 24 / (108 - 24) * min(rs_layers, backward)
    assert rs_layers < backward
    assert est.breakdown()["data_parallel"] == pytest.approx(
        sum(gathers) + sum(gathers[1:]) + rs_root + slowed + loss, rel=1e-9)
    assert est.step_time > estimate_step(g, cl, replace(cfg, zero3_gather="unit")).step_time
    with pytest.raises(ValueError, match="zero3_gather 'module'"):
        replace(cfg, zero3_gather="module").validate()
