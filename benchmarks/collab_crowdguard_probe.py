"""CrowdGuard-style cross-checking, offline (issue 33): does a backdoored update's hidden-layer signature on an
honest center's own rows stand apart from an honest, label-skewed update's?

CrowdGuard (Rieger et al., NDSS 2023) has every center run each candidate local model of the round (the
global model + one center's update) on its own rows, compare the candidate's hidden-layer outputs with the
global model's, and vote on outliers. This probe runs the federation of ``collab_attacks.py --part bn``
(``run_bn_case``: label skew, default fusion, the same trigger and poisoned center ``c0``), records each
center's global and local model of every round, and scores each candidate ``i`` as each other center ``j``
(the judge) sees it on ``j``'s training rows (eval mode). Three signatures:

- ``pen``: mean over the judge's rows of ``1 − cos`` between the candidate's and the global model's
  penultimate features (the input of the last Linear);
- ``layers``: the same distance for every BatchNorm output and the penultimate features, each divided by
  that layer's median over the candidates the judge scores, averaged over the layers;
- ``out``: the mean total-variation distance between the candidate's and the global model's softmax.

Rule: a judge flags the candidate with the largest score when it is above ``k`` × the median of the others'
(``--ks``); a candidate is dropped in a round when a strict majority of the ``K − 1`` centers that judged it
flag it. Under ``backdoor`` the attacker votes too, for the honest candidate with the most honest votes (the
worst case for the honest centers); under ``none`` every center is honest. Also printed: each candidate's
share of the judge-rounds in which it scored largest (chance ``1/(K−1)``). A control scores the same
candidates on the judges' rows with the trigger stamped on (``triggered``): what no honest center can do,
it checks that the pipeline sees the backdoor when its input is there. Nothing here changes the fusion:
the federation runs under the default, the scores are computed beside it.

    nice .venv/bin/python benchmarks/collab_crowdguard_probe.py          # seeds 0-2, ~10 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import collab_attacks as ca

from polyparallel.backends.collab._models import build_torch_model, load_torch_state

SIGS = ("pen", "layers", "out")
VIEWS = ("honest", "triggered")
CASES = (("cnn", 0.0), ("resnet", 0.5))  # the cnn under label skew 0.8, the residual CNN under Dirichlet 0.5


def activations(model: Any, params: dict[str, np.ndarray], x: np.ndarray) -> tuple[list[Any], Any]:
    """The BatchNorm outputs and the penultimate features (flattened, float64) and the softmax, eval mode."""
    import torch
    from torch import nn

    load_torch_state(model, {k: np.asarray(v, np.float32) for k, v in params.items()})
    model.eval()
    acts: list[Any] = []
    hooks = [m.register_forward_hook(lambda m, i, o: acts.append(o.flatten(1)))
             for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    hooks.append(last.register_forward_hook(lambda m, i, o: acts.append(i[0].flatten(1))))
    try:
        with torch.no_grad():
            out = model(torch.from_numpy(x))
    finally:
        for h in hooks:
            h.remove()
        model.train()
    return [a.double() for a in acts], torch.softmax(out.double(), 1)


def scores(model: Any, glob: dict[str, np.ndarray], cands: dict[str, dict[str, np.ndarray]],
           x: np.ndarray) -> dict[str, dict[str, float]]:
    """One judge's view: signature -> candidate -> score."""
    import torch

    def cos_dist(a: Any, b: Any) -> float:
        return float((1 - torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-12)).mean())

    ga, gp = activations(model, glob, x)
    per_layer, out = {}, {}
    for c, p in cands.items():
        a, pr = activations(model, p, x)
        per_layer[c] = np.array([cos_dist(u, v) for u, v in zip(a, ga, strict=True)])
        out[c] = float(0.5 * (pr - gp).abs().sum(1).mean())
    med = np.maximum(np.median(np.stack(list(per_layer.values())), axis=0), 1e-12)
    return {"pen": {c: float(v[-1]) for c, v in per_layer.items()},
            "layers": {c: float(np.mean(v / med)) for c, v in per_layer.items()}, "out": out}


def run(attack: str, n: int, seed: int, model_name: str, dirichlet: float) -> dict[str, Any]:
    """The benchmark's federation with every center recorded, and every round's views."""
    rec: dict[str, ca._Recorder] = {}
    row = ca.run_bn_case(attack, "centered_clip", n, seed, model=model_name, dirichlet=dirichlet, record=rec)
    data = ca.skewed_digits(n, seed, dirichlet)[0]  # the honest rows (a judge is honest: never c0's poisoned rows)
    model = build_torch_model(ca.SPECS[model_name])
    rounds = []
    for r in sorted(rec[ca.BAD].models):
        glob = rec[ca.BAD].models[r]
        local = {c: {k: glob[k] + t.updates[r][k] for k in glob} for c, t in rec.items()}
        rounds.append({view: {j: scores(model, glob, {c: p for c, p in local.items() if c != j},
                                        ca.trigger(data[j][0]) if view == "triggered" else data[j][0])
                              for j in rec} for view in VIEWS})
    return {k: row[k] for k in ("attack", "centers", "seed", "model", "dirichlet", "accuracy", "attack_success")} | {
        "rounds": rounds}


def dropped(view: dict[str, dict[str, float]], k: float, attacker: str | None) -> set[str]:
    """The candidates a strict majority of their K − 1 judges flag (largest score > k × median of the others);
    the attacker votes for the honest candidate with the most honest votes."""
    votes: dict[str, int] = defaultdict(int)
    for j, s in view.items():
        if j == attacker:
            continue
        top = max(s, key=s.get)
        if s[top] > k * float(np.median([v for c, v in s.items() if c != top])):
            votes[top] += 1
    if attacker:
        votes[max((c for c in view if c != attacker), key=lambda c: votes[c])] += 1
    return {c for c, v in votes.items() if v >= (len(view) - 1) // 2 + 1}


def summarise(rows: Sequence[dict[str, Any]], ks: Sequence[float]) -> list[dict[str, Any]]:
    """Per run, view, signature: the argmax shares and, per k, c0's dropped rounds and the honest center-rounds
    dropped."""
    out = []
    for r in rows:
        att = ca.BAD if r["attack"] != "none" else None
        for view in VIEWS:
            for sig in SIGS:
                views = [{j: s[sig] for j, s in rd[view].items()} for rd in r["rounds"]]
                top, seen = defaultdict(int), defaultdict(int)
                for v in views:
                    for j, s in v.items():
                        if j != att:
                            top[max(s, key=s.get)] += 1
                            for c in s:
                                seen[c] += 1
                share = {c: top[c] / seen[c] for c in seen}
                rule = {}
                for k in ks:
                    d = [dropped(v, k, att) for v in views]
                    rule[f"{k:g}"] = {"bad_dropped": sum(ca.BAD in x for x in d) if att else 0,
                                      "honest_dropped": sum(len(x - {att}) for x in d)}
                out.append({k: r[k] for k in ("model", "centers", "attack", "seed")} | {
                    "view": view, "signature": sig, "bad_share": round(share[ca.BAD], 3) if att else None,
                    "top_honest_share": round(max(v for c, v in share.items() if c != att), 3), "rule": rule})
    return out


def _total(runs: Sequence[dict[str, Any]], k: float, what: str) -> int:
    return sum(s["rule"][f"{k:g}"][what] for s in runs)


def table(summary: Sequence[dict[str, Any]], ks: Sequence[float]) -> str:
    """Per model, K, view, signature: argmax shares (backdoor: c0 | largest honest; none: largest) per seed, and
    per k the dropped rounds summed over the seeds (backdoor: c0 of 10/seed, honest; none: honest)."""
    lines = ["model  K view      sig    | argmax share per seed: backdoor c0|top honest, none top | "
             + " | ".join(f"k={k:g}: bd c0/honest, none honest" for k in ks)]
    groups: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for s in summary:
        groups[(s["model"], s["centers"], s["view"], s["signature"])][s["attack"]].append(s)
    for (m, n, view, sig), g in groups.items():
        bd, no = g.get("backdoor", []), g.get("none", [])
        share = " ".join(f"{s['bad_share']:.2f}|{s['top_honest_share']:.2f}" for s in bd) + " ; " + " ".join(
            f"{s['top_honest_share']:.2f}" for s in no)
        rules = " | ".join(f"{_total(bd, k, 'bad_dropped')}/{_total(bd, k, 'honest_dropped')}, "
                           f"{_total(no, k, 'honest_dropped')}" for k in ks)
        lines.append(f"{m:6} {n} {view:9} {sig:6} | {share} | {rules}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--centers", nargs="*", type=int, default=[3, 5])
    ap.add_argument("--ks", type=float, nargs="*", default=[1.2, 1.5, 2.0])
    ap.add_argument("--out", type=Path,
                    default=ca.ROOT / "benchmarks" / "results" / "collab_attacks_crowdguard_probe.json")
    args = ap.parse_args(argv)
    logging.getLogger("polyparallel.collab").setLevel(logging.ERROR)
    rows = []
    for model_name, dirichlet in CASES:
        for n in args.centers:
            for attack in ("none", "backdoor"):
                for s in range(args.first_seed, args.first_seed + args.seeds):
                    t0 = time.perf_counter()
                    rows.append(run(attack, n, s, model_name, dirichlet))
                    print(f"{model_name} 1 of {n} {attack} seed {s}: {rows[-1]['accuracy']:.1f}% (attack success "
                          f"{rows[-1]['attack_success']:.0f}%, {time.perf_counter() - t0:.1f} s)", file=sys.stderr,
                          flush=True)
    summary = summarise(rows, args.ks)
    print(table(summary, args.ks))
    raw = [{k: v for k, v in r.items() if k != "rounds"} | {"rounds": [
        {view: {j: {sig: {c: round(x, 5) for c, x in s[sig].items()} for sig in SIGS} for j, s in rd[view].items()}
         for view in VIEWS} for rd in r["rounds"]]} for r in rows]
    args.out.write_text(json.dumps({
        "command": " ".join(["nice .venv/bin/python benchmarks/collab_crowdguard_probe.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "fusion": "centered_clip (default)", "rounds": 10, "poisoned": ca.POISONED, "target": ca.TARGET,
        "cases": [{"model": m, "dirichlet": d, "skew": ca.SKEW if not d else None} for m, d in CASES],
        "ks": args.ks, "summary": summary, "runs": raw}, indent=None) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
