"""Online pruning's server side: the running fused scores, the masks of each round, the cut after
round ``K`` and what a release or a restarted server needs of them (:class:`ServerPruning`; the
centers' side, the scores, the masks and the cut are :mod:`._pruning`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._fusion import CenterUpdate, make_fusion
from ._models import build_torch_model, load_torch_state, torch_state
from ._pruning import (
    SCORE_PREFIX,
    PruneError,
    PruneSpec,
    apply_plan,
    attention_heads,
    channel_ratio_for,
    channels_of,
    example_input,
    group_scores,
    kept_whole,
    mask_and_plan,
    normalised,
    param_count,
    saliency,
    with_input_of,
)
from ._records import record_data
from ._wire import check_payload, decode_update

__all__ = ["ServerPruning"]


def _scores_of(payload: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    n = len(SCORE_PREFIX)
    return {k[n:]: v for k, v in payload.items() if k.startswith(SCORE_PREFIX)}


class ServerPruning:
    """What the server keeps of a pruning job: its own copy of the model (for masks, the cut and
    evaluation), the running fused scores, the plan once cut, and the model at the cut."""

    def __init__(self, config: Any, params: Mapping[str, np.ndarray]) -> None:
        self.spec: PruneSpec = with_input_of(config, None).prune  # refused here without the input row's shape
        x_like = np.zeros((1, *self.spec.input_shape), np.dtype(self.spec.input_dtype))
        self.config = config
        self.model = build_torch_model(config.model, config.seed)
        load_torch_state(self.model, dict(params))
        self.example = example_input(x_like)
        self.model_full = build_torch_model(config.model, config.seed)  # the architecture before the cut
        # the expected score vectors: one per group, as long as its root's channels
        magnitude = normalised(group_scores(self.model, self.example, saliency(self.model, "magnitude")))
        self.layout = {k: v.shape for k, v in magnitude.items()}
        if not self.layout:
            raise PruneError(f"model {config.model.kind!r} has no prunable channel group (conv / linear layers "
                             "feeding other layers); nothing to prune")
        self.params_full = param_count(self.model)
        self._ratios: dict[float, tuple[float, int]] = {}  # uniform allocation: target -> (channel ratio, params)
        if self.spec.target == "params":  # an unreachable target is refused before round 1
            self.channel_ratio(self.spec.ratio, magnitude)
        self.scores: dict[str, np.ndarray] = {}
        self.plan: list[list[Any]] | None = None
        self.cut_params: dict[str, np.ndarray] | None = None  # the full-size (masked) model at the cut
        self.history: list[dict[str, Any]] = []

    def channel_ratio(self, sparsity: float, scores: Mapping[str, np.ndarray]) -> tuple[float, int | None]:
        """``(channel ratio, parameters the cut keeps)`` for the target ``sparsity`` (with
        ``target="channels"`` the sparsity is the channel ratio; the count is then not taken)."""
        spec = self.spec
        if spec.target == "channels":
            return sparsity, None
        if sparsity <= 0:
            return 0.0, self.params_full
        if spec.allocation == "uniform" and sparsity in self._ratios:  # the same widths whatever the scores
            return self._ratios[sparsity]
        got = channel_ratio_for(self.model, self.example, sparsity, scores, allocation=spec.allocation,
                                heads=spec.heads)
        if spec.allocation == "uniform":
            self._ratios[sparsity] = got
        return got

    def expects_scores(self, round_idx: int) -> bool:
        return self.plan is None and round_idx <= self.spec.rounds

    @staticmethod
    def split(payload: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """``(update part, score part)`` of a payload."""
        return ({k: v for k, v in payload.items() if not k.startswith(SCORE_PREFIX)},
                {k: v for k, v in payload.items() if k.startswith(SCORE_PREFIX)})

    def check(self, scores: Mapping[str, np.ndarray], round_idx: int) -> list[str]:
        """Problems with a reply's score part: present exactly in rounds ``1..K``, one finite vector >= 0
        per group of the right length under the job's compression."""
        if not self.expects_scores(round_idx):
            return [f"pruning scores sent in round {round_idx}, after the scoring rounds"] if scores else []
        ref = {k: np.zeros(s, np.float32) for k, s in self.layout.items()}
        problems = [f"pruning scores: {p}" for p in check_payload(_scores_of(scores), ref, self.config.compression)]
        if not problems:
            for k, v in decode_update(_scores_of(scores), self.config.compression).items():
                if np.any(v < 0) or float(v.max(initial=0.0)) > v.size + 1e-3:
                    problems.append(f"pruning scores of {k!r} outside [0, {v.size}] (they are normalised to mean 1)")
        return problems

    def fuse(self, replies: Sequence[tuple[str, int, Mapping[str, np.ndarray]]]) -> dict[str, np.ndarray]:
        """The job's fusion (a fresh instance) over the centers' decoded score vectors."""
        fusion = make_fusion(self.config.fusion, **dict(self.config.fusion_options))
        zero = {k: np.zeros(s, np.float32) for k, s in self.layout.items()}
        ups = [CenterUpdate(c, {k: np.asarray(v, np.float64) for k, v in
                                decode_update(_scores_of(s), self.config.compression).items()}, n)
               for c, n, s in replies]
        return {k: np.asarray(v, np.float64) for k, v in fusion.fuse(zero, ups).items()}

    def after_round(self, round_idx: int, params: Mapping[str, np.ndarray],
                    replies: Sequence[tuple[str, int, Mapping[str, np.ndarray]]]) -> dict[str, np.ndarray]:
        """The global model after round ``round_idx``'s fusion: masked (rounds ``< K``), cut (round ``K``)."""
        params = dict(params)
        if not self.expects_scores(round_idx):
            return params
        if replies:
            new = self.fuse(replies)
            b = self.spec.ema if self.scores else 0.0
            self.scores = {k: b * self.scores.get(k, 0.0) + (1 - b) * v for k, v in new.items()}
        if not self.scores:  # no center has scored yet: nothing to rank by
            return params
        ratio = self.spec.sparsity(round_idx)
        if ratio <= 0.0:  # a warmup round: the scores add up, the model stays whole
            self.history.append({"round": round_idx, "sparsity": 0.0, "channel_ratio": 0.0,
                                 "params_kept": self.params_full, "masked_channels": 0})
            return params
        load_torch_state(self.model, params)
        channels, kept_params = self.channel_ratio(ratio, self.scores)
        plan = mask_and_plan(self.model, self.example, channels, self.scores, allocation=self.spec.allocation,
                             heads=self.spec.heads)
        masked = torch_state(self.model)
        self.history.append({"round": round_idx, "sparsity": ratio, "channel_ratio": channels,
                             "params_kept": kept_params, "masked_channels": sum(len(p[2]) for p in channels_of(plan))})
        if round_idx < self.spec.rounds:
            return masked
        self.cut_params, self.plan = masked, plan
        apply_plan(self.model, self.example, plan)
        return torch_state(self.model)

    def state(self) -> dict[str, np.ndarray]:
        """What a restarted server needs to go on (:meth:`load_state`): the running fused scores, the
        per-round masks' record, and once cut the plan and the full-size model at the cut."""
        out = {f"score/{k}": np.asarray(v) for k, v in self.scores.items()}
        out.update({f"cut/{k}": np.asarray(v) for k, v in (self.cut_params or {}).items()})
        meta = {"history": self.history, "plan": self.plan}
        out["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        return out

    def load_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Take back :meth:`state`; with a plan, the server's model is cut to it (as the centers'
        are, with the next round's model), so it holds the checkpoint's parameters."""
        meta = json.loads(bytes(arrays["meta"]).decode())
        self.history = list(meta["history"])
        self.scores = {k[6:]: np.asarray(v, np.float64) for k, v in arrays.items() if k.startswith("score/")}
        cut = {k[4:]: np.asarray(v) for k, v in arrays.items() if k.startswith("cut/")}
        self.cut_params = cut or None
        self.plan = meta["plan"]
        if self.plan is not None:
            apply_plan(self.model, self.example, self.plan)

    def outcome(self) -> dict[str, Any]:
        """What a release needs: the plan (None when the job stopped before round ``K``), the masks of
        each round, and the full-size model at the cut."""
        heads = attention_heads(self.model_full)  # the q/k/v projections' head counts, named below
        return {"plan": self.plan, "masks": list(self.history), "cut_params": self.cut_params,
                "kept_whole": list(kept_whole(self.model_full, self.example, self.spec.heads)),
                "heads": {n: heads[m] for n, m in self.model_full.named_modules() if m in heads},
                "spec": record_data(self.spec)}
