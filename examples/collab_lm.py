"""A small PanGu-shaped language model over four centers: local-only vs pooled vs collaborative (FedAvg).

The seeds' language-model case (PanGu across PyTorch and MindSpore centers) at CPU scale: a byte-level
GPT (``examples/models/gpt_small.py``: 2 blocks, width 64, 64-token context, ~137k parameters) given as a
user model, trained on a corpus that ships inside an installed package — scikit-learn's dataset
descriptions ``sklearn/datasets/descr/*.rst`` (13 files, ~43 kB of English/reStructuredText). Each file is
cut into its first 90% (training) and last 10% (validation); the files are dealt round-robin to the
centers (so each center holds different documents: a natural non-IID split); the validation set is the
union of the 10% tails, never trained on.

Arms, the same local SGD (``--lr``, ``--momentum``, cosine schedule over the rounds) and the same
number of samples per round: ``local`` (each center's own model, ``H`` steps per round; the mean of the
centers' validation perplexities), ``pooled`` (one model on all the training blocks, ``centers·H`` steps
per round), ``fedavg`` (``R`` rounds of ``H`` local steps, all-torch centers), and ``fedavg-ms``
(``--mindspore``: the last two centers train the MindSpore cell of the same model, ``models.gpt_small:
gpt_mindspore``, the torch ↔ MindSpore map inferred and checked before round 1).

Writes ``<out>/collab_lm[_TAG].json`` and ``<out>/collab_lm[_TAG].md`` (perplexity table and the
collaborative arms' median round time and communication share, from the in-process engine's timing
events; see ``collab_fashion_mnist.round_timing``).

Run: ``nice python examples/collab_lm.py --out benchmarks/results --mindspore``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from collab_fashion_mnist import round_timing

from polyparallel.backends.collab import (
    CenterSpec,
    CollabConfig,
    ModelSpec,
    TorchTrainer,
    evaluate_torch,
    initial_params,
    run_inprocess,
)

TORCH_MODEL, MS_MODEL = "models.gpt_small:gpt", "models.gpt_small:gpt_mindspore"


def corpus_files() -> list[Path]:
    import sklearn.datasets

    return sorted((Path(sklearn.datasets.__file__).parent / "descr").glob("*.rst"))


def blocks(data: bytes, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows of ``seq + 1`` bytes -> inputs ``(N, seq)`` and next-byte labels ``(N, seq)``."""
    a = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    n = (len(a) - 1) // seq
    x = np.stack([a[i * seq: i * seq + seq] for i in range(n)])
    y = np.stack([a[i * seq + 1: i * seq + seq + 1] for i in range(n)])
    return x, y


def make_data(centers: int, seq: int, val_frac: float) -> tuple[dict, tuple, list[str]]:
    files = corpus_files()
    train: list[list[bytes]] = [[] for _ in range(centers)]
    val = []
    for i, f in enumerate(files):
        raw = f.read_bytes()
        cut = int(len(raw) * (1 - val_frac))
        train[i % centers].append(raw[:cut])
        val.append(raw[cut:])
    data = {f"c{i}": blocks(b"\n".join(t), seq) for i, t in enumerate(train)}
    return data, blocks(b"\n".join(val), seq), [f.name for f in files]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--centers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("-H", "--local-steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-frac", type=float, default=0.1)
    ap.add_argument("--mindspore", action="store_true",
                    help="also run FedAvg with the last two centers in MindSpore (the model's MindSpore cell)")
    ap.add_argument("--arms", default="local,pooled,fedavg", help="comma-separated subset of local,pooled,fedavg")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    import torch
    from models.gpt_small import SEQ

    torch.set_num_threads(1)
    data, (xv, yv), files = make_data(args.centers, SEQ, args.val_frac)
    names = list(data)
    spec = ModelSpec(TORCH_MODEL)
    base = dict(model=spec, rounds=args.rounds, local_steps=args.local_steps, batch_size=args.batch, lr=args.lr,
                seed=args.seed, lr_schedule="cosine", momentum=args.momentum)
    sched = {k: v for k, v in base.items() if k not in ("model", "local_steps")}
    x0 = initial_params(CollabConfig(centers=(CenterSpec("c0"),), **base))
    arms: dict[str, dict] = {}
    print(f"corpus sklearn/datasets/descr ({len(files)} files); train blocks per center "
          f"{[len(data[n][0]) for n in names]}, validation blocks {len(xv)} of {SEQ} bytes", flush=True)

    def ppl(p) -> float:
        return float(evaluate_torch(spec, p, xv, yv)["perplexity"])

    def record(arm: str, curve: list[float], t0: float, extra: dict | None = None) -> None:
        arms[arm] = {"val_perplexity_per_round": curve, "final_val_perplexity": curve[-1],
                     "wall_s": time.time() - t0, **(extra or {})}
        print(f"{arm:10s} val ppl {curve[-1]:.3f}  ({time.time() - t0:.0f} s)", flush=True)

    todo = args.arms.split(",")
    if "local" in todo:
        t0 = time.time()
        trainers = [TorchTrainer(spec, *data[n], center_index=i, **sched) for i, n in enumerate(names)]
        own = [x0] * len(names)
        for r in range(1, args.rounds + 1):
            own = [t.train(p, steps=args.local_steps, round_idx=r)[0] for t, p in zip(trainers, own)]
        per = [ppl(p) for p in own]
        record("local", [float(np.mean(per))], t0, {"per_center_final": per})
    if "pooled" in todo:
        t0 = time.time()
        pooled = TorchTrainer(spec, np.concatenate([data[n][0] for n in names]),
                              np.concatenate([data[n][1] for n in names]), **sched)
        p, curve = x0, []
        for r in range(1, args.rounds + 1):
            p = pooled.train(p, steps=args.local_steps * len(names), round_idx=r)[0]
            curve.append(ppl(p))
        record("pooled", curve, t0)
    runs = [("fedavg", ("torch",) * len(names))] if "fedavg" in todo else []
    if args.mindspore:
        runs.append(("fedavg-ms", tuple("mindspore" if i >= len(names) - 2 else "torch" for i in range(len(names)))))
    for arm, fw in runs:
        t0 = time.time()
        model = ModelSpec(TORCH_MODEL, mindspore=MS_MODEL) if "mindspore" in fw else spec
        cfg = CollabConfig(centers=tuple(CenterSpec(n, framework=f) for n, f in zip(names, fw)),
                           **{**base, "model": model})
        res = run_inprocess(cfg, data, eval_data=(xv, yv))
        record(arm, [float(r.eval["perplexity"]) for r in res.rounds], t0,
               {"frameworks": list(fw), "bytes_up_per_round": sum(res.rounds[0].bytes_up.values()),
                **round_timing(res)})
    out = {"corpus": "sklearn/datasets/descr/*.rst (scikit-learn " + __import__("sklearn").__version__ + ")",
           "files": files, "tokens": "bytes (vocab 256)", "seq": SEQ, "model": TORCH_MODEL,
           "centers": names, "train_blocks": [len(data[n][0]) for n in names], "val_blocks": len(xv),
           "rounds": args.rounds, "local_steps": args.local_steps, "batch": args.batch, "lr": args.lr,
           "momentum": args.momentum, "seed": args.seed, "arms": arms}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "collab_lm" + (f"_{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(json.dumps(out, indent=1))
    lines = ["| arm | centers | final validation perplexity | vs mean local-only | vs pooled | wall s |",
             "|---|---|---|---|---|---|"]
    for arm, d in arms.items():
        ctr = ", ".join(d.get("frameworks", [])) or ("4 separate models" if arm == "local" else "one model, all data")
        vl = d["final_val_perplexity"] - arms["local"]["final_val_perplexity"] if "local" in arms else float("nan")
        vp = d["final_val_perplexity"] - arms["pooled"]["final_val_perplexity"] if "pooled" in arms else float("nan")
        lines.append(f"| {arm} | {ctr} | {d['final_val_perplexity']:.3f} | {vl:+.3f} | {vp:+.3f} | {d['wall_s']:.0f} |")
    lines += ["", "| arm | round s (median) | compute s | comm s | fusion s | comm share (%) |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {arm} | {d['round_s_median']:.3f} | {d['compute_s_median']:.3f} | {d['comm_s_median']:.4f} | "
              f"{d['fusion_s_median']:.4f} | {100 * d['comm_share']:.2f} |" for arm, d in arms.items()
              if "round_s_median" in d]
    md = "\n".join(lines)
    (args.out / f"{stem}.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
