"""FSDP2 issues the collectives the cost model prices for ZeRO-1/2/3.

Two gloo ranks wrap the 2-layer tiny GPT as the torch backend does (``_worker._fully_shard``: a unit
per numbered layer, then the root) and run optimizer steps with ``m`` micro-batches under the
backend's gradient-sync policy (``_worker._gradient_sync``); FSDP2's all-gathers and
reduce-scatters are counted, with their bytes, by wrapping the two ``torch.distributed`` calls it
makes. The count of the second step (the first also initialises FSDP2's buffers) must equal the
list the cost model prices (``data_parallel.fsdp_collectives`` over ``data_parallel.fsdp_units`` of the captured
graph), and the step's price must be what those collectives cost.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polyparallel.backends.torch import _examples as ex

CASES = [(1, 1), (1, 2), (2, 2), (3, 1), (3, 2)]  # (ZeRO stage, micro-batches)


def _rank(rank: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from polyparallel.backends.torch._worker import _fully_shard, _gradient_sync

    # a file rendezvous (as test_exact_semantics): a probed free port can be taken by a test running
    # beside this one before the ranks bind it, and gloo then aborts the rank
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    seen: list[tuple[str, int]] = []
    real = {"all_gather": dist.all_gather_single, "reduce_scatter": dist.reduce_scatter_single}

    def counting(kind: str):
        def call(output, input, *a, **k):
            full = output if kind == "all_gather" else input
            seen.append((kind, full.numel() * full.element_size()))
            return real[kind](output, input, *a, **k)
        return call

    dist.all_gather_single = counting("all_gather")
    dist.reduce_scatter_single = counting("reduce_scatter")
    counts = {}
    for zero, m in CASES:
        torch.manual_seed(0)
        model = ex.tiny_gpt()
        assert _fully_shard(model, mesh, zero, {}) == ["h.0", "h.1"]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        plan = SimpleNamespace(data_parallel="fsdp", zero_stage=zero)
        for step in range(2):  # the first step also initialises FSDP2: count the second
            seen.clear()
            x, y = ex.gpt_data(step)
            x, y = x[rank::2], y[rank::2]
            opt.zero_grad(set_to_none=True)
            for j, (xj, yj) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
                if m == 1:  # the worker's step without accumulation
                    model(xj, yj).backward()
                    continue
                with _gradient_sync(model, plan, j == m - 1):
                    (model(xj, yj) / m).backward()
            opt.step()
        counts[zero, m] = sorted(seen)
    if rank == 0:
        torch.save(counts, out)
    # both ranks finish communicating before either tears down, and a rank leaves without the
    # interpreter's finalization: gloo's worker threads, still referenced by the device mesh, were
    # destroyed there and aborted the rank once in CI ("terminate called without an active exception")
    dist.barrier()
    del mesh
    dist.destroy_process_group()
    os._exit(0)


@pytest.fixture(scope="module")
def executed() -> dict[tuple[int, int], list[tuple[str, int]]]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "counts.pt")
        mp.spawn(_rank, args=(os.path.join(d, "store"), out), nprocs=2)
        return torch.load(out)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("zero", "m"), CASES)
def test_fsdp_step_issues_the_priced_collectives(executed, zero: int, m: int) -> None:
    # imported here, not by the spawned ranks, which import this module
    import polyparallel as pp
    from polyparallel._cli_cluster import load_cluster
    from polyparallel.cost_models import ParallelConfig
    from polyparallel.cost_models import data_parallel as dpar
    from polyparallel.cost_models import step as cost_step
    from polyparallel.cost_models.stage_layout import group_seconds

    x, y = ex.gpt_data(0)
    graph = pp.capture(ex.tiny_gpt(), (x[: ex.BATCH // 2 // m], y[: ex.BATCH // 2 // m]))
    cluster = load_cluster("local-cpu:2")
    cfg = ParallelConfig(dp=2, microbatches=m, zero_stage=zero, dtype="fp32", recompute="none", optimizer="sgd")
    terms = cost_step._stage_terms(graph, cluster, cfg, 1)
    units = dpar.fsdp_units(graph, cfg, terms, 0)
    n_params = sum(p.numel() for p in ex.tiny_gpt().parameters())
    assert len(units) == 3 and sum(w for w, _ in units) == n_params  # root, h.0, h.1
    priced = sorted((k, int(b)) for k, b in dpar.fsdp_collectives(units, zero, m, 4))
    second = executed[zero, m]
    print(f"ZeRO-{zero} m={m}: executed {Counter(k for k, _ in second)}, priced {Counter(k for k, _ in priced)}")
    assert second == priced
    # the step's data-parallel seconds before overlap are those collectives' prices
    prep = cost_step._prepare(graph, cluster, cfg)
    ccache = cost_step.PRICES.of(cluster)["collectives"]
    grp, gid = terms.dp_groups[0][0]
    assert prep.dp[0].t_dp == pytest.approx(sum(group_seconds(cluster, ccache, [e], grp, gid) for e in priced))
