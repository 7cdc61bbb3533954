"""Online pruning with MindSpore centers: the pruned torch model and its masked MindSpore twin.

A MindSpore center (:class:`~._foreign.ForeignTrainer`) takes part in a pruning job through the same
inferred parameter map (:mod:`._param_map`) that carries its updates:

- **Scores** (rounds ``1..K``): the center maps its locally trained parameters to torch names (as it
  does for its update) and scores them on its *own* rows with its torch twin, the model the map was
  checked against at enrolment (same outputs within :data:`~._foreign.VERIFY_RTOL`): the same
  :func:`~._pruning.center_scores` a torch center runs, so the score vectors, their groups and their
  checks are the torch centers' (:func:`~._pruning.scoring_model`).
- **After the cut** the user's ``Cell`` cannot change its widths (its builder fixed them), so the center
  keeps its full-size cell and holds the removed channels at zero: the fused (pruned) model arrives
  under torch names, is *expanded* to the full torch shapes (zeros where the plan removed a channel,
  :func:`kept_indices`: where each kept value sits in the full tensor, found by cutting a copy whose
  values are their own indices), mapped to MindSpore and trained; after every optimiser step the removed
  entries are set back to zero (``after_step``), so every forward computes what the pruned model
  computes; the trained cell is mapped back and *shrunk* to the pruned shapes. A zeroed channel adds
  nothing downstream (its producer's rows and normalisation affine are zero; the groups whose zeros would
  change a normalisation's statistics are kept whole, :func:`~._pruning.kept_whole`), so the masked
  twin and the pruned model are the same function.
- **Checked, as at enrolment:** on the center's first batch, eval mode, the pruned torch model with the
  fused parameters and the masked cell must give outputs within ``VERIFY_RTOL`` relative, before the
  center trains on the cut model (:func:`check_twin`); otherwise the round fails naming the center.

The twin is full-size, so a MindSpore center computes as much as before the cut; the released model
is the torch one (``model.pt2``, ``model.onnx``), which a MindSpore deployment imports from ONNX.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._foreign import VERIFY_RTOL
from ._models import build_torch_model, load_torch_state, torch_state
from ._param_map import apply_map
from ._pruning import apply_plan, conform_trainer, example_input

__all__ = ["check_twin", "conform", "conform_foreign", "expand", "kept_indices", "shrink"]


def kept_indices(spec: Any, seed: int, example: Any, plan: Sequence[Sequence[Any]]) -> dict[str, np.ndarray]:
    """Per exchanged tensor (torch names), the flat indices into its full-size tensor of the values the cut
    keeps, in the pruned tensor's order: a float64 copy of the model whose every value is its own flat
    index, cut by ``plan`` with Torch-Pruning (so every dependent tensor loses what the real cut removes)."""
    import torch

    model = build_torch_model(spec, seed).double()
    with torch.no_grad():
        for v in model.state_dict().values():
            if v.is_floating_point():
                v.copy_(torch.arange(v.numel(), dtype=torch.float64).reshape(v.shape))
    apply_plan(model, example.double() if example.is_floating_point() else example, plan)
    return {k: v.detach().numpy().ravel().astype(np.int64) for k, v in model.state_dict().items()
            if v.is_floating_point()}


def expand(params: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]],
           kept: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The pruned ``params`` in the full ``shapes``: zeros where the cut removed a value."""
    out = {}
    for k, shape in shapes.items():
        full = np.zeros(int(np.prod(shape)), np.float32)
        full[kept[k]] = np.asarray(params[k], np.float32).ravel()
        out[k] = full.reshape(shape)
    return out


def shrink(params: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]],
           kept: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The values of the full-size ``params`` the cut keeps, in the pruned ``shapes``."""
    return {k: np.asarray(params[k], np.float32).ravel()[kept[k]].reshape(shape) for k, shape in shapes.items()}


def check_twin(trainer: Any, pruned: Any, params: Mapping[str, np.ndarray],
               full: Mapping[str, np.ndarray]) -> float:
    """The pruned torch model with ``params`` against the foreign cell with ``full`` (their expansion) on the
    center's first batch in eval mode; raises ValueError beyond ``VERIFY_RTOL`` relative. Returns the error."""
    import torch

    load_torch_state(pruned, dict(params))
    pruned.eval()
    x = np.ascontiguousarray(trainer.x[: trainer.batch_size])
    with torch.no_grad():
        out = pruned(torch.from_numpy(x))
    want = (out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple | list) else out).numpy()
    trainer.fw.load(trainer.model, apply_map(full, trainer.mapping))
    got = np.asarray(trainer.fw.forward(trainer.model, x))
    err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-12))
    if not err <= VERIFY_RTOL:
        raise ValueError(f"center #{trainer.center_index}: after the pruning cut its masked {trainer.framework} model "
                         f"and the pruned torch model differ by {err:.2e} relative (limit {VERIFY_RTOL:g}) on its "
                         "first batch")
    return err


def conform_foreign(trainer: Any, plan: Sequence[Sequence[Any]]) -> None:
    """Make a foreign center train the pruned model as its masked full-size twin (see the module docstring):
    its ``train`` and ``evaluate`` take and give pruned torch shapes, its steps keep the removed entries zero."""
    example = example_input(trainer.x[:1])
    kept = kept_indices(trainer.model_spec, trainer.seed, example, plan)
    full_model = build_torch_model(trainer.model_spec, trainer.seed)
    full_shapes = {k: v.shape for k, v in torch_state(full_model).items()}
    pruned = build_torch_model(trainer.model_spec, trainer.seed)
    apply_plan(pruned, example, plan)
    pruned_shapes = {k: v.shape for k, v in torch_state(pruned).items()}
    ones = {k: np.ones(s, np.float32) for k, s in pruned_shapes.items()}
    mask = apply_map(expand(ones, full_shapes, kept), trainer.mapping)  # 1 kept, 0 removed, MindSpore names
    train, evaluate = trainer.train, trainer.evaluate
    checked: list[float] = []

    import mindspore as ms
    from mindspore import ops

    params = {q.name: q for q in trainer.model.get_parameters() if q.name in mask}
    masks = {k: ms.Tensor(m) for k, m in mask.items() if k in params}

    def remask() -> None:
        # in place (Assign): set_data between steps would hand the optimiser stale tensors (its later
        # updates lost, measured: 3 steps then differ from torch by 8e-4, 6e-8 with Assign)
        for k, m in masks.items():
            ops.assign(params[k], params[k] * m)

    def pruned_train(global_params: Mapping[str, np.ndarray], **kw: Any) -> tuple[dict, dict]:
        full = expand(global_params, full_shapes, kept)
        if not checked:
            checked.append(check_twin(trainer, pruned, global_params, full))
        local, metrics = train(full, **kw)
        return shrink(local, pruned_shapes, kept), metrics

    def pruned_evaluate(params: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray, **kw: Any) -> dict:
        return evaluate(expand(params, full_shapes, kept), x, y, **kw)

    trainer.__dict__.update(train=pruned_train, evaluate=pruned_evaluate, after_step=remask, twin_error=checked,
                            _pruned_by=plan)


def conform(trainer: Any, plan: Sequence[Sequence[Any]] | None) -> None:
    """Give a center the pruned architecture of ``plan`` (once): a torch center cuts its model
    (:func:`~._pruning.conform_trainer`), a foreign one trains its masked twin (:func:`conform_foreign`)."""
    if not plan or getattr(trainer, "_pruned_by", None) is not None:
        return
    if hasattr(trainer, "fw"):
        conform_foreign(trainer, plan)
    else:
        conform_trainer(trainer, plan)
