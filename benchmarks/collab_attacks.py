"""Poisoned updates against the collaborative-training server: attack × fusion × centers → accuracy.

One center of 3 (or of 5) is malicious; the others train honestly on an IID split of scikit-learn's
digits (8×8, 10 classes) with a small MLP; the server evaluates every fused model on 20% held-out
digits. Attacks (``ATTACKS``), all through the in-process engine (the server code the Flower
deployment runs):

- ``huge``: ``1e30`` in every coordinate of the update;
- ``scaled``: the honest update × 1000;
- ``int8_scale``: an int8 payload (the run uses int8) whose row scales are ``3e38``;
- ``samples``: the honest update claiming ``1e9`` samples (``samples_declared``: the federation
  declared every center's count at enrolment; ``samples``: nothing declared, the server pins the first
  claim, capped);
- ``sign_flip``: ``−δ``, the honest update negated;
- ``replay``: the center's round-1 reply re-sent every round (refused: it names round 1 and the
  round-1 model);
- ``replay_forged``: the round-1 update re-sent with this round's metrics, round index, model digest
  and binding forged under this round's nonce (the center knows it): refused, the server has seen
  those bytes for another model;
- ``label_flip``: the center trains honestly on permuted labels (``y → (y + 1) mod 10``).

``none`` is the run with every center honest; ``absent`` the run without the malicious center at all.
Prints the table and writes ``benchmarks/results/collab_attacks.json``::

    .venv/bin/python benchmarks/collab_attacks.py            # the full table
    .venv/bin/python benchmarks/collab_attacks.py --quick    # 3 centers, fedavg only
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT.parent) not in sys.path:
    sys.path.insert(0, str(ROOT.parent))

from polyparallel.backends.collab import CenterSpec, CollabConfig, ModelSpec, run_inprocess  # noqa: E402
from polyparallel.backends.collab._validation import bound_metrics  # noqa: E402
from polyparallel.backends.collab._wire import decode_update, encode_update  # noqa: E402

ATTACKS = ("none", "absent", "huge", "scaled", "int8_scale", "samples", "samples_declared", "sign_flip", "replay",
           "replay_forged", "label_flip")
FUSIONS = ("fedavg", "median", "trimmed_mean", "krum", "centered_clip")
SPEC = ModelSpec("mlp", (64,), 10, hidden=32)
BAD = "c0"  # the malicious center


def digits(n_centers: int) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], tuple[np.ndarray, np.ndarray]]:
    """An IID split of 80% of the digits over ``n_centers`` centers, and the other 20% for evaluation."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    rows = np.random.default_rng(0).permutation(len(y))
    cut = int(0.8 * len(y))
    train, test = rows[:cut], rows[cut:]
    return ({f"c{i}": (x[train[i::n_centers]], y[train[i::n_centers]]) for i in range(n_centers)},
            (x[test], y[test]))


def config(n_centers: int, fusion: str, *, compression: str = "none", declared: dict[str, int] | None = None,
           **kw: Any) -> CollabConfig:
    """The job: ``rounds`` of 10 local SGD steps; a round fuses with one center missing or refused."""
    centers = tuple(CenterSpec(f"c{i}", samples=(declared or {}).get(f"c{i}", 0)) for i in range(n_centers))
    return CollabConfig(centers=centers, model=SPEC, fusion=fusion, compression=compression,
                        min_centers=max(1, n_centers - 1),
                        **{"rounds": 8, "local_steps": 10, "batch_size": 32, "lr": 0.1, "momentum": 0.5, **kw})


def _recode(payload: dict[str, np.ndarray], method: str, f: Callable[[np.ndarray], np.ndarray]):
    return encode_update({k: f(v) for k, v in decode_update(payload, method).items()}, method)


def _rebound(f: Callable) -> Callable:
    """``f`` followed by what a malicious center does last: bind whatever it sends to this round's nonce."""
    def tamper(r: int, p: dict, m: dict, nonce: int) -> tuple[dict, dict]:
        p, m = f(r, p, m, nonce)
        return p, {**m, **bound_metrics(nonce, r, int(m["model_digest"]), p)}
    return tamper


def tampers(attack: str, method: str) -> dict[str, Callable]:
    """The malicious center's rewrite of its reply (``run_inprocess(tamper=...)``), bound to the round's
    nonce after the rewrite (except ``replay``, which re-sends its round-1 reply as it was)."""
    out = _tampers(attack, method)
    return out if attack == "replay" else {c: _rebound(f) for c, f in out.items()}


def _tampers(attack: str, method: str) -> dict[str, Callable]:
    if attack == "huge":
        return {BAD: lambda r, p, m, nonce: ({k: np.full_like(v, 1e30) for k, v in p.items()}, m)}
    if attack == "scaled":
        return {BAD: lambda r, p, m, nonce: (_recode(p, method, lambda d: d * 1000.0), m)}
    if attack == "sign_flip":
        return {BAD: lambda r, p, m, nonce: (_recode(p, method, lambda d: -d), m)}
    if attack == "int8_scale":
        return {BAD: lambda r, p, m, nonce: ({k: np.full_like(v, 3e38) if k.startswith("s/") else v
                                       for k, v in p.items()}, m)}
    if attack in ("samples", "samples_declared"):
        return {BAD: lambda r, p, m, nonce: (p, {**m, "num_samples": 1e9})}
    if attack in ("replay", "replay_forged"):
        first: dict[str, Any] = {}

        def replay(r: int, p: dict, m: dict, nonce: int) -> tuple[dict, dict]:
            old_p, old_m = first.setdefault("reply", (p, m))
            return (old_p, m) if attack == "replay_forged" else (old_p, old_m)
        return {BAD: replay}
    return {}


def run_case(attack: str, fusion: str, n_centers: int, **kw: Any) -> dict[str, Any]:
    """One federation under ``attack``: final accuracy and, per round, who was accepted and refused."""
    data, test = digits(n_centers)
    method = "int8" if attack == "int8_scale" else "none"
    declared = {c: len(v[1]) for c, v in data.items()} if attack == "samples_declared" else None
    if attack == "absent":
        data = {c: v for c, v in data.items() if c != BAD}
        cfg = config(n_centers, fusion, compression=method, **kw)
        cfg = CollabConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                              "centers": cfg.centers[1:], "min_centers": n_centers - 1})
    else:
        cfg = config(n_centers, fusion, compression=method, declared=declared, **kw)
    if attack == "label_flip":
        x, y = data[BAD]
        data = {**data, BAD: (x, (y + 1) % 10)}
    t0 = time.perf_counter()
    res = run_inprocess(cfg, data, eval_data=test, tamper=tampers(attack, method))
    acc = res.rounds[-1].eval.get("accuracy", float("nan"))
    return {"attack": attack, "fusion": fusion, "centers": n_centers, "accuracy": 100.0 * acc,
            "fused_rounds": res.fused_rounds, "ok": res.ok,
            "bad_accepted": sum(BAD in r.accepted for r in res.rounds),
            "bad_rejected": sum(BAD in r.rejected for r in res.rounds),
            "honest_rejected": sum(len(set(r.rejected) - {BAD}) for r in res.rounds),
            "reasons": sorted({why[0].split(":")[0][:60] for r in res.rounds for c, why in r.rejected.items()}),
            "seconds": round(time.perf_counter() - t0, 2)}


def table(rows: Sequence[dict[str, Any]]) -> str:
    fusions = list(dict.fromkeys(r["fusion"] for r in rows))
    out = []
    for n in sorted({r["centers"] for r in rows}):
        out.append(f"\n1 malicious of {n} centers: final accuracy % (malicious reply accepted/rejected over "
                   "8 rounds; !h = honest replies rejected)")
        out.append(f"{'attack':<18}" + "".join(f"{f:>20}" for f in fusions))
        for a in dict.fromkeys(r["attack"] for r in rows):
            cells = []
            for f in fusions:
                r = next((r for r in rows if r["attack"] == a and r["fusion"] == f and r["centers"] == n), None)
                if r is None:
                    cells.append(f"{'-':>20}")
                    continue
                acc = f"{r['accuracy']:.1f}" + ("" if r["ok"] else " FAIL")
                ar = "" if a in ("none", "absent") else f" {r['bad_accepted']}/{r['bad_rejected']}"
                h = f" !h{r['honest_rejected']}" if r["honest_rejected"] else ""
                cells.append(f"{acc + ar + h:>20}")
            out.append(f"{a:<18}" + "".join(cells))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 centers, fedavg only")
    ap.add_argument("--fusions", nargs="*", default=list(FUSIONS))
    ap.add_argument("--centers", nargs="*", type=int, default=[3, 5])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "collab_attacks.json")
    args = ap.parse_args(argv)
    logging.getLogger("polyparallel.collab").setLevel(logging.ERROR)  # the rejections are in the table
    fusions, centers = (["fedavg"], [3]) if args.quick else (args.fusions, args.centers)
    rows = [run_case(a, f, n) for n in centers for f in fusions for a in ATTACKS]
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "mlp 64-32-10, sklearn digits (80/20 split, IID over centers)",
                                    "rounds": 8, "local_steps": 10, "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
