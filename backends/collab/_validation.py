"""Update validation beyond finiteness: what the server checks before an update may be fused.

:func:`~._wire.check_payload` only asks whether a payload is well formed (tensors, shapes, dtypes,
finite numbers). A *finite* poisoned update passes it, so the server (:mod:`._server`) runs the checks
below as well, on by default (``CollabConfig.max_abs_update``, ``norm_bound``, ``step_bound``):

- **Values before decoding** (:func:`check_values`): every coordinate of an update must satisfy
  ``|δ| <= max_abs_update`` (default ``1e4``). For int8 this is checked on the scales, ``127·s_r``,
  before ``q · s_r`` is ever computed, so a payload with scale ``3e38`` is refused instead of decoding to
  inf; a scale must also be finite and ``> 0``. Control variates (SCAFFOLD, gradient estimates) are held
  to the same bound: one huge ``c_i`` would otherwise enter the server's ``c`` and every center's
  correction.
- **Binding to the round** (:func:`check_binding`): the server draws a fresh 48-bit nonce per round
  (:func:`draw_nonce`, ``secrets``: nobody can predict it before the round's model is sent) and sends it
  with the model. A center's reply carries the round index, the digest (:func:`model_digest`) of the
  global model it trained from, and ``binding`` (:func:`reply_binding`): a keyed hash, under the
  nonce, of the round, that digest and the exact bytes of its payload (:func:`payload_digest`). A reply
  naming another round or model, a reply without a binding, and a reply whose binding does not match
  its payload (an old update slipped under this round's metrics) are refused.
- **Replays** (:meth:`UpdateGuard.replayed`): a malicious center can forge everything above, since it
  receives the nonce; what it cannot do is send, as the update of a new model, the bytes of an update
  it (or any center) already sent for another model. The server keeps the payload digest of every
  reply that reached it with the model it was bound to (in the checkpoint too) and refuses a payload
  seen before under another global model, whatever the fusion. The same bytes for the same model (a
  round that did not fuse, re-run) and an all-zero update are not replays. A near copy (an old update
  plus noise) is not caught here: it is an update of ordinary size pointing an old way, the robust
  fusions' and the direction checks' business. Over Flower the reply also travels under the center's
  key (node authentication: the SuperLink sets the sender from the key, :mod:`._flower_app`), and is
  only pulled as the answer to this round's message.
- **Norm of the update** (:class:`UpdateGuard`): ``‖δ_i‖₂`` (all tensors, float64) must not exceed
  ``norm_bound · ref`` (default ``k = 4``), where ``ref`` is the *upper* median of the round's norms,
  lowered to the median of the accepted norms of the last :data:`HISTORY` rounds when that is smaller.
  The upper median: with two centers an attacker who sends a tiny update cannot make the honest one
  look large; the history: with two centers (or an attacker majority) one inflated norm does not set
  the round's median, the earlier rounds do. In the first round, with no history, an update may also
  not exceed ``norm_bound`` times the norm of the global model itself. Outliers are **rejected, not
  clipped**: an update 4× larger than its peers is not a noisy honest update, and keeping a clipped
  copy of it still lets its direction in; robust fusions (:mod:`._fusion`) deal with updates of
  ordinary size pointing the wrong way.
- **Sample counts pinned by the server**: a center's count is its enrolment value
  (``CenterSpec.samples``; a reply claiming another count is refused), or, when none was declared, the
  count it reported first, capped at :data:`SAMPLE_CAP` × the median of that round's claims. Later
  claims never change the pinned count.
- **Direction** (:func:`direction_screen`): with at least 3 updates left, each update's cosine (over the
  trained tensors) to the coordinate-wise median of the *other* updates is recorded (``cos_others`` in
  the round metrics, the audit) and, with ``min_cosine > -1``, an update below it is refused. Off by
  default: with 3 label-skewed centers the median of two others is their mean, which a sign flipper
  drags, and the check refused honest centers (benchmarks/collab_attacks.py --part bn --min-cosine 0:
  honest-only 96.7 -> 94.1%, a sign flip of 1 of 3 at 26%). A trusted direction needs a root set
  (FLTrust, :mod:`._fusion`).
- **Per-layer norms** (:func:`layer_screen`): for each trained tensor ``k`` the reference ``ref_k`` is
  the upper median of ``‖δ_j[k]‖`` over the round's updates left after the norm check; an update's
  ``layer_ratio`` is ``max_k ‖δ_i[k]‖ / ref_k`` (recorded in the round metrics, the audit) and, with
  ``layer_bound > 0``, an update above it is refused. A backdoor boosted in the few tensors that carry
  it keeps its whole norm under ``norm_bound`` while those tensors stand out. Off by default: see
  docs/collab.md for what it was measured to cost and catch.
- **The fused model** (:meth:`UpdateGuard.check_step`): finite, and its step ``‖x' − x‖`` at most
  ``step_bound`` (default 10) × the median step of the recent fused rounds (first round: at most
  ``step_bound`` × the model norm). Otherwise the round is not fused, the old model and the fusion's
  optimiser state stay, and later rounds are judged against that old, sound model.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["HISTORY", "SAMPLE_CAP", "UpdateGuard", "bound_metrics", "check_binding", "check_values",
           "direction_screen", "draw_nonce", "layer_screen", "model_digest", "params_norm", "payload_digest",
           "reply_binding", "step_norm"]

#: how many past rounds' accepted norms and fused steps the bounds look back on
HISTORY = 5
#: an undeclared sample count is capped at this multiple of the median claim of its first round
SAMPLE_CAP = 2.0


def model_digest(params: Mapping[str, np.ndarray]) -> int:
    """A 48-bit digest of a model (names, shapes and float32 bytes, in name order).

    48 bits so it travels exactly as a float metric (Flower's MetricRecord, float64).
    """
    h = hashlib.blake2b(digest_size=6)
    for name in sorted(params):
        a = np.ascontiguousarray(np.asarray(params[name], dtype=np.float32))
        h.update(name.encode() + b"\0" + repr(a.shape).encode())
        h.update(a.tobytes())
    return int.from_bytes(h.digest(), "big")


def draw_nonce() -> int:
    """A fresh, unpredictable 48-bit round nonce (48 bits: exact as a float metric, like the digests)."""
    return secrets.randbits(48)


def payload_digest(payload: Mapping[str, np.ndarray]) -> bytes:
    """A 128-bit digest of a payload's exact bytes (keys, dtypes, shapes and data, in key order)."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(payload):
        a = np.ascontiguousarray(payload[key])
        h.update(key.encode() + b"\0" + a.dtype.str.encode() + repr(a.shape).encode())
        h.update(a.tobytes())
    return h.digest()


def reply_binding(nonce: int, round_idx: int, digest: int, payload: Mapping[str, np.ndarray],
                  pdigest: bytes | None = None) -> int:
    """The 48-bit tag binding a payload to a round: blake2b keyed by the round's nonce over the round
    index, the digest of the model trained from and :func:`payload_digest` of the payload (``pdigest``
    if the caller has it already)."""
    h = hashlib.blake2b(digest_size=6, key=int(nonce).to_bytes(8, "big"))
    pd = payload_digest(payload) if pdigest is None else pdigest
    h.update(int(round_idx).to_bytes(8, "big") + int(digest).to_bytes(8, "big") + pd)
    return int.from_bytes(h.digest(), "big")


def bound_metrics(nonce: int, round_idx: int, digest: int, payload: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The metrics that bind a reply to its round: ``round``, ``model_digest`` and ``binding``."""
    return {"round": float(round_idx), "model_digest": float(digest),
            "binding": float(reply_binding(nonce, round_idx, digest, payload))}


def params_norm(params: Mapping[str, np.ndarray]) -> float:
    """``‖x‖₂`` over all tensors, in float64."""
    # squared in float64 without a float64 copy first: the same numbers as squaring the copy
    return float(np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in params.values())))


def step_norm(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> float:
    """``‖new − old‖₂`` over ``old``'s tensors, the differences taken in float64 (:func:`params_norm`)."""
    return params_norm({k: np.subtract(new[k], old[k], dtype=np.float64) for k in old})


def check_values(payload: Mapping[str, np.ndarray], method: str, max_abs: float) -> list[str]:
    """Problems with the magnitudes in a well-formed payload, found *before* decoding it."""
    problems: list[str] = []
    for key, a in payload.items():
        kind = key.removeprefix("c/").partition("/")[0]  # c/: a control variate, same code and bound
        if kind == "s":  # int8 row scales: the decoded magnitude is at most 127·s
            s = np.asarray(a, dtype=np.float64)
            if np.any(~(s > 0)):
                problems.append(f"{key!r} holds {int(np.sum(~(s > 0)))} scales that are not > 0")
            elif s.size and float(s.max()) * 127.0 > max_abs:
                problems.append(f"{key!r} has scale {float(s.max()):.3g}: decodes to |δ| up to "
                                f"{float(s.max()) * 127.0:.3g} > {max_abs:.3g} (max_abs_update)")
        elif kind == "q" and method != "int8" and a.size:
            a = np.asarray(a)  # max and min in the payload's own dtype: exact, and no float64 copy
            m = max(float(a.max()), -float(a.min()))
            if m > max_abs:
                problems.append(f"{key!r} has |δ| up to {m:.3g} > {max_abs:.3g} (max_abs_update)")
    return problems


def check_binding(metrics: Mapping[str, Any], round_idx: int, digest: int, nonce: int,
                  payload: Mapping[str, np.ndarray], pdigest: bytes | None = None) -> list[str]:
    """A reply trained for another round or from another global model, or whose binding under this
    round's ``nonce`` does not match its payload, is a replay, a stale or a forged reply
    (``pdigest``: :func:`payload_digest` of ``payload``, if the caller has it)."""
    problems = []
    r = metrics.get("round")
    if r is not None and r != round_idx:
        problems.append(f"the reply is for round {r!r}, this is round {round_idx} (replayed or stale)")
    d = metrics.get("model_digest")
    if d is not None and d != digest:
        problems.append("the reply was trained from another global model than this round's (replayed or stale)")
    b = metrics.get("binding")
    if problems:
        return problems
    if r is None or d is None or b is None:
        missing = [k for k, v in (("round", r), ("model_digest", d), ("binding", b)) if v is None]
        problems.append(f"the reply carries no {', '.join(missing)}: it is not bound to this round's nonce "
                        "(a forged reply, or a center of an older version)")
    elif b != reply_binding(nonce, round_idx, digest, payload, pdigest):
        problems.append("the reply's binding does not match its update under this round's nonce (an old or "
                        "altered update sent with this round's metrics)")
    return problems


def direction_screen(deltas: Mapping[str, Mapping[str, np.ndarray]], trained: Sequence[str],
                     min_cosine: float) -> tuple[dict[str, float], dict[str, str]]:
    """Each update's cosine to the coordinate-wise median of the others (over ``trained``), and the
    centers refused for a cosine below ``min_cosine``. Fewer than 3 updates: nothing to compare to.

    The leave-one-out medians come from one sort of every coordinate (:func:`_loo_medians`), not
    from a median of a copy per center; they, the norms and the dots are the float64 numbers
    ``np.median(np.delete(d, i, 0), 0)`` and the plain per-center loop give, bit for bit."""
    if len(deltas) < 3:
        return {}, {}
    names = list(deltas)
    d = _stack64([deltas[c] for c in names], trained)
    refs = _loo_medians(d)
    cos: dict[str, float] = {}
    refused: dict[str, str] = {}
    for i, c in enumerate(names):
        ref = refs[i]
        n = float(np.linalg.norm(d[i]) * np.linalg.norm(ref))
        cos[c] = float(d[i] @ ref / n) if n > 0 else 0.0
        if min_cosine > -1.0 and cos[c] < min_cosine:
            refused[c] = (f"update points away from the others: cosine {cos[c]:+.3f} to the median of the other "
                          f"{len(names) - 1} updates < {min_cosine:g} (min_cosine)")
    return cos, refused


def _stack64(rows: Sequence[Mapping[str, np.ndarray]], keys: Sequence[str]) -> np.ndarray:
    """``rows`` flattened over ``keys`` (in that order) into one float64 ``(len(rows), size)`` array,
    each tensor cast once into its slice (no per-tensor float64 copies, no concatenation)."""
    sizes = [int(np.asarray(rows[0][k]).size) for k in keys]
    out = np.empty((len(rows), sum(sizes)), dtype=np.float64)
    for i, r in enumerate(rows):
        off = 0
        for k, n in zip(keys, sizes):
            out[i, off:off + n] = np.asarray(r[k]).reshape(-1)
            off += n
    return out


#: columns per block in :func:`_loo_medians`: a block's rows stay in cache through the sorting network
_BLOCK = 1 << 15


def _loo_medians(d: np.ndarray) -> np.ndarray:
    """Row ``i``: the coordinate-wise median of the rows of ``d`` other than ``i`` (``d``: ``(n, N)``
    float64, finite, ``n >= 2``), equal to ``np.median(np.delete(d, i, 0), 0)``.

    Every column is sorted once (a compare-exchange network on blocks of columns: ``n`` is the number
    of centers, small); removing the value ``v`` from a sorted column ``s`` leaves ``s_j`` at rank ``j``
    where ``s_j < v`` and ``s_{j+1}`` elsewhere (ties remove an equal value: same multiset), so each
    median of the others is one order statistic (``n`` even) or the mean ``(lo + hi) / 2`` of two, as
    ``np.median`` takes it. ``O(n^2 N)`` cheap vector operations instead of ``n`` partitions of copies."""
    n, size = d.shape
    m = n - 1
    out = np.empty_like(d)
    if n == 3:  # the median of two others is their mean, (a + b) / 2 as np.median takes it: no sort
        for i, (j, k) in enumerate(((1, 2), (0, 2), (0, 1))):
            np.add(d[j], d[k], out=out[i])
            out[i] /= 2
        return out
    ranks = [m // 2] if m % 2 else [m // 2 - 1, m // 2]  # the others' ranks np.median averages
    for a in range(0, size, _BLOCK):
        b = min(size, a + _BLOCK)
        s = [d[j, a:b].copy() for j in range(n)]
        for top in range(n - 1, 0, -1):  # bubble network: after a pass s[top] is the largest left
            for j in range(top):
                lo = np.minimum(s[j], s[j + 1])
                np.maximum(s[j], s[j + 1], out=s[j + 1])
                s[j] = lo
        for i in range(n):
            v = d[i, a:b]
            picks = [np.where(s[r] < v, s[r], s[r + 1]) for r in ranks]
            out[i, a:b] = picks[0] if len(picks) == 1 else (picks[0] + picks[1]) / 2
    return out


def layer_screen(deltas: Mapping[str, Mapping[str, np.ndarray]], trained: Sequence[str],
                 bound: float) -> tuple[dict[str, float], dict[str, str]]:
    """Each update's largest ratio of a tensor's norm to that tensor's upper-median norm over the
    updates (``layer_ratio``), and the centers refused for a ratio above ``bound`` (0: none refused).
    Fewer than 2 updates: nothing to compare to."""
    if len(deltas) < 2:
        return {}, {}
    norms = {c: {k: float(np.linalg.norm(np.asarray(d[k], np.float64))) for k in trained} for c, d in deltas.items()}
    ref = {k: _upper_median([n[k] for n in norms.values()]) for k in trained}
    ratios: dict[str, float] = {}
    refused: dict[str, str] = {}
    for c, n in norms.items():
        worst = max(((n[k] / ref[k], k) for k in trained if ref[k] > 0), default=(0.0, ""))
        ratios[c] = worst[0]
        k = worst[1]
        if bound > 0 and worst[0] > bound:
            refused[c] = (f"tensor {k!r} of the update has norm {n[k]:.4g} > {bound:g} × {ref[k]:.4g} (its upper "
                          "median over the round's updates; layer_bound)")
    return ratios, refused


def _upper_median(values: Sequence[float]) -> float:
    s = sorted(values)
    return float(s[len(s) // 2])


class UpdateGuard:
    """The server's memory for validation: recent accepted norms and fused steps, pinned sample counts."""

    def __init__(self, norm_bound: float, step_bound: float, declared: Mapping[str, int]) -> None:
        self.norm_bound, self.step_bound = float(norm_bound), float(step_bound)
        self.declared = {c: int(n) for c, n in declared.items() if n}
        self.pinned: dict[str, int] = {}
        self.norms: list[list[float]] = []  # per fused round, the accepted norms
        self.steps: list[float] = []  # per fused round, ‖x' − x‖
        self.seen: dict[bytes, tuple[str, int, int]] = {}  # payload digest -> (center, round, model digest)

    # ----------------------------------------------------------------- replays
    def replayed(self, center: str, payload: Mapping[str, np.ndarray], round_idx: int, digest: int,
                 pdigest: bytes | None = None) -> str | None:
        """Why ``payload`` is a replay (None: it is not), remembering it either way.

        A replay is a payload whose exact bytes reached the server before, bound to another global model.
        ``pdigest``: :func:`payload_digest` of ``payload``, if the caller has it.
        """
        if all(not np.any(np.asarray(v)) for k, v in payload.items() if k.removeprefix("c/").startswith("q/")):
            return None  # all-zero: the same bytes whatever the model, and harmless
        key = payload_digest(payload) if pdigest is None else pdigest
        before = self.seen.get(key)
        if before is not None and before[2] != digest:
            return (f"the update is byte-identical to the one {before[0]} sent in round {before[1]} for another "
                    "global model (a replay)")
        if before is None:
            self.seen[key] = (center, int(round_idx), int(digest))
        return None

    # ----------------------------------------------------------------- sample counts
    def samples(self, claims: Mapping[str, float]) -> tuple[dict[str, int], dict[str, str], dict[str, str]]:
        """The count each center is weighted with, the centers refused for lying about it, and the
        centers whose first claim was capped (with what to do about it)."""
        out: dict[str, int] = {}
        refused: dict[str, str] = {}
        capped: dict[str, str] = {}
        new = {c: n for c, n in claims.items() if c not in self.declared and c not in self.pinned}
        cap = SAMPLE_CAP * _upper_median(list(claims.values())) if claims else 0.0
        for c, n in claims.items():
            if c in self.declared:
                if int(n) != self.declared[c]:
                    refused[c] = f"claims {int(n)} samples, enrolled with {self.declared[c]}"
                    continue
                out[c] = self.declared[c]
            elif c in new:
                out[c] = self.pinned[c] = max(1, int(min(n, cap)))
                if out[c] < n:
                    capped[c] = (f"claims {int(n)} samples, weighted as {out[c]} ({SAMPLE_CAP:g} × the median claim); "
                                 "declare its count at enrolment (CenterSpec.samples) to weight it fully")
            else:
                out[c] = self.pinned[c]
        return out, refused, capped

    # ----------------------------------------------------------------- norms
    def reference(self, norms: Mapping[str, float]) -> float | None:
        """``ref`` of the norm bound for this round's norms (None when there is nothing to compare to)."""
        ref = _upper_median(list(norms.values())) if norms else None
        hist = [n for r in self.norms[-HISTORY:] for n in r]
        if hist:
            h = float(np.median(hist))
            ref = h if ref is None else min(ref, h)
        return ref

    def screen(self, norms: Mapping[str, float], model_norm: float) -> dict[str, str]:
        """Centers whose update norm is out of bounds, with the reason."""
        if self.norm_bound <= 0:
            return {}
        ref = self.reference(norms)
        out: dict[str, str] = {}
        for c, n in norms.items():
            if not np.isfinite(n):
                out[c] = f"update norm {n} is not finite"
            elif ref is not None and n > self.norm_bound * ref and n > 0:
                out[c] = (f"update norm {n:.4g} > {self.norm_bound:g} × {ref:.4g} (the robust reference of this "
                          "round's and recent rounds' norms)")
            elif not self.norms and model_norm > 0 and n > self.norm_bound * model_norm:
                out[c] = f"update norm {n:.4g} > {self.norm_bound:g} × the global model's norm {model_norm:.4g}"
        return out

    def check_step(self, old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray],
                   step: float | None = None) -> str | None:
        """Why the fused model ``new`` must not replace ``old`` (None: it may). ``step``: ``‖new − old‖``
        if the caller has it (:func:`params_norm` of the float64 differences), computed here otherwise."""
        for k, v in new.items():
            if not np.all(np.isfinite(v)):
                return f"the fused model holds non-finite values in {k!r}"
        if self.step_bound <= 0:
            return None
        step = step_norm(old, new) if step is None else step
        recent = self.steps[-HISTORY:]
        ref, what = (float(np.median(recent)), "the median recent step") if recent else (params_norm(old),
                                                                                         "the model's norm")
        if ref > 0 and step > self.step_bound * ref:
            return f"the fused step {step:.4g} > {self.step_bound:g} × {ref:.4g} ({what})"
        return None

    def record(self, accepted_norms: Sequence[float], old: Mapping[str, np.ndarray],
               new: Mapping[str, np.ndarray], step: float | None = None) -> None:
        """Remember a fused round (``step`` as in :meth:`check_step`)."""
        self.norms = [*self.norms[-(HISTORY - 1):], [float(n) for n in accepted_norms]]
        step = step_norm(old, new) if step is None else step
        self.steps = [*self.steps[-(HISTORY - 1):], step]

    # ----------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, np.ndarray]:
        out = {f"pinned/{c}": np.array(n, dtype=np.int64) for c, n in self.pinned.items()}
        out["steps"] = np.array(self.steps, dtype=np.float64)
        for i, r in enumerate(self.norms):
            out[f"norms/{i}"] = np.array(r, dtype=np.float64)
        if self.seen:
            out["seen/digest"] = np.array([np.frombuffer(k, np.uint8) for k in self.seen])
            out["seen/center"] = np.array([c for c, _, _ in self.seen.values()], dtype=str)
            out["seen/round_digest"] = np.array([(r, d) for _, r, d in self.seen.values()], dtype=np.int64)
        return out

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.pinned = {k[7:]: int(v) for k, v in state.items() if k.startswith("pinned/")}
        self.steps = [float(x) for x in state.get("steps", np.zeros(0))]
        keys = sorted((k for k in state if k.startswith("norms/")), key=lambda k: int(k[6:]))
        self.norms = [[float(x) for x in state[k]] for k in keys]
        self.seen = {}
        if "seen/digest" in state:
            for k, c, (r, d) in zip(state["seen/digest"], state["seen/center"], state["seen/round_digest"]):
                self.seen[np.asarray(k, np.uint8).tobytes()] = (str(c), int(r), int(d))
