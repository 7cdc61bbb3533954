"""Online pruning across collaborative centers (issue 35) on Fashion-MNIST: what the pruned release
costs and how well it does, against the unpruned collaborative model and against pruning once after
training.

Setting: Debian's ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``), ``--train`` rows drawn
at random from the 60k training images (12k by default, to fit 2 shared CPU cores), split over 3 centers
by Dirichlet(0.3) label skew (``examples/collab_fashion_mnist.py``'s split); accuracy on the official 10k
test images. FedAvg, local SGD with momentum, a cosine learning rate over the rounds. Two user models
given as ``--model MODULE:FUNCTION`` would be: ``models.resnet_small:resnet`` (3 residual stages of 8, 16,
32 channels with BatchNorm, about 20k parameters) and ``models.vit_patch:vit`` (a vision transformer over
7×7 patches, width 48, 2 blocks of 4 heads, MLP 192, about 60k parameters), both in ``examples/models``;
``resnet16`` (``models.resnet_small:resnet16``) is the ResNet at the CIFAR ResNets' widths (16, 32, 64
channels, 78k parameters), on which no setting was chosen.

Arms, per model, the same data, seed, rounds ``R`` and local steps ``H``:

- ``unpruned``: the collaborative model, ``R`` rounds;
- ``online``: ``PruneSpec(ratio, rounds=K, score)``: centers score channel groups, the server fuses the
  scores and soft-masks on a cubic schedule in rounds ``1..K``, cuts after round ``K``, and the remaining
  ``R - K`` rounds fine-tune the smaller model (``backends/collab/_pruning.py``);
- ``once`` (prune once after training): from the ``unpruned`` model, one more round in which the centers
  train and score (the same score), the cut at the full ratio at once, then the same ``R - K``
  fine-tuning rounds (a fresh cosine schedule over those ``1 + R - K`` rounds).

``ratio`` is ``--prune RATIO``: the target sparsity, the share of the model's *parameters* the cut
removes (``--target params``, the default; at least that share, since whole channels go: the server
bisects over the channel ratio, ``_pruning.channel_ratio_for``); ``--target channels`` makes it the share
of every prunable group's channels, as before. ``--allocation`` spreads the removed channels uniformly
over the groups or by one global ranking of the fused scores (``PruneSpec.allocation``). Groups whose
cut would change what the model computes (a transformer's residual stream read by LayerNorm, see
``kept_whole``) stay whole, so a high parameter target can be out of reach: the row says so.
Parameters and FLOPs (2 × multiply-accumulates of one
image) are Torch-Pruning's counts, latency is the median eval-mode forward on one thread at batch 1 and
32 (``_release.latency_s``), accuracy is on the 10k test images; each pruned arm also writes a release
(``model.pt2``, ``model.onnx`` checked by onnxruntime on the test images) into a temporary directory.

Settings (``--rounds 60 --local-steps 20 --lr 0.05 --momentum 0.9 --prune-rounds 10 --score fisher``) were
chosen by an earlier session on the ResNet's ``online`` row at seed 0 (K in 5/10/20/30 and the score,
with ``--target channels``); ``--target params --allocation global`` (the defaults) on the ``online`` rows
at 0.5 of both models at seed 0 (``--tuned resnet:online:0.5,vit:online:0.5 --tuned-seed 0``). Seeds 1
and 2 (other rows drawn, another split and initialisation) are held out (``held_out``), as is every
other row. ``unpruned-long`` and ``online-long`` (only when named in ``--only``) train the unpruned
model, and prune online (the cut after round ``K`` as ``online``), for as many rounds as the ``once``
arm's model gets in all (``2R + 1 - K``): the references at equal training.

Run (the committed tables; ``--cache`` keeps each unpruned model, so a later run of the same seed
starts from it; one benchmark at a time on the shared 2-core machine: at load average 1-4 a ViT row
takes 0.5-2 minutes, a ResNet row 2-4, the first run of a seed adds its unpruned models' 1-9 minutes)::

    B="nice -n 10 .venv/bin/python benchmarks/collab_pruning.py --cache /tmp/pr/cache \
       --tuned resnet:online:0.5,vit:online:0.5"
    $B --models resnet --only resnet:online:0.5 --out /tmp/pr/t_res.json    # seed 0: the tuning rows
    $B --models vit --only vit:online:0.5 --out /tmp/pr/t_vit.json
    for row in vit:online:0.3 vit:online:0.7 vit:once:0.3 vit:once:0.5 vit:once:0.7 resnet:online:0.3 \
               resnet:online:0.7 resnet:once:0.3 resnet:once:0.5 resnet:once:0.7; do   # seed 0, the other rows
      $B --models ${row%%:*} --only $row --out /tmp/p1/$(echo $row | tr : _).json; done
    for m in vit resnet; do   # seed 0 at equal training: both arms 2R + 1 - K = 111 rounds
      $B --models $m --only $m:online-long:0.5,$m:unpruned-long --out /tmp/p2/${m}_long_s0.json; done
    $B --merge /tmp/pr/t_res.json,/tmp/pr/t_vit.json,$(ls /tmp/p1/*.json /tmp/p2/*_long_s0.json | paste -sd,) \
       --remeasure-latency --out benchmarks/results/collab_pruning.json
    for s in 1 2; do $B --models resnet,vit --only resnet:online:0.5,vit:online:0.5,resnet:once:0.5,vit:once:0.5 \
       --seed $s --out benchmarks/results/collab_pruning_seed$s.json; done
    for s in 1 2; do for row in vit:online:0.3 vit:online:0.7 resnet:online:0.3 resnet:online:0.7 \
                             vit:once:0.3 vit:once:0.7 resnet:once:0.3 resnet:once:0.7; do  # held out
       $B --models ${row%%:*} --only $row --seed $s --out /tmp/pr35/held/s${s}_$(echo $row | tr : _).json; done
       $B --merge benchmarks/results/collab_pruning_seed$s.json,$(ls /tmp/pr35/held/s${s}_*.json | paste -sd,) \
          --out benchmarks/results/collab_pruning_seed$s.json; done

The ResNet at the CIFAR widths, every seed held out (``results/collab_pruning_resnet16.json``)::

    B="nice -n 10 .venv/bin/python benchmarks/collab_pruning.py --cache /tmp/w16/cache \
       --tuned resnet:online:0.5,vit:online:0.5 --models resnet16"
    L=resnet16:online-long:0.5,resnet16:unpruned-long
    $B --only resnet16:online:0.3,resnet16:online:0.5,resnet16:online:0.7,resnet16:once:0.3,resnet16:once:0.5,\
    resnet16:once:0.7,$L --seed 0 --out /tmp/w16/s0.json
    $B --merge /tmp/w16/s0.json --remeasure-latency --out /tmp/w16/s0_lat.json
    for s in 1 2 3 4 5; do $B --only resnet16:online:0.5,resnet16:once:0.5,$L --seed $s --out /tmp/w16/s$s.json; done

Without ``--only`` a run takes every row of its models. Latencies taken in the runs are at the load
the machine had (``load_avg`` in the setting); ``--remeasure-latency`` times every architecture again
in one process, interleaved, and keeps the in-run figures as ``latency_ms_in_run``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples")]  # the user models (models.*) and the Fashion-MNIST loader

from collab_fashion_mnist import DATA_DIR, load_fashion_mnist, split  # noqa: E402

from polyparallel.backends.collab import (  # noqa: E402
    CenterSpec,
    CollabConfig,
    ModelSpec,
    _engine,
    run_inprocess,
)
from polyparallel.backends.collab._center import evaluate_torch  # noqa: E402
from polyparallel.backends.collab._models import build_torch_model, load_torch_state  # noqa: E402
from polyparallel.backends.collab._pruning import PruneError, PruneSpec, channels_of, example_input  # noqa: E402
from polyparallel.backends.collab._release import latency_s, size_of, write_release  # noqa: E402

MODELS = {"resnet": "models.resnet_small:resnet", "resnet16": "models.resnet_small:resnet16",
          "vit": "models.vit_patch:vit"}


def _cpu_capability() -> str:
    """The instruction set torch's CPU kernels run with (``AVX512``, ``AVX2``, ...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), or the platform's word for it."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def warm_start(params: Mapping[str, np.ndarray]) -> Iterator[None]:
    """Jobs started inside begin from ``params`` instead of the model's fresh initialisation (the
    in-process engine's ``initial_params``): the ``once`` arm continues the unpruned model."""
    saved = _engine.initial_params
    _engine.initial_params = lambda config: {k: np.array(v) for k, v in params.items()}
    try:
        yield
    finally:
        _engine.initial_params = saved


def unpruned_row(spec: ModelSpec, params: Mapping[str, np.ndarray], xte: np.ndarray, yte: np.ndarray) -> dict:
    model = build_torch_model(spec)
    load_torch_state(model, dict(params))
    model.eval()
    n, f = size_of(model, example_input(xte[:1]))
    return {"params": n, "flops": f, "accuracy": evaluate_torch(spec, params, xte, yte, model=model)["accuracy"],
            "latency_ms": {str(b): 1e3 * latency_s(model, xte, b) for b in (1, 32)}}


def pruned_row(cfg: CollabConfig, res: Any, xte: np.ndarray, yte: np.ndarray) -> dict:
    with tempfile.TemporaryDirectory() as d:
        rel = write_release(Path(d) / "rel", cfg, res.params, res.pruning, (xte, yte))
    return {"params": rel["params_after"], "flops": rel["flops_after"], "accuracy": rel["accuracy_after"],
            "accuracy_before_cut": rel["accuracy_before"], "accuracy_at_cut": rel["accuracy_at_cut"],
            "latency_ms": {b: 1e3 * v for b, v in rel["latency_s"]["after"].items()},
            "onnx_max_abs_diff": rel["onnx_check"]["max_abs_diff"],
            "onnx_argmax_agreement": rel["onnx_check"]["argmax_agreement"],
            "kept_whole": rel["pruning"]["kept_whole"], "heads": rel["pruning"]["heads"],
            "groups_cut": len(channels_of(rel["pruning"]["plan"])), "plan": rel["pruning"]["plan"],
            "channel_ratio": rel["pruning"]["masks"][-1].get("channel_ratio")}


def trained(cfg: CollabConfig, data: Mapping[str, Any], cache: str, key: str) -> tuple[dict, float]:
    """The unpruned job's parameters and seconds, from ``cache/key.npz`` when an earlier run of the same
    setting left them there (the unpruned arm does not depend on the pruning options)."""
    path = Path(cache) / f"{key}.npz" if cache else None
    if path is not None and path.exists():
        with np.load(path) as z:
            return {k: z[k] for k in z.files if k != "__wall_s"}, float(z["__wall_s"])
    t0 = time.time()
    params = dict(run_inprocess(cfg, data).params)
    wall = time.time() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, __wall_s=np.float64(wall), **params)
    return params, wall


def unpruned_from(args: argparse.Namespace, mname: str, setting: Mapping[str, Any]) -> dict:
    """The ``unpruned`` row of ``mname`` in ``--unpruned-from``'s JSON (a run of this script), which must have
    the same setting as this run; marked with the file it came from."""
    path = args.unpruned_from
    res = json.loads(Path(path).read_text())
    keys = ("data", "train_rows", "test_rows", "centers", "alpha", "center_sizes", "rounds", "local_steps", "batch",
            "lr", "momentum", "seed")
    diff = [k for k in keys if res["setting"].get(k) != setting[k]]
    if diff or mname not in res.get("models", {}) or "unpruned" not in res["models"][mname]["rows"]:
        raise SystemExit(f"--unpruned-from {path}: no unpruned {mname} row of this setting "
                         f"({'differs in ' + ', '.join(diff) if diff else 'model not in it'})")
    return {**res["models"][mname]["rows"]["unpruned"], "from": path}


def held_out(args: argparse.Namespace, model: str, arm: str, seed: int) -> bool:
    """Whether no setting was chosen on this row: any row but ``--tuned``'s at ``--tuned-seed``."""
    return f"{model}:{arm}" not in args.tuned.split(",") or seed != args.tuned_seed


def run(args: argparse.Namespace) -> dict:
    xtr, ytr, xte, yte = load_fashion_mnist(Path(args.data))
    rng = np.random.default_rng(args.seed)
    pick = rng.choice(len(ytr), args.train, replace=False)
    xtr, ytr = xtr[pick], ytr[pick]
    if args.test:
        xte, yte = xte[:args.test], yte[:args.test]
    parts = split(ytr, args.centers, args.alpha, args.seed)
    names = [f"c{i}" for i in range(args.centers)]
    data = {n: (xtr[p], ytr[p]) for n, p in zip(names, parts)}
    K = args.prune_rounds or args.rounds // 2
    only = set(args.only.split(",")) if args.only else None
    out: dict[str, Any] = {
        "setting": {"data": "Fashion-MNIST (Debian dataset-fashion-mnist)", "train_rows": args.train,
                    "test_rows": len(yte), "centers": args.centers, "alpha": args.alpha,
                    "center_sizes": [len(p) for p in parts],
                    "center_labels": [np.bincount(ytr[p], minlength=10).tolist() for p in parts],
                    "rounds": args.rounds, "local_steps": args.local_steps, "batch": args.batch, "lr": args.lr,
                    "momentum": args.momentum, "lr_schedule": "cosine", "fusion": "fedavg",
                    "prune_rounds": K, "prune_warmup": args.prune_warmup, "score": args.score,
                    "distill": args.distill, "distill_temperature": args.distill_temperature,
                    "distill_teacher": args.distill_teacher,
                    "score_batches": args.score_batches,
                    "target": args.target, "allocation": args.allocation, "heads": args.heads,
                    "seed": args.seed, "machine": platform.processor() or platform.machine(),
                    # a row repeats bit for bit on one CPU, not across CPUs whose kernels round differently
                    "cpu": _cpu_model(), "cpu_capability": _cpu_capability(),
                    "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]},
        "models": {},
    }
    for mname in args.models.split(","):
        spec = ModelSpec(MODELS.get(mname, mname))
        base = dict(centers=tuple(CenterSpec(n, samples=len(p)) for n, p in zip(names, parts)), model=spec,
                    fusion="fedavg",
                    local_steps=args.local_steps, batch_size=args.batch, lr=args.lr, momentum=args.momentum,
                    lr_schedule="cosine", seed=args.seed)
        rows: dict[str, Any] = {}
        out["models"][mname] = {"model": spec.kind, "rows": rows}

        def want(arm: str, mname: str = mname) -> bool:
            return (only is None and not arm.partition(":")[0].endswith("-long")) or f"{mname}:{arm}" in (only or ())

        key = f"{mname}_s{args.seed}_n{args.train}_a{args.alpha}_c{args.centers}_R{args.rounds}_H{args.local_steps}" \
              f"_b{args.batch}_lr{args.lr}_m{args.momentum}"
        if args.unpruned_from:  # the unpruned row of an earlier run of this setting, not trained again
            params, rows["unpruned"] = {}, unpruned_from(args, mname, out["setting"])
            wall = rows["unpruned"]["wall_s"]
        else:
            params, wall = trained(CollabConfig(rounds=args.rounds, **base), data, args.cache, key)
            rows["unpruned"] = {**unpruned_row(spec, params, xte, yte), "wall_s": wall}
        print(f"[{mname}] unpruned {rows['unpruned']['accuracy']:.4f} params {rows['unpruned']['params']} "
              f"({wall:.0f} s)", flush=True)
        if want("unpruned-long"):  # the unpruned model trained as many rounds as the once arm's model in all
            t0 = time.time()
            cfg = CollabConfig(rounds=2 * args.rounds + 1 - K, **base)
            res = run_inprocess(cfg, data)
            rows["unpruned-long"] = {**unpruned_row(spec, res.params, xte, yte), "wall_s": time.time() - t0}
            print(f"[{mname}] unpruned-long {rows['unpruned-long']['accuracy']:.4f} ({time.time() - t0:.0f} s)",
                  flush=True)
        for ratio in [float(r) for r in args.ratios.split(",")]:
            opts = dict(score=args.score, score_batches=args.score_batches, target=args.target,
                        allocation=args.allocation, heads=args.heads)
            # the online arms' dense rounds before the masks, and their distillation after the cut
            warm = dict(warmup=args.prune_warmup, distill=args.distill, distill_temperature=args.distill_temperature,
                        distill_teacher=args.distill_teacher)
            for arm in ("online", "once", "online-long"):
                if not want(f"{arm}:{ratio:g}"):
                    continue
                if arm == "once" and args.unpruned_from:
                    raise SystemExit("the once arm continues the unpruned model: run it without --unpruned-from")
                t0 = time.time()
                try:
                    if arm.startswith("online"):  # online-long: as many rounds as the once arm's model in all
                        rounds = args.rounds if arm == "online" else 2 * args.rounds + 1 - K
                        cfg = CollabConfig(rounds=rounds, prune=PruneSpec(ratio, rounds=K, **opts, **warm), **base)
                        res = run_inprocess(cfg, data)
                    else:
                        cfg = CollabConfig(rounds=1 + args.rounds - K, prune=PruneSpec(ratio, rounds=1, **opts), **base)
                        with warm_start(params):
                            res = run_inprocess(cfg, data)
                except PruneError as e:  # a parameter target the model cannot reach (its groups kept whole)
                    rows[f"{arm}:{ratio:g}"] = {"ratio": ratio, "error": str(e)}
                    print(f"[{mname}] {arm}@{ratio:g}: {e}", flush=True)
                    continue
                row = {**pruned_row(cfg, res, xte, yte), "ratio": ratio, "wall_s": time.time() - t0}
                u = rows["unpruned"]
                row["params_removed"] = 1 - row["params"] / u["params"]
                row["flops_removed"] = 1 - row["flops"] / u["flops"]
                row["points_lost"] = 100 * (u["accuracy"] - row["accuracy"])
                row["held_out"] = held_out(args, mname, f"{arm}:{ratio:g}", args.seed)
                rows[f"{arm}:{ratio:g}"] = row
                print(f"[{mname}] {arm}@{ratio:g} acc {row['accuracy']:.4f} (at cut {row['accuracy_at_cut']:.4f}) "
                      f"params -{100 * row['params_removed']:.1f}% FLOPs -{100 * row['flops_removed']:.1f}% "
                      f"lost {row['points_lost']:+.2f} pt ({time.time() - t0:.0f} s)", flush=True)
    out["setting"]["load_avg_end"] = os.getloadavg()[0]
    return out


def remeasure_latency(res: dict, repeats: int = 3) -> None:
    """Latency again for every row, in one process, the architectures interleaved: a forward's time
    depends on the widths only, so each row's architecture is rebuilt from its plan (random weights);
    the median over ``repeats`` rounds (each a median of timed runs). The in-run figures stay as
    ``latency_ms_in_run``."""
    import torch

    from polyparallel.backends.collab._pruning import apply_plan

    x = np.zeros((1, 1, 28, 28), np.float32)
    for m in res["models"].values():
        full = build_torch_model(ModelSpec(m["model"])).eval()
        ex = torch.zeros(2, 1, 28, 28)
        archs = {"-": full}
        for arm, r in m["rows"].items():
            if "plan" in r:
                cut = build_torch_model(ModelSpec(m["model"])).eval()
                apply_plan(cut, ex, r["plan"])
                archs[arm] = cut.eval()
        times: dict[str, dict[str, list[float]]] = {k: {"1": [], "32": []} for k in archs}
        for _ in range(repeats):
            for k, model in archs.items():
                for b in (1, 32):
                    times[k][str(b)].append(1e3 * latency_s(model, x, b))
        for arm, r in m["rows"].items():
            if "error" in r:
                continue
            k = arm if "plan" in r else "-"
            if size_of(archs[k], ex)[0] != r["params"]:  # the rebuilt architecture must be the row's
                raise SystemExit(f"{m['model']} at ratio {k}: rebuilt with {size_of(archs[k], ex)[0]} parameters, "
                                 f"the run's model had {r['params']}")
            r.setdefault("latency_ms_in_run", r["latency_ms"])
            r["latency_ms"] = {b: float(np.median(v)) for b, v in times[k].items()}
    res["setting"]["latency_remeasured"] = {"load_avg": os.getloadavg()[0], "repeats": repeats, "threads": 1}


def row_order(item: tuple[str, Any]) -> tuple[float, int]:
    """Sort key of a ``(arm, row)`` item: the unpruned arms first, then by ratio, ``online`` before ``once``."""
    name, _, ratio = item[0].partition(":")
    return (float(ratio) if ratio else -1.0, ("unpruned", "unpruned-long", "online", "once", "online-long").index(name))


def table(res: Mapping[str, Any]) -> str:
    R, K = res["setting"]["rounds"], res["setting"]["prune_rounds"]
    lines = ["| model | arm | ratio | rounds | params | FLOPs | latency b1 / b32 ms | accuracy | lost (pt) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mname, m in res["models"].items():
        for arm, r in m["rows"].items():
            name, _, ratio = arm.partition(":")
            if "error" in r:
                lines.append(f"| {mname} | {name} | {ratio} | | {r['error']} | | | | |")
                continue
            rounds = {"unpruned": f"{R}", "unpruned-long": f"{2 * R + 1 - K}", "online": f"{R} (cut after {K})",
                      "online-long": f"{2 * R + 1 - K} (cut after {K})",
                      "once": f"{R} + 1 + {R - K}"}[name]
            pr = f" (-{100 * r['params_removed']:.0f}%)" if "params_removed" in r else ""
            fr = f" (-{100 * r['flops_removed']:.0f}%)" if "flops_removed" in r else ""
            lost = f"{r['points_lost']:+.2f}" if "points_lost" in r else ""
            held = "" if r.get("held_out", True) else " (tuned)"
            lines.append(f"| {mname} | {name}{held} | {ratio or '-'} | {rounds} | {r['params']}{pr} | "
                         f"{r['flops']}{fr} | {r['latency_ms']['1']:.3f} / {r['latency_ms']['32']:.2f} | "
                         f"{r['accuracy']:.4f} | {lost} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(DATA_DIR))
    ap.add_argument("--models", default="resnet,vit", help="resnet, vit or MODULE:FUNCTION, comma-separated")
    ap.add_argument("--ratios", default="0.3,0.5,0.7")
    ap.add_argument("--train", type=int, default=12000)
    ap.add_argument("--test", type=int, default=0, help="first N test images (0: all 10k)")
    ap.add_argument("--centers", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--local-steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--prune-rounds", type=int, default=10, help="K (0: rounds // 2)")
    ap.add_argument("--prune-warmup", type=int, default=0,
                    help="online arms: rounds of dense training before the masks (PruneSpec.warmup)")
    ap.add_argument("--distill", type=float, default=0.0,
                    help="online arms: distillation weight a in the rounds after the cut (PruneSpec.distill; 0: off)")
    ap.add_argument("--distill-temperature", type=float, default=4.0, help="T of --distill")
    ap.add_argument("--distill-teacher", default="cut", help="cut or round (PruneSpec.distill_teacher)")
    ap.add_argument("--score", default="fisher")
    ap.add_argument("--score-batches", type=int, default=4)
    ap.add_argument("--target", default="params", help="what RATIO is a share of: params or channels")
    ap.add_argument("--allocation", default="global", help="uniform or global (PruneSpec.allocation)")
    ap.add_argument("--heads", default="dims", help="dims or whole: what an attention loses (PruneSpec.heads)")
    ap.add_argument("--cache", default="", help="folder for the unpruned models' parameters (reused by a run of "
                                                "the same setting)")
    ap.add_argument("--unpruned-from", default="",
                    help="a JSON of this script with the same setting: its unpruned rows instead of training them "
                         "(not with the once arm)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="MODEL:ARM:RATIO,... (the unpruned arm always runs)")
    ap.add_argument("--tuned", default="resnet:online:0.5",
                    help="the rows the settings were chosen on (the others are marked held_out)")
    ap.add_argument("--tuned-seed", type=int, default=0, help="the seed the settings were chosen at")
    ap.add_argument("--tuning-runs", default="",
                    help="JSON files of the tuning runs (this script with --only), kept in the output's 'tuning'")
    ap.add_argument("--merge", default="",
                    help="JSON files of runs of this script with the same setting (e.g. one process per model): "
                         "join their models instead of running")
    ap.add_argument("--remeasure-latency", action="store_true",
                    help="with --merge: time every row's architecture again, in this process (remeasure_latency)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge.split(",")]
        res = {**parts[0], "models": {}}
        for part in parts:  # rows of the same model from several runs are joined; the first run's row is kept
            for k, v in part["models"].items():
                rows = res["models"].setdefault(k, {**v, "rows": {}})["rows"]
                for arm, row in v["rows"].items():
                    if "held_out" in row:
                        row["held_out"] = held_out(args, k, arm, part["setting"]["seed"])
                    rows.setdefault(arm, row)
        for m in res["models"].values():  # the table's order: unpruned arms, then by ratio, online before once
            m["rows"] = dict(sorted(m["rows"].items(), key=row_order))
        keys = ("rounds", "local_steps", "lr", "prune_rounds", "prune_warmup", "score", "seed", "train_rows", "alpha",
                "target", "allocation", "heads")
        before = {"prune_warmup": 0, "heads": "dims"}  # runs from before these options existed

        def same(p: dict) -> dict:
            return {k: p["setting"].get(k, before.get(k)) for k in keys}

        if any(same(p) != same(res) for p in parts):
            raise SystemExit("--merge: the runs' settings differ")
        res["setting"]["load_avg"] = [pair for p in parts for pair in  # a merged part keeps its runs' loads
                                      p["setting"].get("load_avg") or [[p["setting"]["load_avg_start"],
                                                                        p["setting"]["load_avg_end"]]]]
        if args.remeasure_latency:
            remeasure_latency(res)
    else:
        res = run(args)
        res["args"] = vars(args)
    res["tuning"] = [{"args": t["args"], "rows": {m: v["rows"] for m, v in t["models"].items()}}
                     for t in (json.loads(Path(f).read_text()) for f in args.tuning_runs.split(",") if f)]
    print(table(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
