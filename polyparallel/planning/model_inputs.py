"""What a search is given as "the model": a module with its example inputs, a built-in example's
name, a ``package.module:function`` reference, an ONNX file or a captured graph — normalised into
``(model, args, kwargs)`` before anything is captured.

A module given without example inputs gets them inferred where the model says what it takes:
a ``transformers`` model's ``dummy_inputs`` stretched to :data:`INFERRED_SEQ` tokens (with the
input ids as labels for language-model heads), a network whose first layer is an ``nn.Embedding``
(token ids, as labels too when ``forward`` takes ``labels``; the sequence as long as its config
allows, at most :data:`INFERRED_SEQ`), or one whose first layer is an ``nn.Linear``
(``INFERRED_BATCH`` rows of its ``in_features``). Anything else raises an error that
names the argument to pass.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

__all__ = ["INFERRED_BATCH", "INFERRED_SEQ", "model_and_inputs"]

INFERRED_BATCH = 8
INFERRED_SEQ = 128

_LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")


def model_and_inputs(model: Any, example_inputs: Any, example_kwargs: dict[str, Any] | None
                     ) -> tuple[Any, Any, dict[str, Any] | None, str]:
    """``(model, args, kwargs, note)``; ``note`` says what was inferred (empty when nothing was)."""
    import torch

    if isinstance(model, str) and not Path(model).is_file():
        from polyparallel.models import load_model

        if not model.endswith(".onnx"):  # a built-in example, a reference, or an error naming both
            if example_inputs is not None or example_kwargs:
                raise ValueError(f"{model!r} brings its own example inputs; pass a module to give yours")
            m, args, kwargs = load_model(model)
            return m, args, kwargs, ""
    if isinstance(example_inputs, dict) and example_kwargs is None:  # search(model, {"input_ids": x})
        example_inputs, example_kwargs = (), example_inputs
    if not isinstance(model, torch.nn.Module) or example_inputs is not None or example_kwargs:
        return model, example_inputs, example_kwargs, ""
    return _infer(model)


def _infer(model: Any) -> tuple[Any, Any, dict[str, Any], str]:
    import torch

    how = ("pass example_inputs=(one batch of what forward takes,), e.g. search(model, (torch.randn(8, 784),)), "
           "and keyword inputs as example_kwargs={...}")
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    dummy = getattr(model, "dummy_inputs", None)
    config = getattr(model, "config", None)
    fields = vars(config) if config is not None and hasattr(config, "__dict__") else {}
    # the longest sequence the model's config allows (positions table), capped at INFERRED_SEQ
    seq = min([INFERRED_SEQ] + [int(v) for k, v in fields.items()
                                if k in ("max_position_embeddings", "n_positions", "max_seq_len", "seq")
                                and isinstance(v, int) and v > 0])
    params = inspect.signature(model.forward).parameters
    first = next((m for m in model.modules() if not list(m.children())), None)
    if isinstance(first, torch.nn.Embedding) and not isinstance(dummy, dict):
        ids = torch.zeros(INFERRED_BATCH, seq, dtype=torch.long, device=dev)
        labelled = "labels" in params
        return model, (ids,), {"labels": ids} if labelled else {}, (
            f"example inputs inferred from the first layer (Embedding): {INFERRED_BATCH} sequences of {seq} token ids"
            f"{' with themselves as labels' if labelled else ''}; pass example_inputs to plan for other shapes")
    if isinstance(dummy, dict) and isinstance(dummy.get("input_ids"), torch.Tensor):
        ids = torch.zeros(INFERRED_BATCH, seq, dtype=torch.long, device=dev)
        kwargs: dict[str, Any] = {"input_ids": ids}
        if "labels" in params and type(model).__name__.endswith(_LM_HEADS):
            kwargs["labels"] = ids
        if "decoder_input_ids" in params and "labels" not in kwargs:
            kwargs["decoder_input_ids"] = ids
        if "use_cache" in params:  # a training step keeps no key/value cache
            kwargs["use_cache"] = False
        return model, (), kwargs, (f"example inputs inferred: {INFERRED_BATCH} sequences of {seq} token ids"
                                   f"{' with themselves as labels' if 'labels' in kwargs else ''}; pass "
                                   "example_inputs to plan for other shapes")
    if isinstance(first, torch.nn.Linear):
        x = torch.zeros(INFERRED_BATCH, first.in_features, device=dev)
        return model, (x,), {}, (f"example inputs inferred from the first layer ({type(first).__name__}): "
                                 f"{INFERRED_BATCH} rows of {first.in_features} features")
    kind = type(first).__name__ if first is not None else "no layers"
    raise ValueError(f"cannot infer example inputs of {type(model).__name__} (its first layer is {kind}): {how}")
