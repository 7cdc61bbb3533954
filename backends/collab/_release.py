"""The release of a pruned collaborative job: the smaller model as ``model.pt2`` and ``model.onnx``, and
``release.json`` with what it costs and how well it does, before and after the cut.

- ``model.pt2``: ``torch.export`` of the pruned model in eval mode, batch dimension dynamic.
- ``model.onnx``: the same through ``torch.onnx.export``; checked with onnxruntime against torch on
  the evaluation rows (``onnx_check``: the largest absolute difference of the outputs and the share of
  rows whose predicted class agrees).
- ``release.json``: ``params_before`` / ``params_after`` (parameters; ``params_removed`` their share,
  at least the job's ``--prune`` ratio when its ``target`` is ``params``), ``flops_before`` /
  ``flops_after`` (2 × the multiply-accumulates of one example, Torch-Pruning's counter),
  ``accuracy_before`` (the full-size model at the cut: the job's model of round ``K`` with its last
  soft mask), ``accuracy_at_cut`` (the pruned model right after the cut, before fine-tuning: equal to
  ``accuracy_before`` when the cut preserves the function), ``accuracy_after`` (the released model),
  and CPU latency of a forward in eval mode at batch 1 and 32 (median of timed runs after warm-up, one
  intra-op thread, so two releases compare on a shared machine), before and after.

"Before" is the model the job held when it cut; a job's *unpruned* baseline is another run (the
benchmark ``benchmarks/collab_pruning.py`` runs both).
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ._center import torch_threads
from ._models import build_torch_model, load_torch_state
from ._objective import TorchObjective, evaluate
from ._pruning import PruneError, apply_plan, example_input

__all__ = ["RELEASE_FILES", "check_release_dir", "latency_s", "onnx_check", "size_of", "write_release"]

RELEASE_FILES = ("model.pt2", "model.onnx", "release.json")


def check_release_dir(out: Path, force: bool) -> None:
    """Refuse a release directory that exists (unless ``force``), before any training."""
    out = Path(out)
    if out.exists() and not force:
        raise PruneError(f"release directory {out} exists: give another, or --force to overwrite its "
                         f"{', '.join(RELEASE_FILES)}")
    if out.exists() and not out.is_dir():
        raise PruneError(f"release directory {out} is a file")


def size_of(model: Any, example: Any) -> tuple[int, int]:
    """``(parameters, FLOPs of one example)``: FLOPs = 2 × Torch-Pruning's multiply-accumulate count."""
    import torch_pruning as tp

    macs, params = tp.utils.count_ops_and_params(model, example[:1])
    return int(params), int(2 * macs)


def latency_s(model: Any, x_like: np.ndarray, batch: int, reps: int = 30) -> float:
    """Median seconds of one eval-mode forward at ``batch`` rows (random input), one thread, after warm-up."""
    import torch

    x = torch.from_numpy(np.repeat(np.asarray(x_like[:1]), batch, axis=0))
    if x.is_floating_point():
        x = torch.randn_like(x)
    model.eval()
    times = []
    with torch_threads(1), torch.inference_mode():
        for _ in range(5):
            model(x)
        for _ in range(reps):
            t = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def _accuracy(model: Any, loss: str, x: np.ndarray, y: np.ndarray) -> float | None:
    model.eval()
    with torch_threads(1):
        m = evaluate(model, TorchObjective(model, loss), x, y, 1024)
    return m.get("accuracy")


def onnx_check(path: Path, model: Any, x: np.ndarray, batch: int = 256) -> dict[str, float]:
    """The ONNX model under onnxruntime against ``model`` in torch on the rows ``x``."""
    import onnxruntime as ort
    import torch

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    model.eval()
    diff, agree, n = 0.0, 0, 0
    for i in range(0, len(x), batch):
        xb = np.ascontiguousarray(x[i:i + batch])
        got = sess.run(None, {name: xb})[0]
        with torch.no_grad():
            want = model(torch.from_numpy(xb))
        want = (want.logits if hasattr(want, "logits") else want[0] if isinstance(want, tuple | list) else want).numpy()
        diff = max(diff, float(np.max(np.abs(got - want))))
        agree += int(np.sum(got.argmax(-1) == want.argmax(-1)))
        n += len(xb)
    return {"max_abs_diff": diff, "argmax_agreement": agree / max(1, n), "rows": float(n)}


def _export(model: Any, example: Any, out: Path) -> None:
    import torch

    model.eval()
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    shapes = ({0: batch},)
    ep = torch.export.export(model, (example,), dynamic_shapes=shapes)
    torch.export.save(ep, str(out / "model.pt2"))
    torch.onnx.export(model, (example,), str(out / "model.onnx"), dynamic_shapes=shapes, dynamo=True,
                      external_data=False, verbose=False)


def write_release(out: Path, config: Any, params: Mapping[str, np.ndarray], pruning: Mapping[str, Any],
                  eval_data: tuple[np.ndarray, np.ndarray], force: bool = False) -> dict[str, Any]:
    """Write the release of a pruned job (``result.params``, ``result.pruning``) into ``out``; returns
    what ``release.json`` holds."""
    out = Path(out)
    check_release_dir(out, force)
    plan, cut = pruning.get("plan"), pruning.get("cut_params")
    if not plan or cut is None:
        raise PruneError("the job did not reach its pruning round K, so there is no pruned model to release")
    x, y = eval_data
    example = example_input(x[:1])
    before = build_torch_model(config.model, config.seed)
    load_torch_state(before, dict(cut))
    at_cut = build_torch_model(config.model, config.seed)
    load_torch_state(at_cut, dict(cut))
    apply_plan(at_cut, example, plan)
    after = build_torch_model(config.model, config.seed)
    apply_plan(after, example, plan)
    load_torch_state(after, dict(params))
    for m in (before, at_cut, after):
        m.eval()
    out.mkdir(parents=True, exist_ok=True)
    ex = example_input(x[:1])
    ex = ex if not ex.is_floating_point() else ex.normal_()
    _export(after, ex, out)
    check = onnx_check(out / "model.onnx", after, x)
    (pb, fb), (pa, fa) = size_of(before, example), size_of(after, example)
    rel = {
        "params_before": pb, "params_after": pa, "params_removed": 1 - pa / pb,
        "flops_before": fb, "flops_after": fa,
        "accuracy_before": _accuracy(before, config.model.loss, x, y),
        "accuracy_at_cut": _accuracy(at_cut, config.model.loss, x, y),
        "accuracy_after": _accuracy(after, config.model.loss, x, y),
        "latency_s": {"before": {str(b): latency_s(before, x, b) for b in (1, 32)},
                      "after": {str(b): latency_s(after, x, b) for b in (1, 32)},
                      "threads": 1, "machine": platform.processor() or platform.machine()},
        "onnx_check": check,
        "pruning": {**dict(pruning.get("spec", {})), "masks": pruning.get("masks", []), "plan": plan,
                    "kept_whole": list(pruning.get("kept_whole", [])), "heads": dict(pruning.get("heads", {}))},
        "eval_rows": len(x),
    }
    (out / "release.json").write_text(json.dumps(rel, indent=1) + "\n")
    return rel
