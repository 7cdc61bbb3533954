"""Plan quality: the search's plan vs a brute force over the same space, and vs the usual recipes.

    nice .venv/bin/python benchmarks/plan_quality.py                 # every family on every cluster
    nice .venv/bin/python benchmarks/plan_quality.py --family gpt --cluster dgx-a100x1

For each (model family, cluster): the plan ``search`` chooses (synchronous mode, placements
``torch``), the **brute-force optimum** over the space the search claims to optimise, and three
recipes priced by ``evaluate`` (pure data parallel, FSDP = ZeRO-3, Megatron: tp = a node's devices,
the planner's pp, dp over the rest, Megatron's placements).

The brute force does not run the search: it walks every mesh shape the search admits (tp·sp inside
a node, sp <= 8, pp <= the numbered blocks, a pipeline across centers only where activations may
leave; on aisynergy-5 dp/tp/sp groups may cross centers: ``allow_wan``, as no synchronous plan
over its 88 devices exists otherwise), every micro-batch size the search captures for it
(every divisor up to MAX_MICRO and the whole replica batch), every schedule, every ZeRO x recomputation rung and
every placement candidate of the plan (the solver's derived placements and Megatron's,
``polyparallel.planning.derived.variants``), keeps those the torch backend executes
(``plan_problems``) and that fit in memory, and prices **each** in full with ``estimate_step``
(pipeline simulated; no bound, no pruning); its optimum is the fastest of those that the backend's
pre-launch check (``plan_for``) accepts on the module, as the search's last step requires.
The search instead walks micro-batch sizes largest first
and stops at the first that fits without a pipeline, tries with one the largest sizes giving at
least ``pp, 2pp, 4pp`` micro-batches, the smallest size and the whole batch, keeps the
first fitting rung past the free ones, and prices in full only the plans whose lower bound is below
the best found. ``gap`` = search / brute force - 1 (target: 0 on small cases, <= 2% on big ones).

The model graphs are captured once per family and shared by the search, the brute force and the
recipes. Writes benchmarks/results/plan_quality.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import polyparallel.planning.plan_search as ps
from backends.torch.capabilities import EXECUTED_DTYPES, plan_problems
from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.models import EXAMPLES
from polyparallel.planning import DoesNotFit, evaluate, search
from polyparallel.planning.derived import variants
from polyparallel.planning.executor_check import train_batch
from polyparallel.planning.model_graphs import ModelGraphs
from polyparallel.planning.place_plan import fits_memory

OUT = Path(__file__).parent / "results" / "plan_quality.json"
CLUSTERS = ("dgx-a100x1", "dgx-a100x8", "aisynergy-5")
PER_DEVICE = 8  # samples per device in the global batch


def _meta(fn):
    with torch.device("meta"):
        return fn()


def _lm(model, b, seq, vocab):
    ids = torch.zeros(b, seq, dtype=torch.long, device=next(model.parameters()).device)
    return model, (ids,), {"labels": ids}


def gpt():
    return EXAMPLES["gpt2-small"].build(2, 512)


def llama_gqa():
    return EXAMPLES["llama-1b"].build(2, 512, 8)  # 8 of LLaMA-1B's 16 layers: 32 query heads, 8 KV heads


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    from tests.zoo import _HFLoss

    cfg = T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                   num_heads=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    # on the CPU: T5's norm branches on its weight's dtype, which a meta-device export cannot trace
    return _lm(_HFLoss(T5ForConditionalGeneration(cfg), "input_ids"), 2, 256, 32128)


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    from tests.zoo import _HFLoss

    cfg = ViTConfig(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    intermediate_size=3072, num_labels=1000, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    m = _meta(lambda: _HFLoss(ViTForImageClassification(cfg), "pixel_values"))
    return m, (torch.zeros(2, 3, 224, 224, device="meta"),), {"labels": torch.zeros(2, dtype=torch.long,
                                                                                      device="meta")}


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.zoo import _HFLoss

    cfg = MixtralConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=512)
    return _lm(_HFLoss(MixtralForCausalLM(cfg), "input_ids"), 2, 256, 32000)


def resnet():
    return EXAMPLES["resnet50"].build(2, None)


def unet():
    from tests.zoo import UNet

    m = _meta(lambda: UNet(channels=3, classes=4, width=32))
    return m, (torch.zeros(2, 3, 512, 512, device="meta"),), {"labels": torch.zeros(2, 512, 512, dtype=torch.long,
                                                                                      device="meta")}


def mlp():
    return EXAMPLES["mlp"].build(2, None)


FAMILIES = {"gpt": gpt, "llama-gqa": llama_gqa, "t5": t5, "vit": vit, "mixtral": mixtral, "resnet": resnet,
            "unet-512": unet, "mlp": mlp}


def _constraints(cl: Cluster) -> dict:
    """Synchronous plans; on a multi-center cluster, with dp/tp/sp groups allowed across centers (no
    synchronous plan uses all of aisynergy-5's devices otherwise: its centers' sizes are uneven)."""
    return {"mode": "synchronous", **({"allow_wan": True} if len(cl.centers) > 1 else {})}


def brute_force(mdl: ModelGraphs, cl: Cluster, B: int, placements: str = "torch") -> tuple[object, int]:
    """The fastest fitting, executed plan of the search's space, every plan priced in full."""
    c = ps.Constraints(**_constraints(cl))
    devs = list(range(cl.num_devices))
    dtype = ps._default_dtype(cl, devs)
    enforce = placements == "torch" and dtype in EXECUTED_DTYPES
    g0 = mdl.graph(mdl.b0)
    layers = ps._layer_count(g0)
    node = ps._node_size(cl, devs)
    fitting, priced = [], 0
    for dp, tp, pp, sp, cp in ps._mesh_shapes(len(devs), c, node, layers, False, ps._attends(g0)):
        if B % dp:
            continue
        base = ParallelConfig(dp=dp, tp=tp, pp=pp, sp=sp, cp=cp, microbatches=1, dtype=dtype, devices=tuple(devs))
        wan_group, wan_pipe = ps._crosses_wan(cl, base, devs)
        if (wan_group and not c.allow_wan) or (wan_pipe and not all(ce.activations_may_leave for ce in cl.centers)):
            continue
        for b in mdl.micro_sizes(B // dp, False, whole=enforce):
            graph = mdl.graph(b)
            for ladder in ps._plans(replace(base, microbatches=B // dp // b), c, layers):
                for cfg in ladder:
                    if enforce and plan_problems(g0, cfg):
                        continue
                    for v in variants(graph, g0, cl, cfg, placements):
                        try:
                            est = estimate_step(graph, cl, replace(cfg, op_plans=v))
                        except ValueError:
                            continue
                        priced += 1
                        if fits_memory(est, None):
                            fitting.append((est.step_time, priced, est, b))
    # the fastest that the torch backend's own pre-launch check accepts on the module (as the search's
    # last step does: plan_for sees what plan_problems cannot, e.g. 12 heads over tp=8)
    from polyparallel.backends.torch import Unsupported, plan_for
    from polyparallel.strategy import SearchRecord

    batch = train_batch(mdl, B) if placements == "torch" else None
    for _, _, est, b in sorted(fitting, key=lambda x: x[:2]):
        if batch is None:
            return est, priced
        strat = ps.strategy_of(mdl, cl, est, b, B, devs, SearchRecord(), placements)
        try:
            plan_for(strat, mdl.model, batch if strat.pp > 1 else None, graph=mdl.exact(b))
            return est, priced
        except Unsupported:
            continue
    return None, priced


def _cfg_text(x) -> str:
    sched = x.schedule if getattr(x, "chunks", 1) == 1 else f"interleaved:{x.chunks}"
    return (f"dp{x.dp} tp{x.tp} pp{x.pp} sp{x.sp} m{x.microbatches} {sched} z{x.zero_stage} "
            f"{x.recompute}")


def one(family: str, cluster: str) -> dict:
    m, a, k = FAMILIES[family]()
    cl = Cluster.resolve(cluster)
    B = PER_DEVICE * cl.num_devices
    t = time.perf_counter()
    shared = ModelGraphs(m, a, k)
    ps.ModelGraphs = lambda *_, **__: shared  # one capture serves search, brute force and recipes
    try:
        row: dict = {"family": family, "cluster": cluster, "global_batch": B}
        t0 = time.process_time()
        try:
            s = search(m, a, cl, example_kwargs=k, batch_size=B, constraints=_constraints(cl))
        except DoesNotFit as e:
            row["error"] = str(e)[:200]
            return row
        row["search_cpu_s"] = round(time.process_time() - t0, 2)
        row["search"] = {"plan": _cfg_text(s), "step_time_s": s.estimate.step_time_s,
                         "placed_by": sorted({st.placed_by for st in s.stages}),
                         "planning_only": any("planning only" in n for n in s.search.notes)}
        t0 = time.process_time()
        bf, priced = brute_force(shared, cl, B)
        row["brute_cpu_s"] = round(time.process_time() - t0, 2)
        row["brute_force"] = None if bf is None else {
            "plan": _cfg_text(bf.config), "step_time_s": bf.step_time, "plans_priced": priced,
            "placements": getattr(bf.config.op_plans, "source", "none")}
        if bf is not None:
            row["gap"] = s.estimate.step_time_s / bf.step_time - 1
        node = min(len(n.devices) for n in cl.nodes)
        recipes = {"data parallel": {"tp": 1, "pp": 1, "zero_stage": 0}, "FSDP": {"tp": 1, "pp": 1, "zero_stage": 3},
                   "Megatron": {"tp": node, "pp": max(1, s.pp)}}
        for name, kw in recipes.items():
            try:
                r = evaluate(m, a, cl, example_kwargs=k, batch_size=B, **kw)
                row[name] = r.estimate.step_time_s if not r.search.notes else None
            except ValueError as e:
                row[name] = None
                row[name + "_why"] = str(e)[:160]
    finally:
        ps.ModelGraphs = ModelGraphs
    row["wall_s"] = round(time.perf_counter() - t, 1)
    return row


def _fmt(v) -> str:
    return "   n/a   " if v is None else f"{v * 1e3:9.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", action="append", choices=list(FAMILIES))
    ap.add_argument("--cluster", action="append", choices=list(CLUSTERS))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    out = args.out
    warnings.simplefilter("ignore")
    res = json.loads(out.read_text()) if out.exists() else {}
    rows = {(r["family"], r["cluster"]): r for r in res.get("rows", [])}
    print(f"load {os.getloadavg()[0]:.1f}")
    print(f"{'family':10s} {'cluster':12s} {'search ms':>9s} {'brute ms':>9s} {'gap':>7s} {'DP ms':>9s} "
          f"{'FSDP ms':>9s} {'Megatron':>9s}  search plan | brute-force plan")
    for cl in args.cluster or CLUSTERS:  # the one-node cases first: the quickest
        for fam in args.family or FAMILIES:
            try:
                r = one(fam, cl)
            except Exception as e:  # a model that does not capture: recorded, the others still run
                r = {"family": fam, "cluster": cl, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows[(fam, cl)] = r
            if "error" in r:
                print(f"{fam:10s} {cl:12s} {r['error']}")
                continue
            bf = r["brute_force"] or {}
            gap = r.get("gap")
            print(f"{fam:10s} {cl:12s} {_fmt(r['search']['step_time_s'])} {_fmt(bf.get('step_time_s'))} "
                  f"{'  n/a' if gap is None else f'{100 * gap:+6.2f}%'} {_fmt(r['data parallel'])} "
                  f"{_fmt(r['FSDP'])} {_fmt(r['Megatron'])}  {r['search']['plan']} | {bf.get('plan')} "
                  f"({bf.get('placements')}; {bf.get('plans_priced')} plans; cpu search {r['search_cpu_s']} s, "
                  f"brute {r['brute_cpu_s']} s)", flush=True)
            res["rows"] = sorted(rows.values(), key=lambda x: (x["family"], x["cluster"]))
            res["load"] = os.getloadavg()[0]
            out.parent.mkdir(exist_ok=True)
            out.write_text(json.dumps(res, indent=1, default=lambda o: None if isinstance(o, float) and
                                      math.isnan(o) else str(o)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
