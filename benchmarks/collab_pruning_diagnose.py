"""Why a pruned row of ``benchmarks/collab_pruning.py`` loses what it loses: one arm of that benchmark's
setting (Fashion-MNIST, 12k rows, 3 centers by Dirichlet(0.3), FedAvg, 20 local steps, SGD 0.05 with
momentum 0.9, cosine) run with the test accuracy after every round, plus the final model's accuracy
with its BatchNorm statistics recomputed on the pooled training rows (a diagnostic only: no center
hands its rows to anyone in a job).

Arms (``--arm``):

- ``online``: online pruning (``PruneSpec(--ratio, rounds=--k)``, the defaults otherwise); with
  ``--no-soft`` no mask before round ``K`` (the full ratio at the cut, as ``once`` does it, inside the
  same rounds);
- ``unpruned``: the full model (``--max-rounds`` stops early, for its accuracy at the cut's round);
- ``dense``: the architecture a benchmark row's plan leaves (``--plan RESULTS.json:MODEL:ROW``), trained
  from its fresh initialisation by the same federation: what a model of that size reaches at all.

The committed diagnosis of the ResNet at 50%, seed 0 (``benchmarks/results/collab_pruning_diagnose.json``;
docs/collab.md, "Why the ResNet loses 1.91 points")::

    D="nice -n 10 .venv/bin/python benchmarks/collab_pruning_diagnose.py"
    $D --arm online --ratio 0.5 --out /tmp/pd/online05.json
    $D --arm dense --plan benchmarks/results/collab_pruning.json:resnet:online:0.5 --out /tmp/pd/dense05.json
    $D --arm online --ratio 0.5 --no-soft --out /tmp/pd/nosoft05.json
    $D --arm unpruned --max-rounds 12 --out /tmp/pd/unpruned12.json
    $D --arm online --ratio 0.5 --rounds 111 --no-traj --out /tmp/pd/online111.json

Distillation after the cut (``benchmarks/results/collab_pruning_distill.json``'s ``trajectories``)::

    $D --arm online --ratio 0.5 --out /tmp/kd/traj_control.json
    $D --arm online --ratio 0.5 --distill 0.5 --distill-temperature 4 --out /tmp/kd/traj_cut.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples")]  # the user models (models.*) and the Fashion-MNIST loader

import torch  # noqa: E402
from collab_fashion_mnist import DATA_DIR, load_fashion_mnist, split  # noqa: E402

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, run_inprocess  # noqa: E402
from polyparallel.backends.collab._center import evaluate_torch  # noqa: E402
from polyparallel.backends.collab._models import build_torch_model, load_torch_state, torch_state  # noqa: E402
from polyparallel.backends.collab._pruning import PruneSpec, apply_plan, example_input  # noqa: E402

MODELS = {"resnet": "models.resnet_small:resnet", "vit": "models.vit_patch:vit"}


def recalibrated(spec: ModelSpec, model: torch.nn.Module, x: np.ndarray, xte: np.ndarray,
                 yte: np.ndarray) -> float | None:
    """Test accuracy of ``model`` with its BatchNorm statistics recomputed over ``x`` (None without BatchNorm)."""
    m = copy.deepcopy(model)
    bns = [b for b in m.modules() if isinstance(b, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return None
    for b in bns:
        b.reset_running_stats()
        b.momentum = None  # a plain average over the batches
    m.train()
    with torch.no_grad():
        for i in range(0, len(x), 500):
            m(torch.from_numpy(x[i:i + 500]))
    m.eval()
    return evaluate_torch(spec, torch_state(m), xte, yte, model=m)["accuracy"]


def dense_spec(plan_ref: str) -> ModelSpec:
    """A model spec for the architecture of a benchmark row's plan (``RESULTS.json:MODEL:ROW``), registered
    as a module of this process (the in-process engine builds every center's model here)."""
    f, mname, row = plan_ref.split(":", 2)
    plan = json.loads(Path(f).read_text())["models"][mname]["rows"][row]["plan"]
    kind = MODELS.get(mname, mname)

    def cut() -> torch.nn.Module:
        net = build_torch_model(ModelSpec(kind))
        apply_plan(net, torch.zeros(2, 1, 28, 28), plan)
        return net

    mod = types.ModuleType("pp_pruned_arch")
    mod.cut = cut
    sys.modules["pp_pruned_arch"] = mod
    return ModelSpec("pp_pruned_arch:cut")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arm", required=True, choices=("online", "unpruned", "dense"))
    ap.add_argument("--model", default="resnet", help="resnet, vit or MODULE:FUNCTION")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--max-rounds", type=int, default=0, help="stop after this many rounds (0: all)")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--no-soft", action="store_true", help="online: no mask before round K")
    ap.add_argument("--distill", type=float, default=0.0, help="online: PruneSpec.distill (0: off)")
    ap.add_argument("--distill-temperature", type=float, default=4.0, help="online: PruneSpec.distill_temperature")
    ap.add_argument("--distill-teacher", default="cut", help="online: PruneSpec.distill_teacher (cut or round)")
    ap.add_argument("--no-traj", action="store_true", help="evaluate the final model only")
    ap.add_argument("--plan", default="", help="dense: RESULTS.json:MODEL:ROW of benchmarks/collab_pruning.py")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.arm == "dense" and not a.plan:
        ap.error("--arm dense needs --plan RESULTS.json:MODEL:ROW")
    if a.no_soft:  # the full ratio at round K, nothing masked before
        PruneSpec.sparsity = lambda self, t: self.ratio if t >= self.rounds else 0.0

    xtr, ytr, xte, yte = load_fashion_mnist(Path(DATA_DIR))
    pick = np.random.default_rng(a.seed).choice(len(ytr), 12000, replace=False)  # as the benchmark draws them
    xtr, ytr = xtr[pick], ytr[pick]
    parts = split(ytr, 3, 0.3, a.seed)
    names = [f"c{i}" for i in range(3)]
    data = {n: (xtr[p], ytr[p]) for n, p in zip(names, parts)}
    spec = dense_spec(a.plan) if a.arm == "dense" else ModelSpec(MODELS.get(a.model, a.model))
    prune = PruneSpec(a.ratio, rounds=a.k, distill=a.distill, distill_temperature=a.distill_temperature,
                      distill_teacher=a.distill_teacher) if a.arm == "online" else None
    cfg = CollabConfig(centers=tuple(CenterSpec(n, samples=len(p)) for n, p in zip(names, parts)), model=spec,
                       fusion="fedavg", rounds=a.rounds, local_steps=20, batch_size=32, lr=0.05, momentum=0.9,
                       lr_schedule="cosine", seed=a.seed, prune=prune)
    t0 = time.time()
    res = run_inprocess(cfg, data, eval_data=None if a.no_traj else (xte, yte), max_rounds=a.max_rounds or None)
    final = build_torch_model(spec)
    if res.pruning and res.pruning.get("plan"):
        apply_plan(final, example_input(xte[:1]), res.pruning["plan"])
    load_torch_state(final, dict(res.params))
    out = {"args": vars(a), "accuracy_per_round": [r.eval.get("accuracy") for r in res.rounds],
           "final": evaluate_torch(spec, dict(res.params), xte, yte, model=final)["accuracy"],
           "final_bn_recalibrated_pooled": recalibrated(spec, final, xtr, xte, yte),
           "params": sum(p.numel() for p in final.parameters()), "wall_s": time.time() - t0,
           "masks": res.pruning["masks"] if res.pruning else None}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("final", "final_bn_recalibrated_pooled", "params", "wall_s")}))


if __name__ == "__main__":
    main()
