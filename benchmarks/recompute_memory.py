"""Activation memory with recomputation: the memory model's bytes against what torch keeps.

For each model and recomputation mode (``none``, ``selective``, ``full``), one forward of the
micro-batch on this process with the torch backend's recomputation applied
(``backends/torch/_recompute.py``); *measured* is what the forward leaves alive for the backward
(:func:`~polyparallel.backends.torch._recompute.retained_activation_bytes`: every storage an ATen op
wrote that is still referenced, counted once), *predicted* the ``activations`` term the search
prices for the same graph (``ModelGraphs(model, args, kwargs).graph(b)``, ``estimate_step`` on
``local-cpu:1``, fp32, the planner's defaults). Then the same per pipeline stage of a pp=2 plan
(:func:`stage_rows`: what each stage holds after one micro-batch's forward, its chunk recomputing
as the pipeline workers make it). Prints the tables and writes
``benchmarks/results/recompute_memory.json``.

    .venv/bin/python benchmarks/recompute_memory.py
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("none", "selective", "op", "full")


def hf_llama_training() -> Any:
    """``tests/zoo.py``'s HF LLaMA without its KV cache (HF keeps one in training unless told, as
    ``gradient_checkpointing_enable`` does; the cache would hold every layer's keys and values)."""
    from tests.zoo import ZOO

    m = ZOO["llama"][0]()
    m.model.config.use_cache = False
    return m


def models() -> dict[str, tuple[Callable[[], Any], Callable[[int], Any]]]:
    from polyparallel.backends.torch import _examples as ex
    from tests.zoo import ZOO

    return {"tiny-gpt": (ex.tiny_gpt, ex.gpt_data), "hf-llama": (hf_llama_training, ZOO["llama"][1])}


def predicted(model: Any, x: Any, y: Any, mode: str) -> float:
    """The activation bytes the search prices for one micro-batch ``x`` of ``model`` under ``mode``."""
    from polyparallel.cluster import Cluster
    from polyparallel.cost_models.step import ParallelConfig, estimate_step
    from polyparallel.planning.model_graphs import ModelGraphs

    g = ModelGraphs(model, (x,), {"labels": y}).graph(int(x.shape[0]))
    est = estimate_step(g, Cluster.preset("local-cpu:1"),
                        ParallelConfig(recompute=mode))
    return est.memory[0].term("activations")


def measured(model_fn: Callable[[], Any], x: Any, y: Any, mode: str) -> int:
    """Bytes one forward leaves for the backward with ``mode`` applied as the torch backend applies it."""
    import torch

    import polyparallel as pp
    from polyparallel.backends.torch._recompute import apply_recompute, recompute_blocks, retained_activation_bytes

    torch.manual_seed(0)
    m = model_fn()
    blocks = recompute_blocks(pp.capture(m, (x, y))) if mode in ("full", "op") else ()
    apply_recompute(m, mode, blocks)
    return retained_activation_bytes(m, x, y)


def stage_rows(name: str, strategy: Any, model_fn: Callable[[], Any], data_fn: Callable[[int], Any]
               ) -> list[dict[str, Any]]:
    """Per pipeline stage of ``strategy`` (``pp > 1``) and recomputation mode: *measured*, the bytes
    the stage holds after one micro-batch's forward with ``_recompute.recompute_chunk`` applied to
    its chunk as the pipeline workers apply it (``retained_stage_bytes``: saved tensors, kept
    checkpoint inputs and the stage's outputs; the last stage runs the loss tail); *predicted*, the
    ``activations`` term of that stage in ``estimate_step`` for the strategy's degrees, micro-batch
    graph and schedule with that mode, per micro-batch (divided by the micro-batches in flight)."""
    import torch

    from polyparallel.backends.torch import plan_for
    from polyparallel.backends.torch._pipeline import split_model
    from polyparallel.backends.torch._recompute import recompute_blocks, recompute_chunk, retained_stage_bytes
    from polyparallel.backends.torch._tensor_parallel import strategy_graph
    from polyparallel.cluster import Cluster
    from polyparallel.cost_models.step import ParallelConfig, chunk_of_ops, estimate_step

    s = strategy
    x, y = data_fn(0)
    mb = s.global_batch // (s.dp * s.microbatches)
    graph = strategy_graph(s, model_fn, (x, y), check=True)
    cuts = plan_for(s, model_fn(), (x, y), graph=graph).pipeline.cuts
    blocks = recompute_blocks(graph)
    out = []
    for mode in MODES:
        cfg = ParallelConfig(dp=s.dp, pp=s.pp, microbatches=s.microbatches, schedule=s.schedule.partition(":")[0],
                             zero_stage=s.zero_stage, recompute=mode)
        cluster = Cluster.preset(f"local-cpu:{s.dp * s.pp}")
        est = estimate_step(graph, cluster, cfg)
        assert max(chunk_of_ops(graph, cfg)) == s.pp - 1
        torch.manual_seed(0)
        split = split_model(model_fn(), x[:mb], y[:mb], cuts)
        acts: tuple[Any, ...] = (x[:mb],)
        for k, chunk in enumerate(split.chunks):
            recompute_chunk(chunk, mode, blocks)
            ins = acts if k == 0 else tuple(a.detach().requires_grad_(a.is_floating_point()) for a in acts)
            last = k == len(split.chunks) - 1
            meas = retained_stage_bytes(chunk, *ins, tail=split.tail if last else None, labels=y[:mb] if last else None)
            with torch.no_grad():
                acts = chunk(*ins)
            pred = est.memory[k].term("activations") / est.memory[k].in_flight  # one micro-batch's
            out.append({"model": name, "stage": k, "recompute": mode, "measured_bytes": meas,
                        "predicted_bytes": pred, "error": pred / meas - 1})
    return out


def rows() -> list[dict[str, Any]]:
    out = []
    for name, (model_fn, data_fn) in models().items():
        x, y = data_fn(0)
        for mode in MODES:
            pred, meas = predicted(model_fn(), x, y, mode), measured(model_fn, x, y, mode)
            out.append({"model": name, "batch": int(x.shape[0]), "recompute": mode, "measured_bytes": meas,
                        "predicted_bytes": pred, "error": pred / meas - 1})
    return out


def pipeline_rows() -> list[dict[str, Any]]:
    """:func:`stage_rows` of the pp=2 plan (1F1B, 2 micro-batches, ``recompute="full"``) the search
    writes for each model on ``local-cpu:2``."""
    import polyparallel as pp
    from polyparallel.backends.torch import _examples as ex
    from tests.zoo import BATCH, ZOO

    out = []
    for name, model_fn, data_fn, batch in (("tiny-gpt", ex.tiny_gpt, ex.gpt_data, ex.BATCH),
                                           ("hf-llama", *ZOO["llama"], BATCH)):
        x, y = data_fn(0)
        s = pp.search(model_fn(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=batch,
                      constraints={"pp": 2, "tp": 1, "recompute": "full", "microbatches": 2, "schedule": "1f1b",
                                   "dp": 1})
        out += stage_rows(name, s, model_fn, data_fn)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recompute_memory.json"))
    a = ap.parse_args()
    rs = rows()
    print(f"{'model':10} {'recompute':10} {'measured':>10} {'predicted':>10} {'error':>8}")
    for r in rs:
        print(f"{r['model']:10} {r['recompute']:10} {r['measured_bytes']:10d} {r['predicted_bytes']:10.0f} "
              f"{r['error']:+8.1%}")
    ps = pipeline_rows()
    print(f"\npipeline stages (pp=2, per micro-batch)\n{'model':10} {'stage':>5} {'recompute':10} {'measured':>10} "
          f"{'predicted':>10} {'error':>8}")
    for r in ps:
        print(f"{r['model']:10} {r['stage']:5d} {r['recompute']:10} {r['measured_bytes']:10d} "
              f"{r['predicted_bytes']:10.0f} {r['error']:+8.1%}")
    Path(a.out).write_text(json.dumps({"device": "cpu", "dtype": "fp32", "rows": rs, "pipeline_rows": ps},
                                      indent=1) + "\n")


if __name__ == "__main__":
    main()
