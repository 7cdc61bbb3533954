"""Fashion-MNIST over five centers: local-only vs collaborative (several fusions) vs pooled training.

Reproduces the experiment the seeds report (their CIFAR-10/ResNet-50 setting scaled to what a
laptop CPU trains in minutes): a small CNN, five centers, an IID split and a Dirichlet(α) label-skew
split, the same total number of epochs for every arm:

- ``local``   each center trains only on its own data (mean test accuracy of the five models);
- ``fedavg``, ``fedprox``, ``fedadam`` ...   collaborative training, ``R`` rounds of ``H`` local steps;
- ``pooled``  one model trained on the union of the centers' data;
- ``fedavg-ms`` (``--mindspore``)  FedAvg with two of the five centers training in MindSpore.

Every arm sees ``E`` epochs of its data in total; a round is ``H = E·n̄/(B·R)`` local steps (n̄ the mean
center size), the pooled model takes ``5·H`` steps per round (same samples per round). Accuracy is on
the official 10k test images (or ``--test`` of them). Writes ``<out>/fashion_mnist_<split>.json``, a
Markdown table ``<out>/fashion_mnist.md`` and an SVG plot of accuracy per round per arm.

Data: Debian's ``dataset-fashion-mnist`` package (``apt-get install -y dataset-fashion-mnist``), files in
``/usr/share/datasets/fashion-mnist``.

Run:  ``nice python examples/collab_fashion_mnist.py --out benchmarks/results --mindspore``
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


def run_split(name: str, alpha: float | None, xtr, ytr, xte, yte, args) -> dict:
    parts = split(ytr, args.centers, alpha, args.seed)
    names = [f"c{i}" for i in range(args.centers)]
    data = {n: (xtr[p], ytr[p]) for n, p in zip(names, parts)}
    sizes = [len(p) for p in parts]
    spec = ModelSpec("cnn", (1, 28, 28), 10, hidden=args.width)
    steps = max(1, round(args.epochs * np.mean(sizes) / (args.batch * args.rounds)))
    base = dict(model=spec, rounds=args.rounds, local_steps=steps, batch_size=args.batch, lr=args.lr, seed=args.seed)
    arms: dict[str, dict] = {}
    print(f"[{name}] center sizes {sizes}; {args.rounds} rounds x {steps} local steps", flush=True)

    def record(arm: str, accs: list[float], t0: float, extra: dict | None = None) -> None:
        arms[arm] = {"accuracy_per_round": accs, "final_accuracy": accs[-1], "wall_s": time.time() - t0,
                     **(extra or {})}
        print(f"[{name}] {arm:12s} acc {accs[-1]:.4f}  ({time.time() - t0:.0f} s)", flush=True)

    # local only: each center continues from its own model, round after round
    t0 = time.time()
    x0 = initial_params(CollabConfig(centers=(CenterSpec("c0"),), **base))
    trainers = [TorchTrainer(spec, *data[n], center_index=i, batch_size=args.batch, lr=args.lr, seed=args.seed)
                for i, n in enumerate(names)]
    own = [x0] * len(names)
    per_center: list[list[float]] = [[] for _ in names]
    for r in range(1, args.rounds + 1):
        own = [t.train(p, steps=steps, round_idx=r)[0] for t, p in zip(trainers, own)]
        for i, p in enumerate(own):
            per_center[i].append(evaluate_torch(spec, p, xte, yte)["accuracy"])
    mean_local = [float(np.mean([pc[r] for pc in per_center])) for r in range(args.rounds)]
    record("local", mean_local, t0, {"per_center_final": [pc[-1] for pc in per_center]})

    # pooled: one model on all the data, 5·H steps per round
    t0 = time.time()
    allx, ally = np.concatenate([data[n][0] for n in names]), np.concatenate([data[n][1] for n in names])
    pooled = TorchTrainer(spec, allx, ally, batch_size=args.batch, lr=args.lr, seed=args.seed)
    p, accs = x0, []
    for r in range(1, args.rounds + 1):
        p = pooled.train(p, steps=steps * len(names), round_idx=r)[0]
        accs.append(evaluate_torch(spec, p, xte, yte)["accuracy"])
    record("pooled", accs, t0)

    fusions = [("fedavg", {}), ("fedprox", {"mu": 0.01}), ("fedadam", {"lr": 0.01, "tau": 1e-3})]
    for fusion, opts in fusions:
        t0 = time.time()
        cfg = CollabConfig(centers=tuple(CenterSpec(n) for n in names), fusion=fusion, fusion_options=opts, **base)
        res = run_inprocess(cfg, data, eval_data=(xte, yte))
        record(fusion, [r.eval["accuracy"] for r in res.rounds], t0,
               {"bytes_up_per_round": sum(res.rounds[0].bytes_up.values()),
                "bytes_down_per_round": res.rounds[0].bytes_down})
    if args.mindspore and name in args.mindspore_splits:
        t0 = time.time()
        centers = tuple(CenterSpec(n, framework="mindspore" if i >= len(names) - 2 else "torch")
                        for i, n in enumerate(names))
        res = run_inprocess(CollabConfig(centers=centers, **base), data, eval_data=(xte, yte))
        record("fedavg-ms", [r.eval["accuracy"] for r in res.rounds], t0,
               {"mindspore_centers": [c.name for c in centers if c.framework == "mindspore"]})
    return {"split": name, "alpha": alpha, "center_sizes": sizes, "local_steps": steps, "rounds": args.rounds,
            "epochs": args.epochs, "batch": args.batch, "lr": args.lr, "width": args.width,
            "train_images": len(ytr), "test_images": len(yte), "arms": arms}


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
            pts = " ".join(xy(i, a) for i, a in enumerate(d["accuracy_per_round"]))
            c = colors[k % len(colors)]
            parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6" points="{pts}"/>')
            parts.append(f'<text x="{ox + w - pad + 4 - 80}" y="{pad + 14 + 13 * k}" fill="{c}">{arm}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def table(results: list[dict]) -> str:
    lines = ["| split | arm | final test accuracy | vs mean local-only | vs pooled | wall s |",
             "|---|---|---|---|---|---|"]
    for res in results:
        local = res["arms"]["local"]["final_accuracy"]
        pooled = res["arms"]["pooled"]["final_accuracy"]
        for arm, d in res["arms"].items():
            a = d["final_accuracy"]
            lines.append(f"| {res['split']} | {arm} | {100 * a:.2f} | {100 * (a - local):+.2f} | "
                         f"{100 * (a - pooled):+.2f} | {d['wall_s']:.0f} |")
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
    ap.add_argument("--width", type=int, default=8, help="channels of the first conv")
    ap.add_argument("--train", type=int, default=0, help="use this many training images (0: all 60k)")
    ap.add_argument("--test", type=int, default=0, help="use this many test images (0: all 10k)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mindspore", action="store_true", help="also run FedAvg with two MindSpore centers")
    ap.add_argument("--mindspore-splits", default="IID", help="splits (IID, Dirichlet(α)) that get the MindSpore run")
    ap.add_argument("--splits", default="iid,dirichlet")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_fashion_mnist()
    rng = np.random.default_rng(args.seed)
    if args.train:
        keep = np.sort(rng.permutation(len(ytr))[: args.train])
        xtr, ytr = xtr[keep], ytr[keep]
    if args.test:
        keep = np.sort(rng.permutation(len(yte))[: args.test])
        xte, yte = xte[keep], yte[keep]
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for s in args.splits.split(","):
        alpha = None if s == "iid" else args.alpha
        label = "IID" if alpha is None else f"Dirichlet({alpha})"
        res = run_split(label, alpha, xtr, ytr, xte, yte, args)
        results.append(res)
        (args.out / f"collab_fashion_mnist_{s}.json").write_text(json.dumps(res, indent=1))
    md = table(results)
    (args.out / "collab_fashion_mnist.md").write_text(md + "\n")
    svg_plot(results, args.out / "collab_fashion_mnist.svg")
    print(md)


if __name__ == "__main__":
    main()
