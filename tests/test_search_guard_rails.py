"""Guard rails of the search: no pipeline stage without parameters (issue 19).

A GPT whose vocabulary projection outweighs its blocks is cut by the FLOP-balanced layer partition
with the loss alone on the last stage at pp=2; such a pipeline must not be a plan.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import polyparallel.planning.plan_search as ps
from polyparallel.cost_models import ParallelConfig
from polyparallel.ir import TensorKind
from polyparallel.models import GPT, GPTConfig
from polyparallel.planning import DoesNotFit, evaluate, search
from polyparallel.planning.assemble import stage_chunks
from polyparallel.planning.model_graphs import ModelGraphs


def _wide_vocab():
    ids = torch.zeros(2, 16, dtype=torch.long)
    return GPT(GPTConfig(vocab=50000, seq=16, layers=4, hidden=16, heads=4)), (ids,), {"labels": ids}


def _stage_params(g, cfg) -> list[int]:
    """Parameter elements read by each stage's ops (independently of the search's check)."""
    out = []
    for ranges in stage_chunks(g, cfg):
        names = {t for a, z in ranges for op in g.ops[a:z + 1] for t in op.inputs
                 if g.tensors[t].kind is TensorKind.PARAM}
        out.append(sum(g.tensors[t].numel for t in names))
    return out


def test_paramless_stage_matches_the_stage_cut():
    warnings.simplefilter("ignore")
    m, a, k = _wide_vocab()
    g = ModelGraphs(m, a, k).graph(2)
    seen_hollow = False
    for pp in (2, 3, 4):
        for sched, v in (("1f1b", 1), ("interleaved", 2)):
            cfg = ParallelConfig(pp=pp, schedule=sched, chunks=v)
            try:
                params = _stage_params(g, cfg)
            except ValueError:  # more chunks than layers
                continue
            empty = [s for s, n in enumerate(params) if n == 0]
            assert ps._paramless_stage(g, cfg) == (empty[0] if empty else None)
            seen_hollow |= bool(empty)
    assert seen_hollow  # the case exists: the guard is not vacuous here


def test_search_never_returns_a_stage_without_parameters():
    warnings.simplefilter("ignore")
    m, a, k = _wide_vocab()
    with pytest.raises(DoesNotFit, match="no parameter"):
        search(m, a, "local-cpu:4", example_kwargs=k, batch_size=8, constraints={"pp": 2, "tp": 1, "dp": 2})
    s = search(m, a, "local-cpu:4", example_kwargs=k, batch_size=8)
    g = ModelGraphs(m, a, k).exact(s.global_batch // (s.dp * s.microbatches))
    cfg = ParallelConfig(dp=s.dp, tp=s.tp, pp=s.pp, sp=s.sp, microbatches=s.microbatches,
                         schedule=s.schedule.partition(":")[0], chunks=int(s.schedule.partition(":")[2] or 1))
    assert all(n > 0 for n in _stage_params(g, cfg))


def test_why_each_axis_prices_the_fastest_plan_without_it():
    """The search says per mesh axis what the fastest plan without it costs; that price must be the
    optimum of a search with the axis pinned to 1 (an exhaustive one: every plan priced in full)."""
    import re

    from polyparallel.models import Llama, LlamaConfig

    warnings.simplefilter("ignore")
    ids = torch.zeros(2, 32, dtype=torch.long)
    m = Llama(LlamaConfig(vocab=256, seq=32, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128))
    shared = ModelGraphs(m, (ids,), {"labels": ids})
    ps_graphs = ps.ModelGraphs
    ps.ModelGraphs = lambda *_, **__: shared
    try:
        # all 8 devices: on them the fastest plan is a tp=8 that splits no op (else 1 device is used)
        s = search(m, (ids,), "dgx-a100x1", example_kwargs={"labels": ids}, batch_size=16, constraints={"devices": 8})
        why = {n.split("=")[0][4:]: n for n in s.search.notes if n.startswith("why ")}
        axes = [a for a in ("dp", "tp", "pp", "sp") if getattr(s, a) > 1]
        assert axes and sorted(why) == sorted(axes)
        for axis in axes:
            alt, chosen = map(float, re.search(r"\(([0-9.e-]+) s vs ([0-9.e-]+) s per step", why[axis]).groups())
            assert chosen == pytest.approx(s.estimate.step_time_s, rel=1e-3)
            pinned = search(m, (ids,), "dgx-a100x1", example_kwargs={"labels": ids}, batch_size=16,
                            constraints={axis: 1, "devices": 8}, exhaustive=True)
            assert alt == pytest.approx(pinned.estimate.step_time_s, rel=1e-3)  # the note prints 4 digits
            assert alt >= chosen * (1 - 1e-3)
    finally:
        ps.ModelGraphs = ps_graphs


def test_a_tensor_parallel_plan_that_splits_no_op_gives_way_to_fewer_devices():
    # a link so slow that every plan dividing the work (batch, layers, ops) loses to running the
    # whole model on each rank: the fastest plan on both devices is a tp=2 that replicates every op,
    # the same step as one device, which the search writes instead and says so
    from polyparallel.cluster import Cluster
    from polyparallel.models import MLP

    cl = Cluster.from_dict({"name": "slow", "centers": [{"name": "c", "nodes": [
        {"device": "h100-sxm", "devices_per_node": 2, "intra": {"bandwidth": 1e6, "latency": 0.5}}]}]})
    example = (torch.randn(8, 32, generator=torch.Generator().manual_seed(0)), torch.randint(0, 10, (8,)))
    torch.manual_seed(0)
    s = search(MLP((32, 64, 64, 10)), example, cl, batch_size=8)
    assert (s.dp, s.tp, s.pp, s.mesh.devices) == (1, 1, 1, [0])
    [fewer] = [n for n in s.search.notes if n.startswith("uses 1 of the cluster's 2 devices")]
    assert "splits no op over tp=2" in fewer
    one = evaluate(MLP((32, 64, 64, 10)), example, cl, batch_size=8, dp=1)
    assert s.estimate.step_time_s == pytest.approx(one.estimate.step_time_s, rel=1e-9)
    # asked to use both devices, it keeps the replicated tp=2, whose note must not claim a split
    s = search(MLP((32, 64, 64, 10)), example, cl, batch_size=8, constraints={"devices": 2})
    assert s.tp == 2 and [p.placement for p in s.placements] == [""]
    [why] = [n for n in s.search.notes if n.startswith("why tp=")]
    assert "splits no op" in why and "fewer devices give the same step" in why
    assert "splits each op's loop dims" not in why
    assert s.estimate.step_time_s == pytest.approx(one.estimate.step_time_s, rel=1e-9)
    # tp=2 pinned: the user's choice stands (no "why tp=" line), and a note says it splits no op
    s = search(MLP((32, 64, 64, 10)), example, cl, batch_size=8, constraints={"tp": 2})
    assert s.tp == 2 and [p.placement for p in s.placements] == [""]
    assert not [n for n in s.search.notes if n.startswith("why tp=")]
    assert [n for n in s.search.notes if n.startswith("tp=2 as pinned splits no op")]


def test_search_writes_tensor_parallelism_only_as_the_backend_runs_it():
    """A GPT computing attention as explicit ops (scores, causal mask, softmax, dropout). The search
    once ranked its tp plans at the placements the polyhedral model derives while the backend ran
    every op replicated (dp2 tp4 written at 3.3x its price); then it left tp out. The backend now
    splits the products and the softmax over the heads: the written tp plan's placements are those,
    and its price is the price of the plan as written (evaluate with the same degrees and placements)."""
    import polyparallel as pp

    with torch.device("meta"):
        m = GPT(GPTConfig(vocab=32000, seq=2048, layers=8, hidden=12288, heads=96, dropout=0.1, attention="explicit"))
    ids = torch.zeros(1, 2048, dtype=torch.long)
    s = search(m, (ids,), "dgx-a100x1", example_kwargs={"labels": ids}, batch_size=8)
    assert s.tp > 1 and not any(n.startswith("left out tensor parallelism") for n in s.search.notes)
    assert {st.placed_by for st in s.stages} <= {"solver", "rule"}
    tp_of = {op: [x for x in p.placement.split(",") if x.endswith(":tp")] for p in s.placements for op in p.ops}
    assert tp_of["matmul"] == tp_of["matmul_1"] == ["b1:tp"] and tp_of["softmax"] == ["d1:tp"]
    written = pp.evaluate(m, (ids,), "dgx-a100x1", example_kwargs={"labels": ids}, batch_size=8, dp=s.dp, tp=s.tp,
                          pp=s.pp, microbatches=s.microbatches, zero_stage=s.zero_stage, recompute=s.recompute,
                          placements="torch")
    assert written.estimate.step_time_s == pytest.approx(s.estimate.step_time_s, rel=1e-9)


def test_a_collaborative_center_whose_tp_splits_no_op_uses_fewer_of_its_devices():
    """A small CNN on two centers of 4 A100s: each center's fastest plan on its 4 devices was a tp=4
    that replicates every op (Conv2d and BatchNorm are not split); the center now uses 1 of them, says
    so, and the collaborative backend runs that plan (a plain one-device center)."""
    from polyparallel.backends.collab import ModelSpec, config_from_strategy
    from polyparallel.cluster import Cluster

    node = {"device": "a100-80gb-sxm", "devices_per_node": 4, "intra": {"bandwidth": "300 GB/s", "latency": "3 us"}}
    cl = Cluster.from_dict({"name": "two", "centers": [
        {"name": n, "nodes": [node], "wan": {"bandwidth": "100 MB/s", "latency": "10 ms"}} for n in "ab"]})

    class SmallCNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
            self.fc = torch.nn.Linear(16 * 64, 10)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.bn(self.conv(x.view(-1, 1, 8, 8))))
            return torch.nn.functional.cross_entropy(self.fc(h.flatten(1)), labels)

    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    s = search(SmallCNN(), (x,), cl, example_kwargs={"labels": y}, batch_size=512,
               constraints={"mode": "collaborative"})
    assert s.mode == "collaborative"
    for c in s.collaborative.centers:
        assert len(c.devices) == 1 and c.local_strategy["tp"] == 1 and c.local_strategy["dp"] == 1
        [note] = [n for n in s.search.notes if n.startswith(f"center {c.name}: uses 1 of its 4 devices")]
        assert "splits no op over tp=4" in note
    cfg = config_from_strategy(s, ModelSpec("polyparallel.backends.torch._examples:tiny_mlp"))
    assert [cc.devices for cc in cfg.centers] == [1, 1]
    # pinned to tp=4: the user's choice stands, and the note says that it splits no op
    s = search(SmallCNN(), (x,), cl, example_kwargs={"labels": y}, batch_size=512,
               constraints={"mode": "collaborative", "tp": 4})
    for c in s.collaborative.centers:
        assert c.local_strategy["tp"] == 4 and len(c.devices) == 4
        assert all(pl == "" for _, pl, _ in c.local_strategy["op_placements"])  # every op replicated, as run
        assert any(n.startswith(f"center {c.name}: tp=4 as pinned splits no op") for n in s.search.notes)


def test_a_recipe_train_refuses_is_priced_with_the_refusal_first():
    """evaluate prices a pinned recipe whatever the executor runs, and says first what train would
    refuse (it wrote a tensor-parallel CNN without a word; train then refused it at launch)."""
    from polyparallel.backends.torch import Unsupported, plan_for

    class TinyCNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.Linear(8 * 64, 10)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.conv(x.view(-1, 1, 8, 8)))
            return torch.nn.functional.cross_entropy(self.fc(h.flatten(1)), labels)

    model, x, y = TinyCNN(), torch.randn(8, 64), torch.randint(0, 10, (8,))
    s = evaluate(model, (x,), "local-cpu:2", example_kwargs={"labels": y}, tp=2, batch_size=8)
    assert s.estimate is not None and s.tp == 2
    note = s.search.notes[0]
    assert note.startswith("planning only: the torch backend refuses this plan") and "Conv2d" in note
    with pytest.raises(Unsupported, match="Conv2d"):
        plan_for(s, model, (x, y))
    assert not any(n.startswith("planning only") for n in evaluate(
        model, (x,), "local-cpu:2", example_kwargs={"labels": y}, dp=2, batch_size=8).search.notes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_solver_never_writes_the_rules_placement_where_the_backend_does_not_run_it(tmp_path):
    """The rule's placement is always among an op's candidates (so the solver never prices above
    the rule), also where the torch backend cannot run it; on the collaborative zoo's CPU centers the
    solver chose it for HF ResNet's convolutions ('h:tp') and GPT-2's Conv1D columns, and every center
    plan pinned to tp=2 was refused. Such a stage is now the rule's where that runs, else replicated,
    as the backend executes it."""
    from benchmarks.collab_plan_zoo import CLUSTER
    from polyparallel.backends.torch import plan_for
    from tests.zoo import ZOO

    (tmp_path / "two.yaml").write_text(CLUSTER)
    model_fn, data_fn = ZOO["resnet"]
    x, y = data_fn(0)
    s = search(model_fn(), (x, y), str(tmp_path / "two.yaml"), batch_size=len(x),
               constraints={"mode": "collaborative", "tp": 2})
    for c in s.collaborative.centers:
        assert c.local_strategy["tp"] == 2 and all(pl == "" for _, pl, _ in c.local_strategy["op_placements"])
    sync = search(model_fn(), (x, y), "local-cpu:2", batch_size=len(x), constraints={"tp": 2})
    assert not any("tp" in p.placement and "conv" in p.ops[0] for p in sync.placements)
    plan_for(sync, model_fn(), (x, y))  # runs as written
