"""Mixed precision as the cost model prices it: bf16 / fp16 compute, fp32 master weights and optimizer state.

A strategy's ``dtype`` "bf16" or "fp16" trains under autocast with fp32 parameters (DDP, tensor
parallelism) or FSDP2's ``MixedPrecisionPolicy`` (bf16/fp16 all-gathers, fp32 gradient reduction),
fp16 with a gradient scaler. Each run is compared with an independent single-process fp32 loop
over the same global batches: within 2% over 20 steps. That it really computed in low precision is
checked twice: every ``nn.Linear`` of the workers' models has a forward hook that raises unless its
output has the compute dtype, and the losses differ from fp32 training by more than fp32 round-off
(the fp32 distributed runs agree with one process to ~1e-7).

fp16's dynamic loss scale starts at torch's 2**16; a step whose gradients overflow is skipped (the
log says ``skipped``) and the scale halves, so the reference skips the same optimizer steps.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import polyparallel as pp
from polyparallel.backends.torch import _examples as ex
from polyparallel.backends.torch import train
from tests import zoo

STEPS, LR, SEED, BATCH = 20, 0.1, 0, 8
TOL = 0.02  # the bound for bf16/fp16 against fp32
ROUND_OFF = 1e-6  # fp32 runs match one process far closer than this (test_exact_semantics: <= 1e-7)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _probed(model_fn, dtype: torch.dtype) -> nn.Module:
    """``model_fn()`` whose Linears refuse, in a worker (where torch.distributed is initialised; the
    launcher's capture runs in fp32), to have computed in anything but ``dtype``."""
    model = model_fn()

    def check(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if dist.is_initialized() and out.dtype != dtype:
            raise RuntimeError(f"a Linear computed in {out.dtype}, not {dtype}")

    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_hook(check)
    return model


def gpt_bf16() -> nn.Module:
    return _probed(ex.tiny_gpt, torch.bfloat16)


def gpt_fp16() -> nn.Module:
    return _probed(ex.tiny_gpt, torch.float16)


def llama_bf16() -> nn.Module:
    return _probed(zoo.hf_llama, torch.bfloat16)


def llama_fp16() -> nn.Module:
    return _probed(zoo.hf_llama, torch.float16)


MODELS = {"gpt": (ex.tiny_gpt, ex.gpt_data, {"bf16": gpt_bf16, "fp16": gpt_fp16}),
          "llama": (zoo.hf_llama, zoo.lm_data, {"bf16": llama_bf16, "fp16": llama_fp16})}


@functools.cache
def _fp32_reference(model_fn, data_fn, skipped: frozenset[int] = frozenset()) -> list[float]:
    """One process, fp32, the whole global batch, SGD; no optimizer step at the ``skipped`` steps."""
    return ex.single_process_losses(model_fn, data_fn, steps=STEPS, lr=LR, seed=SEED, skip_steps=skipped)


def _check(log: list[dict], model_fn, data_fn, dtype: str, what: str) -> None:
    assert [r["step"] for r in log] == list(range(STEPS))
    assert {r["dtype"] for r in log} == {dtype}
    skipped = frozenset(r["step"] for r in log if r.get("skipped"))
    if dtype == "fp16":
        assert all(r["loss_scale"] > 0 for r in log)
        assert len(skipped) <= 2, f"{len(skipped)} of {STEPS} fp16 steps overflowed"
    else:
        assert "loss_scale" not in log[0] and not skipped
    ref = _fp32_reference(model_fn, data_fn, skipped)
    err = max(abs(r["loss"] - w) / abs(w) for r, w in zip(log, ref, strict=True))
    print(f"{what}: max relative loss difference to fp32 over {STEPS} steps {err:.2e}"
          + (f" (skipped steps {sorted(skipped)}, like the reference)" if skipped else ""))
    assert err <= TOL
    assert err > ROUND_OFF  # low-precision compute changed the numbers


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("zero_stage", [0, 3], ids=["ddp", "fsdp"])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_data_parallel_mixed_precision_tracks_fp32(model: str, zero_stage: int, dtype: str) -> None:
    model_fn, data_fn, probes = MODELS[model]
    x, y = data_fn(0)
    s = pp.evaluate(model_fn(), (x, y), "local-cpu:2", batch_size=BATCH, dp=2, microbatches=1,
                    zero_stage=zero_stage, recompute="none", dtype=dtype)
    assert (s.dp, s.zero_stage, s.dtype) == (2, zero_stage, dtype)
    log = train(s, probes[dtype], data_fn, steps=STEPS, lr=LR, seed=SEED)
    _check(log, model_fn, data_fn, dtype, f"{model} dp=2 zero={zero_stage} {dtype}")


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_tensor_parallel_mixed_precision_tracks_fp32(dtype: str) -> None:
    """DTensor parameters under autocast; fp16's overflow check over every rank's local shards."""
    x, y = ex.gpt_data(0)
    s = pp.evaluate(ex.tiny_gpt(), (x, y), "local-cpu:2", batch_size=BATCH, dp=1, tp=2, microbatches=1,
                    recompute="none", dtype=dtype)
    log = train(s, MODELS["gpt"][2][dtype], ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    _check(log, ex.tiny_gpt, ex.gpt_data, dtype, f"gpt tp=2 {dtype}")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("nproc", "dp", "zero_stage", "schedule", "dtype"),
                         [(2, 1, 0, "1f1b", "bf16"), (4, 2, 3, "gpipe", "fp16")])
def test_pipeline_mixed_precision_tracks_fp32(nproc: int, dp: int, zero_stage: int, schedule: str,
                                              dtype: str) -> None:
    """Autocast inside each stage's forward and the loss tail; the fp16 scale over every stage."""
    x, y = ex.gpt_data(0)
    s = pp.evaluate(ex.tiny_gpt(), (x, y), f"local-cpu:{nproc}", batch_size=BATCH, dp=dp, pp=2, microbatches=2,
                    schedule=schedule, zero_stage=zero_stage, recompute="none", dtype=dtype)
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=STEPS, lr=LR, seed=SEED)
    _check(log, ex.tiny_gpt, ex.gpt_data, dtype, f"gpt pp=2 dp={dp} zero={zero_stage} {schedule} {dtype}")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_search_writes_bf16_plans_that_train_runs() -> None:
    x, y = ex.gpt_data(0)
    s = pp.search(ex.tiny_gpt(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=BATCH,
                  constraints={"dtype": "bf16"})
    assert s.dtype == "bf16"
    assert not any("planning only" in n for n in s.search.notes)
    # not the probed model: a pipeline plan exports the model on the workers, in fp32
    log = train(s, ex.tiny_gpt, ex.gpt_data, steps=3, lr=LR, seed=SEED)
    assert {r["dtype"] for r in log} == {"bf16"}
    ref = _fp32_reference(ex.tiny_gpt, ex.gpt_data)[:3]
    err = max(abs(r["loss"] - w) / w for r, w in zip(log, ref, strict=True))
    print(f"searched bf16 plan (dp={s.dp} tp={s.tp} pp={s.pp} m={s.microbatches} zero={s.zero_stage}): {err:.2e}")
    assert ROUND_OFF < err <= TOL


def test_unexecuted_precisions_are_refused_by_the_predicates() -> None:
    from polyparallel.backends.torch.capabilities import EXECUTED_DTYPES, plan_problems

    x, y = ex.gpt_data(0)
    s = pp.evaluate(ex.tiny_gpt(), (x, y), "local-cpu:2", batch_size=BATCH, dp=2, microbatches=1,
                    recompute="none", dtype="bf16")
    assert set(EXECUTED_DTYPES) == {"fp32", "bf16", "fp16"}
    assert plan_problems(None, s.plan) == []
    why = plan_problems(None, s.plan.replace(dtype="fp8"))
    assert len(why) == 1 and "dtype 'fp8'" in why[0]
