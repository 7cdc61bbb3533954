"""Fashion-MNIST over five centers: local-only vs collaborative (several fusions) vs pooled training.

Reproduces the experiment the seeds report (their CIFAR-10/ResNet-50 setting scaled to what a
laptop CPU trains in minutes): a small CNN, five centers, an IID split and a Dirichlet(α) label-skew
split, the same total number of epochs for every arm:

- ``local``   each center trains only on its own data (mean test accuracy of the five models);
- ``fedavg``, ``diloco``, ``fedprox``, ``fedadam``, ``scaffold``, ``scaffold-nesterov`` ... (``--fusions``)
  collaborative training, ``R`` rounds of ``H`` local steps, each fusion with its paper's
  hyper-parameters (:data:`ARMS`; ``scaffold-nesterov`` = SCAFFOLD's control variates with DiLoCo's
  outer step);
- ``pooled``  one model trained on the union of the centers' data;
- ``fedavg-ms`` (``--mindspore``)  FedAvg with two of the five centers training in MindSpore.

Protocol, identical for every arm: ``E`` epochs of the union of the data in total; a round is
``H = E·n̄/(B·R)`` local steps of batch ``B`` (n̄ the mean center size; 20 rounds of 5 epochs fuse every
quarter epoch), the pooled model takes ``5·H`` steps per round (same samples per round), and local-only
centers ``H`` steps per round on their own data. Every arm uses the same local SGD (``--lr``,
``--momentum``, a fresh optimiser per round; SCAFFOLD centers also keep their control variate) and
the same per-round learning-rate schedule (``--lr-schedule``, cosine by default) on the same CNN
(``--norm``: BatchNorm, or GroupNorm for every arm). Nothing is tuned per arm. Accuracy is on the official 10k test
images (or ``--test`` of them); ``--seeds`` repeats everything (data split, initial model, data order)
and the table gives mean ± std over seeds, differences taken per seed.

Writes ``<out>/collab_fashion_mnist[_TAG]_<split>.json`` (a list, one entry per seed), a Markdown table
``<out>/collab_fashion_mnist[_TAG].md`` and an SVG plot of mean accuracy per round per arm. Runs started
apart (e.g. one process per split) are merged by ``--table-only``.

``--model MODULE:FUNCTION`` trains the user's own model instead (the collaborative backend's user-model
path), e.g. ``--model models.resnet_small:resnet`` (``examples/models/resnet_small.py``; see docs/collab.md).

Data: Debian's ``dataset-fashion-mnist`` package (``apt-get install -y dataset-fashion-mnist``), files in
``/usr/share/datasets/fashion-mnist``.

Run (the full experiment; about 25 CPU-minutes per split and seed):
``nice python examples/collab_fashion_mnist.py --out benchmarks/results --lr 0.02 --momentum 0.9
--local-eval-every 4``

The tagged runs in ``benchmarks/results`` (12k training / 2k test images, 15 epochs, 120 rounds × 9
local steps, seeds 0 and 1; ``C`` = ``nice -n 10 python examples/collab_fashion_mnist.py --out
benchmarks/results --test 2000 --epochs 15 --rounds 120 --lr 0.02 --momentum 0.9 --local-eval-every 8
--seeds 0,1 --fusions fedavg,diloco,scaffold,scaffold-nesterov``):
``C --train 12000 --splits dirichlet --tag e15dir_scaffold``,
``C --train 12000 --splits dirichlet --norm group --tag e15dir_gn``,
``C --train 12000 --splits iid --tag e15iid_scaffold`` and the IID training-set sweep
``C --train N --splits iid --tag e15iid_nN`` for N = 3000, 6000. The Dirichlet result that meets "within 1
point of pooled" on held-out seeds fuses every 5 local steps (225 rounds) on the full 10k test set:
``nice -n 5 python examples/collab_fashion_mnist.py --out benchmarks/results --train 12000 --test 0 --epochs 15
--rounds 225 --lr 0.02 --momentum 0.9 --local-eval-every 15 --seeds 2,3,4,5,6,7,8,9 --splits dirichlet
--norm group --fusions scaffold-nesterov --tag e15dir_gn_h5_holdout`` (one process per seed or two, about
14 CPU-minutes per seed; see ``benchmarks/results/collab_fashion_mnist_summary.md``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np

from polyparallel.backends.collab import (
    CenterSpec,
    CollabConfig,
    ModelSpec,
    TorchTrainer,
    evaluate_torch,
    initial_params,
    run_inprocess,
)

DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
MEAN, STD = 0.2860, 0.3530


def load_idx(path: Path) -> np.ndarray:
    """Read an IDX file (the MNIST format: magic, dims, then raw uint8)."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_fashion_mnist(data_dir: Path = DATA_DIR) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if not (data_dir / "train-images-idx3-ubyte.gz").exists():
        raise SystemExit(f"Fashion-MNIST not found in {data_dir}: apt-get install -y dataset-fashion-mnist")

    def images(name: str) -> np.ndarray:
        return ((load_idx(data_dir / name).astype(np.float32) / 255.0 - MEAN) / STD)[:, None]

    return (images("train-images-idx3-ubyte.gz"), load_idx(data_dir / "train-labels-idx1-ubyte.gz").astype(np.int64),
            images("t10k-images-idx3-ubyte.gz"), load_idx(data_dir / "t10k-labels-idx1-ubyte.gz").astype(np.int64))


def split(y: np.ndarray, centers: int, alpha: float | None, seed: int) -> list[np.ndarray]:
    """Row indices per center: IID (``alpha`` None) or Dirichlet(α) label skew.

    Dirichlet: for each class ``k``, proportions ``p_k ~ Dir(α·1)`` over the centers, and the class's
    (shuffled) samples are cut at the cumulative proportions.
    """
    rng = np.random.default_rng(seed)
    if alpha is None:
        return [np.sort(p) for p in np.array_split(rng.permutation(len(y)), centers)]
    parts: list[list[int]] = [[] for _ in range(centers)]
    for k in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == k))
        cuts = (np.cumsum(rng.dirichlet(alpha * np.ones(centers)))[:-1] * len(idx)).astype(int)
        for c, chunk in enumerate(np.split(idx, cuts)):
            parts[c].extend(chunk.tolist())
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


# Each fusion's own hyper-parameters, from the paper that introduced it (never tuned on this experiment):
# FedProx mu from Li et al. 2020's grid; FedAdam eta=10^-2, tau=10^-3 from Reddi et al. 2021;
# DiLoCo outer lr 0.7 with Nesterov momentum 0.9 from Douillard et al. 2023; SCAFFOLD global step
# eta_g = 1 from Karimireddy et al. 2020; "scaffold-nesterov" is SCAFFOLD's control variates with
# DiLoCo's outer step (its lr 0.7 and momentum 0.9, not tuned here).
# arm name -> (fusion, options)
ARMS: dict[str, tuple[str, dict[str, float]]] = {
    "fedavg": ("fedavg", {}), "fedprox": ("fedprox", {"mu": 0.01}),
    "fedadam": ("fedadam", {"lr": 0.01, "tau": 1e-3}), "fedyogi": ("fedyogi", {"lr": 0.01, "tau": 1e-3}),
    "diloco": ("diloco", {"lr": 0.7, "momentum": 0.9}), "scaffold": ("scaffold", {"lr": 1.0}),
    "scaffold-nesterov": ("scaffold", {"lr": 0.7, "momentum": 0.9}),
}


def run_split(name: str, alpha: float | None, xtr, ytr, xte, yte, args, seed: int) -> dict:
    parts = split(ytr, args.centers, alpha, seed)
    names = [f"c{i}" for i in range(args.centers)]
    data = {n: (xtr[p], ytr[p]) for n, p in zip(names, parts)}
    sizes = [len(p) for p in parts]
    spec = ModelSpec(args.model) if args.model else ModelSpec("cnn", (1, 28, 28), 10, hidden=args.width, norm=args.norm)
    steps = max(1, round(args.epochs * np.mean(sizes) / (args.batch * args.rounds)))
    base = dict(model=spec, rounds=args.rounds, local_steps=steps, batch_size=args.batch, lr=args.lr, seed=seed,
                lr_schedule=args.lr_schedule, momentum=args.momentum, logit_adjust=args.logit_adjust)
    # the local-only and pooled trainers: the same SGD settings, without the federation's model and H
    sched = {k: v for k, v in base.items() if k not in ("model", "local_steps")}
    arms: dict[str, dict] = {}
    print(f"[{name} seed {seed}] center sizes {sizes}; {args.rounds} rounds x {steps} local steps", flush=True)

    def record(arm: str, accs: list[float], t0: float, extra: dict | None = None,
               rounds: list[int] | None = None) -> None:
        arms[arm] = {"accuracy_per_round": accs, "eval_rounds": rounds or list(range(1, len(accs) + 1)),
                     "final_accuracy": accs[-1], "wall_s": time.time() - t0, **(extra or {})}
        print(f"[{name} seed {seed}] {arm:12s} acc {accs[-1]:.4f}  ({time.time() - t0:.0f} s)", flush=True)

    # local only: each center continues from its own model, round after round
    t0 = time.time()
    x0 = initial_params(CollabConfig(centers=(CenterSpec("c0"),), **base))
    trainers = [TorchTrainer(spec, *data[n], center_index=i, **sched) for i, n in enumerate(names)]
    own = [x0] * len(names)
    per_center: list[list[float]] = [[] for _ in names]
    # five models to evaluate per round: --local-eval-every thins that out (the final round always counts)
    eval_rounds = [r for r in range(1, args.rounds + 1) if r % args.local_eval_every == 0 or r == args.rounds]
    for r in range(1, args.rounds + 1):
        own = [t.train(p, steps=steps, round_idx=r)[0] for t, p in zip(trainers, own)]
        for i, p in enumerate(own if r in eval_rounds else ()):
            per_center[i].append(evaluate_torch(spec, p, xte, yte)["accuracy"])
    mean_local = [float(np.mean([pc[j] for pc in per_center])) for j in range(len(eval_rounds))]
    record("local", mean_local, t0, {"per_center_final": [pc[-1] for pc in per_center]}, rounds=eval_rounds)

    # pooled: one model on all the data, 5·H steps per round
    t0 = time.time()
    allx, ally = np.concatenate([data[n][0] for n in names]), np.concatenate([data[n][1] for n in names])
    pooled = TorchTrainer(spec, allx, ally, **sched)
    p, accs = x0, []
    for r in range(1, args.rounds + 1):
        p = pooled.train(p, steps=steps * len(names), round_idx=r)[0]
        accs.append(evaluate_torch(spec, p, xte, yte)["accuracy"])
    record("pooled", accs, t0)

    for arm in args.fusions.split(","):
        fusion, opts = ARMS[arm]
        t0 = time.time()
        cfg = CollabConfig(centers=tuple(CenterSpec(n) for n in names), fusion=fusion, fusion_options=opts, **base)
        res = run_inprocess(cfg, data, eval_data=(xte, yte))
        record(arm, [r.eval["accuracy"] for r in res.rounds], t0,
               {"fusion": fusion, "fusion_options": opts, "bytes_up_per_round": sum(res.rounds[0].bytes_up.values()),
                "bytes_down_per_round": res.rounds[0].bytes_down, **round_timing(res)})
    if args.mindspore and name.split("(")[0].lower() in args.mindspore_splits.lower() and seed == args.seeds[0]:
        t0 = time.time()
        centers = tuple(CenterSpec(n, framework="mindspore" if i >= len(names) - 2 else "torch")
                        for i, n in enumerate(names))
        res = run_inprocess(CollabConfig(centers=centers, **base), data, eval_data=(xte, yte))
        record("fedavg-ms", [r.eval["accuracy"] for r in res.rounds], t0,
               {"mindspore_centers": [c.name for c in centers if c.framework == "mindspore"]})
    return {"split": name, "seed": seed, "alpha": alpha, "center_sizes": sizes, "local_steps": steps,
            "rounds": args.rounds, "epochs": args.epochs, "batch": args.batch, "lr": args.lr, "momentum": args.momentum,
            "lr_schedule": args.lr_schedule, "logit_adjust": args.logit_adjust, "width": args.width, "norm": args.norm,
            "model": args.model or "cnn",
            "train_images": len(ytr),
            "test_images": len(yte), "arms": arms}


def round_timing(res) -> dict:
    """Median wall time of a round and the communication share, from the in-process engine's timing events.

    Per round (rounds 2.., round 1 carries one-off start-up when there are more): ``round`` = server
    ``round_start`` → ``round_end``; ``compute`` = Σ over centers of ``received_model`` → ``finished_training``
    (the in-process engine runs the centers one after another); ``fusion`` = ``fusion_start`` →
    ``fusion_end``; ``comm`` = Σ over centers of ``round_start``/previous reply → ``received_model`` and
    ``sent_update`` → ``update_received`` (serialising, copying and decoding the tensors: no network here).
    The rest of a round is the server's evaluation of the fused model.
    """
    ev = {(e["round"], e["who"], e["event"]): e["t"] for e in res.timing}
    rows = []
    for rec in res.rounds[1:] if len(res.rounds) > 1 else res.rounds:
        r = rec.round
        centers = sorted({w for (rr, w, e) in ev if rr == r and e == "finished_training"},
                         key=lambda c: ev[(r, c, "received_model")])
        t_round = ev[(r, "server", "round_end")] - ev[(r, "server", "round_start")]
        compute = sum(ev[(r, c, "finished_training")] - ev[(r, c, "received_model")] for c in centers)
        comm = sum(ev[(r, c, "update_received")] - ev[(r, c, "sent_update")] for c in centers)
        prev = ev[(r, "server", "round_start")]
        for c in centers:
            comm += max(0.0, ev[(r, c, "received_model")] - prev)
            prev = ev[(r, c, "update_received")]
        fusion = ev[(r, "server", "fusion_end")] - ev[(r, "server", "fusion_start")]
        rows.append((t_round, compute, comm, fusion))
    a = np.array(rows)
    return {"timing_source": "in-process engine timing events (CollabResult.timing)",
            "round_s_median": float(np.median(a[:, 0])), "compute_s_median": float(np.median(a[:, 1])),
            "comm_s_median": float(np.median(a[:, 2])), "fusion_s_median": float(np.median(a[:, 3])),
            "comm_share": float(a[:, 2].sum() / a[:, 0].sum())}


def timing_table(results: dict[str, list[dict]]) -> str:
    """Median round wall time and communication share of every collaborative arm (see :func:`round_timing`)."""
    lines = ["| split | arm | round s (median) | compute s | comm s | fusion s | comm share (%) |",
             "|---|---|---|---|---|---|---|"]
    for runs in results.values():
        for arm, d in runs[0]["arms"].items():
            if "round_s_median" in d:
                lines.append(f"| {runs[0]['split']} | {arm} | {d['round_s_median']:.3f} | "
                             f"{d['compute_s_median']:.3f} | {d['comm_s_median']:.4f} | {d['fusion_s_median']:.4f} | "
                             f"{100 * d['comm_share']:.2f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def svg_plot(results: list[dict], path: Path) -> None:
    """Accuracy per round, one panel per split, one polyline per arm (plain SVG: no plotting dependency)."""
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"]
    w, h, pad = 460, 300, 45
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(results)}" height="{h + 30}" '
             'font-family="sans-serif" font-size="11">']
    for j, res in enumerate(results):
        ox = j * w
        allacc = [a for arm in res["arms"].values() for a in arm["accuracy_per_round"]]
        lo, hi = max(0.0, min(allacc) - 0.02), min(1.0, max(allacc) + 0.02)
        n = res["rounds"]

        def xy(i: int, a: float, n=n, lo=lo, hi=hi, ox=ox) -> str:
            px = ox + pad + (w - 2 * pad) * (i / max(1, n - 1))
            return f"{px:.1f},{h - pad - (h - 2 * pad) * (a - lo) / (hi - lo):.1f}"

        parts.append(f'<text x="{ox + w / 2}" y="15" text-anchor="middle">{res["split"]}: '
                     'test accuracy per round</text>')
        parts.append(f'<rect x="{ox + pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" '
                     'fill="none" stroke="#999"/>')
        for t in np.linspace(lo, hi, 5):
            parts.append(f'<text x="{ox + pad - 4}" y="{xy(0, t).split(",")[1]}" text-anchor="end">{t:.2f}</text>')
        parts.append(f'<text x="{ox + w / 2}" y="{h - pad + 28}" text-anchor="middle">round (1..{n})</text>')
        for k, (arm, d) in enumerate(res["arms"].items()):
            pts = " ".join(xy(r - 1, a) for r, a in zip(d["eval_rounds"], d["accuracy_per_round"]))
            c = colors[k % len(colors)]
            parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6" points="{pts}"/>')
            parts.append(f'<text x="{ox + w - pad + 4 - 80}" y="{pad + 14 + 13 * k}" fill="{c}">{arm}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def _pm(values: list[float]) -> str:
    """``mean ± std`` in points (std over seeds, ddof 1; just the value for one seed)."""
    v = 100 * np.asarray(values)
    return f"{v.mean():+.2f}" if len(v) == 1 else f"{v.mean():+.2f} ± {v.std(ddof=1):.2f}"


def aggregate(runs: list[dict]) -> dict:
    """One split's runs (one per seed) -> mean accuracy per round per arm, for the plot."""
    arms = {arm: {"accuracy_per_round": np.mean([r["arms"][arm]["accuracy_per_round"] for r in runs
                                                 if arm in r["arms"]], axis=0).tolist(),
                  "eval_rounds": runs[0]["arms"][arm]["eval_rounds"]}
            for arm in runs[0]["arms"]}
    return {"split": runs[0]["split"], "rounds": runs[0]["rounds"], "arms": arms}


def table(results: dict[str, list[dict]]) -> str:
    """Final test accuracy per split and arm, and its difference to mean local-only and to pooled.

    Differences are taken per seed (same data split, same initial model) and then averaged."""
    lines = ["| split | arm | seeds | final test accuracy (%) | vs mean local-only (points) | vs pooled (points) "
             "| wall s (mean) |", "|---|---|---|---|---|---|---|"]
    for runs in results.values():
        for arm in runs[0]["arms"]:
            have = [r for r in runs if arm in r["arms"]]
            acc = [r["arms"][arm]["final_accuracy"] for r in have]
            vs_local = [r["arms"][arm]["final_accuracy"] - r["arms"]["local"]["final_accuracy"] for r in have]
            vs_pooled = [r["arms"][arm]["final_accuracy"] - r["arms"]["pooled"]["final_accuracy"] for r in have]
            lines.append(f"| {runs[0]['split']} | {arm} | {len(have)} | {_pm(acc).lstrip('+')} | {_pm(vs_local)} | "
                         f"{_pm(vs_pooled)} | {np.mean([r['arms'][arm]['wall_s'] for r in have]):.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--centers", type=int, default=5)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--epochs", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.0, help="local SGD momentum (every arm; reset each round)")
    ap.add_argument("--lr-schedule", default="cosine", choices=("constant", "cosine"),
                    help="per-round learning-rate schedule, the same for every arm")
    ap.add_argument("--local-eval-every", type=int, default=1,
                    help="evaluate the five local-only models every this many rounds (and after the last)")
    ap.add_argument("--logit-adjust", type=float, default=0.0, metavar="TAU",
                    help="every arm trains on the logit-adjusted loss softmax(z + TAU log prior) with its own data's "
                         "label prior (0: plain cross-entropy; 1: the theory's value)")
    ap.add_argument("--model", default="", metavar="MODULE:FUNCTION",
                    help="the user's model instead of the built-in CNN: a function returning an nn.Module taking "
                         "(N, 1, 28, 28) images to 10 logits, e.g. models.resnet_small:resnet (examples/ is on the "
                         "import path when this script runs)")
    ap.add_argument("--width", type=int, default=8, help="channels of the first conv")
    ap.add_argument("--norm", default="batch", choices=("batch", "group"),
                    help="the CNN's normalisation (every arm): BatchNorm or GroupNorm")
    ap.add_argument("--train", type=int, default=0, help="use this many training images (0: all 60k)")
    ap.add_argument("--test", type=int, default=0, help="use this many test images (0: all 10k)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (data split, initial model, data order)")
    ap.add_argument("--fusions", default="fedavg,diloco", help=f"comma-separated arms, from {sorted(ARMS)}")
    ap.add_argument("--mindspore", action="store_true", help="also run FedAvg with two MindSpore centers")
    ap.add_argument("--mindspore-splits", default="IID", help="splits (IID, Dirichlet) that get the MindSpore run")
    ap.add_argument("--splits", default="iid,dirichlet")
    ap.add_argument("--tag", default="", help="suffix of the output files (e.g. a second configuration)")
    ap.add_argument("--table-only", action="store_true",
                    help="only rebuild the table and plot from the JSON files of --splits (runs started apart)")
    args = ap.parse_args()
    args.seeds = [int(x) for x in args.seeds.split(",")]
    unknown = set(args.fusions.split(",")) - set(ARMS)
    if unknown:
        raise SystemExit(f"--fusions: unknown {sorted(unknown)}; choose from {sorted(ARMS)}")
    import torch

    torch.set_num_threads(1)
    xtr0, ytr0, xte0, yte0 = load_fashion_mnist()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "collab_fashion_mnist" + (f"_{args.tag}" if args.tag else "")
    results: dict[str, list[dict]] = {}
    for s in args.splits.split(",") if args.table_only else ():
        results[s] = json.loads((args.out / f"{stem}_{s}.json").read_text())
    for s in () if args.table_only else args.splits.split(","):
        alpha = None if s == "iid" else args.alpha
        label = "IID" if alpha is None else f"Dirichlet({alpha})"
        for seed in args.seeds:
            rng = np.random.default_rng(seed)
            xtr, ytr, xte, yte = xtr0, ytr0, xte0, yte0
            if args.train:
                keep = np.sort(rng.permutation(len(ytr))[: args.train])
                xtr, ytr = xtr[keep], ytr[keep]
            if args.test:
                keep = np.sort(rng.permutation(len(yte))[: args.test])
                xte, yte = xte[keep], yte[keep]
            results.setdefault(s, []).append(run_split(label, alpha, xtr, ytr, xte, yte, args, seed))
            (args.out / f"{stem}_{s}.json").write_text(json.dumps(results[s], indent=1))
    md = table(results)
    timings = timing_table(results)
    if timings:
        md += "\n\nCollaborative rounds, first seed (in-process engine timing events):\n\n" + timings
    (args.out / f"{stem}.md").write_text(md + "\n")
    svg_plot([aggregate(runs) for runs in results.values()], args.out / f"{stem}.svg")
    print(md)


if __name__ == "__main__":
    main()
