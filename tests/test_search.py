"""Strategy search and the Strategy JSON: round trips, legality, memory, and planner vs exhaustive."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

import polyparallel as pp
from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.models import GPT, MLP, GPTConfig
from polyparallel.planning import DoesNotFit, evaluate, search
from polyparallel.planning.model_graphs import ModelGraphs
from polyparallel.strategy import SCHEMA_FILE, Strategy, StrategyError, json_schema


@pytest.fixture(scope="module")
def tiny_gpt():
    m = GPT(GPTConfig(vocab=128, seq=32, layers=4, hidden=64, heads=4))
    ids = torch.zeros(4, 32, dtype=torch.long)
    return m, (ids,), {"labels": ids}


@pytest.fixture(scope="module")
def tiny_graph(tiny_gpt):
    m, a, k = tiny_gpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pp.capture(m, a, k)


def test_strategy_json_round_trip_and_schema(tiny_gpt, tmp_path):
    m, a, k = tiny_gpt
    s = search(m, a, "local-cpu:4", example_kwargs=k, batch_size=16, constraints={"tp": 2})
    path = tmp_path / "s.json"
    s.to_json(path)
    back = Strategy.from_json(path)
    assert back == s
    assert (back.dp, back.tp) == (2, 2)
    d = json.loads(path.read_text())
    assert set(d["estimate"]) >= {"step_time_s", "samples_per_s", "model_flops_per_s_per_device", "memory_bytes_max",
                                  "comm_fraction", "breakdown"}
    assert set(d["search"]) >= {"capture_s", "search_s", "candidates", "solver"}
    assert json.loads(SCHEMA_FILE.read_text()) == json.loads(json.dumps(json_schema(), sort_keys=True))


def test_bad_strategy_files_get_clear_errors(tmp_path, tiny_gpt):
    p = tmp_path / "x.json"
    p.write_text('{"schema_version": 99}')
    with pytest.raises(StrategyError, match="schema_version 99 is not supported"):
        Strategy.from_json(p)
    p.write_text("{not json")
    with pytest.raises(StrategyError, match="not JSON"):
        Strategy.from_json(p)
    m, a, k = tiny_gpt
    s = search(m, a, "local-cpu:2", example_kwargs=k, batch_size=8)
    d = s.to_dict()
    d["dp"] = s.dp + 1  # no longer the mesh's device count, whatever plan was found
    with pytest.raises(StrategyError, match=f"dp\\*tp\\*pp\\*sp\\*cp = {(s.dp + 1) * s.tp * s.pp * s.sp}"):
        Strategy.from_dict(d)
    with pytest.raises(StrategyError, match="device ids \\[2, 3\\] are not in cluster"):
        s.model_copy(update={"mesh": s.mesh.model_copy(update={"devices": [2, 3]})}).validate_against(
            Cluster.preset("local-cpu:2"))


def test_every_placement_of_a_found_strategy_is_legal(tiny_gpt):
    m, a, k = tiny_gpt
    for mode in ("torch", "rule"):  # the solver's placements (replicated over tp for this tiny model), Megatron's
        s = search(m, a, "local-cpu:4", example_kwargs=k, batch_size=16,
                   constraints={"tp": 2, "dp": 2, "placements": mode})
        graph = ModelGraphs(m, a, k).graph(s.global_batch // (s.dp * s.microbatches))
        s.validate_against(Cluster.preset("local-cpu:4"), graph)  # raises on an illegal placement
    assert any(":tp" in p.placement for p in s.placements)
    bad = s.model_copy(update={"placements": [s.placements[0].model_copy(update={"placement": "k:dp,k:tp"})]})
    with pytest.raises(StrategyError, match="not legal"):
        bad.validate_against(None, graph)


@pytest.mark.parametrize(("cluster", "batch"), [("local-cpu:2", 8), ("local-cpu:4", 16), ("dgx-a100x1", 64),
                                                ("dgx-h100x2", 128)])
def test_planner_matches_exhaustive_optimum(tiny_graph, cluster, batch):
    fast = search(tiny_graph, cluster=cluster, batch_size=batch)
    full = search(tiny_graph, cluster=cluster, batch_size=batch, exhaustive=True)
    assert full.search.candidates >= fast.search.candidates
    assert fast.estimate.step_time_s <= full.estimate.step_time_s * 1.01


def test_found_strategy_fits_and_matches_the_cost_model(tiny_graph):
    cl = Cluster.preset("dgx-a100x1")
    s = search(tiny_graph, cluster=cl, batch_size=32)
    cfg = ParallelConfig(dp=s.dp, tp=s.tp, pp=s.pp, sp=s.sp, microbatches=s.microbatches,
                         schedule=s.schedule.split(":")[0], chunks=int(s.schedule.split(":")[1]) if ":" in s.schedule
                         else 1, zero_stage=s.zero_stage, recompute=s.recompute, dtype=s.dtype,
                         devices=tuple(range(cl.num_devices)))
    from polyparallel.transforms import canonicalize, fuse_elementwise

    est = estimate_step(fuse_elementwise(canonicalize(tiny_graph)), cl, cfg)
    assert est.fits
    assert est.step_time == pytest.approx(s.estimate.step_time_s, rel=1e-9)
    assert s.estimate.memory_bytes_max <= 80e9


def test_too_big_model_gets_a_does_not_fit_answer():
    with torch.device("meta"):
        m = MLP((4096, 65536, 65536, 4096))  # 4.3B params: 17 GB of fp32 weights, ~70 GB with Adam
    x = torch.zeros(2, 4096, device="meta")
    with pytest.raises(DoesNotFit) as e:
        search(m, (x,), "local-cpu:2", batch_size=2)
    msg = str(e.value)
    assert "does not fit" in msg and "short by" in msg and "GB" in msg


def test_evaluate_prices_a_recipe_like_the_search(tiny_graph):
    s = search(tiny_graph, cluster="dgx-a100x1", batch_size=32, constraints={"tp": 2, "pp": 2})
    e = evaluate(tiny_graph, cluster="dgx-a100x1", tp=2, pp=2, batch_size=32, microbatches=s.microbatches,
                 schedule=s.schedule.split(":")[0])
    assert (e.dp, e.tp, e.pp) == (s.dp, s.tp, s.pp) == (2, 2, 2)
    assert e.estimate.step_time_s == pytest.approx(s.estimate.step_time_s, rel=1e-9) or \
        e.estimate.step_time_s >= s.estimate.step_time_s


def test_multi_center_search_never_puts_collectives_on_the_wan(tiny_gpt):
    m, a, k = tiny_gpt
    s = search(m, a, "aisynergy-5", example_kwargs=k, batch_size=352)
    if s.mode == "synchronous":
        assert all(a.level != "inter_center" for a in s.mesh.axes if a.name in ("dp", "tp", "sp"))
    else:
        c = s.collaborative
        assert len(c.centers) == 5 and c.local_steps >= 1
        assert c.comm_fraction <= 0.2 + 1e-9
        assert sum(x.share for x in c.centers) == pytest.approx(1.0, abs=1e-4)


def test_cli_search_explain_evaluate(tmp_path):
    exe = [sys.executable, "-m", "polyparallel"]
    out = tmp_path / "s.json"
    r = subprocess.run([*exe, "search", "mlp", "--cluster", "local-cpu:2", "-b", "64", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    s = Strategy.from_json(out)
    assert s.dp * s.tp * s.pp * s.sp == 2
    r = subprocess.run([*exe, "explain", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "device mesh" in r.stdout and "step time breakdown" in r.stdout
    r = subprocess.run([*exe, "evaluate", "mlp", "--cluster", "local-cpu:2", "--tp", "2", "-b", "64", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)
    assert est["tp"] == 2 and est["step_time_s"] > 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 0}')
    r = subprocess.run([*exe, "explain", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not supported" in r.stderr and "Traceback" not in r.stderr


def test_model_flops_per_step_is_three_forward_passes_of_the_global_batch(tiny_graph):
    s = search(tiny_graph, cluster="dgx-a100x1", batch_size=32)
    per_sample = tiny_graph.flops() / 4  # tiny_graph was captured with a batch of 4
    assert s.model.flops_per_step == pytest.approx(3 * per_sample * 32, rel=1e-9)
    assert s.model.params == tiny_graph.param_count()


def test_rebatched_graphs_equal_direct_captures(tiny_gpt):
    """Sizes other than the two captured anchors are re-batched; a direct capture gives the same graph
    (b >= 2), and at batch 1 the same prices, with the exact capture taken for the strategy."""
    from polyparallel.planning.model_graphs import ANCHORS, NotAffine, rebatch, rebatch_graph
    from polyparallel.transforms import canonicalize, fuse_elementwise

    m, a, k = tiny_gpt
    mdl = ModelGraphs(m, a, k)

    def direct(b):
        args = tuple(rebatch(x, 4, b) for x in a)
        kw = {n: rebatch(v, 4, b) for n, v in k.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fuse_elementwise(canonicalize(pp.capture(m, args, kw)))

    for b in (3, 8):
        assert mdl.graph(b) == direct(b) and b in mdl.derived
    assert mdl.captured == list(ANCHORS) and not mdl.graphs  # two captures served four sizes, none kept
    mdl.drop_rebatcher()  # as the search does once its plan is chosen: a later size compares the anchors again
    assert mdl.graph(6) == direct(6) and mdl.captured == list(ANCHORS)
    one = mdl.graph(1)
    cl = Cluster.preset("dgx-a100x1")
    cfg = ParallelConfig(dp=2, tp=2, pp=2, microbatches=2, dtype="bf16", devices=tuple(range(8)))
    exact = mdl.exact(1)
    assert exact == direct(1) and exact is not one
    assert estimate_step(exact, cl, cfg).step_time == pytest.approx(estimate_step(one, cl, cfg).step_time, rel=1e-12)
    assert exact.flops() == one.flops() and exact.param_count() == one.param_count()
    # different models, or batch-dependent integers that are not affine, are refused (then captured)
    other = pp.capture(GPT(GPTConfig(vocab=128, seq=32, layers=3, hidden=64, heads=4)), a, k)
    with pytest.raises(NotAffine):
        rebatch_graph(mdl.graph(2), other, 2, 4, 8)


def test_step_lower_bound_never_exceeds_the_estimate(tiny_graph):
    """The planner skips a plan whose bound is above the best: the bound must hold everywhere, and
    its memory is the estimate's exactly (the enumeration decides on it)."""
    import itertools

    from polyparallel.cost_models.step import step_lower_bound
    from polyparallel.transforms import canonicalize, fuse_elementwise

    g = fuse_elementwise(canonicalize(tiny_graph))
    cl = Cluster.preset("dgx-h100x2")
    n = 0
    for tp, pp_, sched, z, rc in itertools.product((1, 2, 4), (1, 2, 4), ("1f1b", "gpipe", "interleaved"), (0, 2, 3),
                                                   ("none", "full")):
        if sched == "interleaved" and pp_ == 1:
            continue
        dp = 16 // (tp * pp_)
        cfg = ParallelConfig(dp=dp, tp=tp, pp=pp_, microbatches=2 * pp_, schedule=sched,
                             chunks=2 if sched == "interleaved" else 1, zero_stage=z, recompute=rc, dtype="bf16")
        try:
            est = estimate_step(g, cl, cfg)
        except ValueError:
            continue
        bound = step_lower_bound(g, cl, cfg)
        assert bound.lower_bound <= est.step_time * (1 + 1e-12)
        assert bound.memory == est.memory
        n += 1
    assert n > 100


def test_memory_objective_is_least_memory_within_ten_percent(tiny_gpt):
    """objective='memory' against brute force: every plan of the same enumeration priced in full."""
    import polyparallel.planning.plan_search as planner

    m, a, k = tiny_gpt
    fast = search(m, a, "local-cpu:4", example_kwargs=k, batch_size=16)
    lean = search(m, a, "local-cpu:4", example_kwargs=k, batch_size=16, objective="memory")
    assert lean.estimate.step_time_s <= 1.1 * fast.estimate.step_time_s * (1 + 1e-9)
    assert lean.estimate.memory_bytes_max <= fast.estimate.memory_bytes_max
    # brute force over the wide enumeration the memory objective uses
    mdl = ModelGraphs(m, a, k)
    cl = Cluster.preset("local-cpu:4")
    wide = planner.search_sync(mdl, cl, 16, planner.Constraints(), list(range(4)), False, "memory", lambda _: None)
    everything = [(max(r.total for r in e.memory), e.step_time) for e in
                  (estimate_step(c.graph, cl, c.bound.config) for c in wide.fitting)]
    limit = 1.1 * min(t for _, t in everything)
    assert lean.estimate.memory_bytes_max == pytest.approx(min(mem for mem, t in everything if t <= limit), rel=1e-12)


def test_more_local_processes_than_cores_are_noted():
    import os

    cores = os.cpu_count() or 1
    m = MLP((16, 32, 4))
    s = search(m, (torch.zeros(8, 16),), f"local-cpu:{4 * cores}", batch_size=8 * cores)
    note = [n for n in s.search.notes if "processes on this machine's" in n]
    assert len(note) == 1 and f"{cores} cores" in note[0] and "time-sharing" in note[0]
    assert not any("processes on this machine's" in n
                   for n in search(m, (torch.zeros(8, 16),), "local-cpu:1", batch_size=8).search.notes)
