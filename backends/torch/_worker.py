"""Worker body, one per rank, started by torch.distributed.run.

``python -m polyparallel.backends.torch._entry RUN_DIR`` reads ``RUN_DIR/job.pkl`` (the plan, the
model and data functions, optimiser settings), trains, and has rank 0 append one JSON line per step
to ``RUN_DIR/train.jsonl``. A failing rank writes ``RUN_DIR/failure-rank{R}.json`` (step, error,
traceback) before exiting non-zero, so the launcher can say which rank failed and why.

**Semantics: single-process training on the global batch.** Each of the ``R`` replicas (``dp``,
times ``sp``) trains on a contiguous share; DDP and FSDP average the replicas' gradients.

*BatchNorm* takes its batch statistics over the replicas (``_batchnorm``: mean and variance of the
global batch through a differentiable all-reduce, equal running statistics on every replica) unless
the job says ``batchnorm="per_replica"``, where each share is normalised alone (torch's BatchNorm
under DDP, rank 0's running statistics broadcast), which is not single-process training.

*Loss.* ``model(x, y)`` returns the mean loss of the rank's share. Its forward runs under
``_loss_weighting.TargetCount``: when that loss is one mean-reduced cross entropy / NLL, the rank
knows the count ``c_r`` it divided by (targets not ignored, times the class weight), one all-reduce
gives ``T = Σ_r c_r``, and the rank backpropagates ``L_r · c_r · R / T``; after the replicas'
average the gradient is ``∇ Σ_r L_r c_r / T``, that of the global batch's mean over its valid
targets, which is the logged loss (``loss_weighting: "tokens"``). For any other loss (an MSE, a
custom or composite loss) every rank backpropagates ``L_r`` and the log has the mean of the means
(``"mean_of_means"``), the global mean when the shares are equal and the loss's mean is over a
fixed count.

*Gradient accumulation* (``microbatches > 1`` without pipeline stages, :func:`_accumulate`): the
rank's share is cut into equal micro-batches, backpropagated one by one with the replicas'
gradient reduction only in the last backward (DDP, ZeRO-1; ZeRO-2/3 keep sharded gradients and
reduce-scatter every micro-batch's), and weighted like pipeline micro-batches (the count
summed over all micro-batches and replicas). *Precision*: the strategy's ``dtype``
(``_precision``: autocast, FSDP2 mixed precision, fp16 gradient scaling).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from polyparallel.backends.torch._batchnorm import has_batch_statistics, use_cross_rank_batchnorm
from polyparallel.backends.torch._expert_parallel import apply_expert_parallel
from polyparallel.backends.torch._loss_weighting import TargetCount, _local, weigh_microbatches, weighed_forward
from polyparallel.backends.torch._pipeline import pipeline_mode
from polyparallel.backends.torch._precision import Precision
from polyparallel.backends.torch._recompute import apply_recompute
from polyparallel.backends.torch._sequence_parallel import sequence_shard
from polyparallel.backends.torch._steps import make_optimizer, scale_gradients
from polyparallel.backends.torch._tensor_parallel import (
    build_mesh,
    parallelize,
    replica_mesh,
    step_context,
)
from polyparallel.backends.torch._train_loop import TrainingMode, train
from polyparallel.cost_models.layers import layer_of
from polyparallel.references import resolve

__all__ = ["resolve", "run_worker"]


def _apply(model: torch.nn.Module, job: dict[str, Any], device: torch.device,
           fsdp_kwargs: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    plan = job["plan"]
    mesh = build_mesh(device.type, plan)
    parallelize(model, plan, mesh)
    cross_rank_bn = job.get("batchnorm", "cross_rank") == "cross_rank" and _cross_rank_batchnorm(model, mesh, plan)
    apply_recompute(model, plan.recompute, plan.recompute_blocks)  # after TP, before DDP / FSDP2 wrap the model
    if plan.compile == "regional":  # after TP and checkpointing, before DDP / FSDP2 (torchtitan's order)
        for name in _blocks(model):
            model.get_submodule(name).compile()
    # what DDP must not average or broadcast: the expert shards, each sequence shard's rows of a table;
    # what FSDP2 must not shard: the expert shards
    ignored = [path for path, _, _ in plan.tables]
    if getattr(plan, "ep", 1) > 1:  # before DDP
        replicas = replica_mesh(mesh, plan)
        ignored += apply_expert_parallel(model, plan.ep, replicas.size(), dist.get_process_group_ranks(
            replicas.get_group()))
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    if plan.data_parallel == "ddp":
        # cross-rank BatchNorm keeps the running statistics equal on every replica: nothing to broadcast
        model = DistributedDataParallel(model, process_group=replica_mesh(mesh, plan).get_group(),
                                        device_ids=[device.index] if device.type == "cuda" else None,
                                        forward_sync_buffers=not cross_rank_bn)
    elif plan.data_parallel == "fsdp":
        # the expert shards stay whole on their rank (each holds other experts: nothing to shard or average)
        experts = {p for name, p in model.named_parameters() if name in set(ignored)}
        _fully_shard(model, replica_mesh(mesh, plan), plan.zero_stage,
                     {**fsdp_kwargs, "ignored_params": experts} if experts else fsdp_kwargs)
    return model, mesh


def _fully_shard(model: torch.nn.Module, mesh: Any, zero_stage: int, fsdp_kwargs: dict[str, Any]) -> list[str]:
    """FSDP2 as ``cost_models.step`` prices ZeRO ``zero_stage``: one ``fully_shard`` unit per numbered
    layer (the blocks ``recompute='full'`` checkpoints and the cost model's layer segments), then the
    root, which holds the rest (embeddings, final norm, head). Returns the blocks' module paths.

    Per-block units let FSDP2 gather block ``i+1`` while block ``i`` computes and reduce-scatter a
    block's gradients as soon as the backward has produced them; one root unit would gather every
    weight before the forward and reduce every gradient after the backward, with nothing to hide
    them behind. ZeRO-3 reshards each block after its forward (gathered again for its backward);
    ZeRO-1/2 keep the gathered weights from the forward to the backward (``reshard_after_forward=
    False``)."""
    blocks = _blocks(model)
    for name in blocks:
        fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=zero_stage >= 3, **fsdp_kwargs)
    # the root's weights (the head is the last used by the forward, the first by the backward) stay
    # gathered from its forward to its backward
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **fsdp_kwargs)
    return blocks


def _blocks(model: torch.nn.Module) -> list[str]:
    """Module paths of the outermost numbered layers (``layers.3``, ``h.0``): the repeated blocks that
    FSDP2 shards one by one and ``compile="regional"`` compiles one by one (a unit inside another
    would split its gather, a compiled region inside another would be compiled twice)."""
    blocks: list[str] = []
    for name, _ in model.named_modules():
        if name and layer_of(name) == name and not any(name.startswith(b + ".") for b in blocks):
            blocks.append(name)
    return blocks


def _cross_rank_batchnorm(model: torch.nn.Module, mesh: Any, plan: Any) -> int:
    """Give ``model``'s BatchNorms the statistics of the batch summed over the replicas (dp, times
    sp); return how many there are.

    Their collectives run on groups of their own (the same ranks as the replica group): DDP's and
    FSDP's gradient reductions are issued from backward hooks on theirs, and BatchNorm's backward
    all-reduces interleaved with them on one group could be ordered differently on two ranks.
    """
    grid = mesh.mesh  # global ranks, shape (dp, sp or cp, tp)
    if not has_batch_statistics(model) or plan.dp * plan.seq == 1:
        return 0
    # the replica groups: every rank with the same tp coordinate (and sequence shard, unless the
    # sequence is split: then the shards hold the batch's tokens between them)
    groups = ([grid[:, :, t].flatten().tolist() for t in range(plan.tp)] if plan.seq > 1 else
              [grid[:, s, t].tolist() for s in range(plan.seq) for t in range(plan.tp)])
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return use_cross_rank_batchnorm(model, mine, len(groups[0]))


@contextlib.contextmanager
def _gradient_sync(model: torch.nn.Module, plan: Any, sync: bool) -> Iterator[None]:
    """Reduce the replicas' gradients in this block's backward only when ``sync``: accumulated
    micro-batches add into unreduced gradients and the last one's backward reduces the sum.
    Tensor parallelism alone needs nothing (its gradients are reduced inside the backward)."""
    if plan.data_parallel == "ddp" and not sync:
        with model.no_sync():  # type: ignore[operator]
            yield
        return
    if plan.data_parallel == "fsdp":
        # ZeRO-2/3 keep sharded gradients: every micro-batch's are reduce-scattered as its backward
        # produces them. ZeRO-1 accumulates full gradients and reduce-scatters once, in the last
        # backward, and keeps the weights gathered between its micro-batches (one gather per step)
        model.set_requires_gradient_sync(sync or plan.zero_stage >= 2)  # type: ignore[operator]
        if plan.zero_stage <= 2:
            model.set_reshard_after_backward(sync)  # type: ignore[operator]
    yield


def _accumulate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, plan: Any, mesh: Any, prec: Precision,
                replicas: int, device: torch.device) -> tuple[float, str]:
    """Gradient accumulation (``microbatches > 1`` without pipeline stages): the rank's share is cut
    into equal micro-batches, each backpropagated in turn, the gradients reduced over the replicas as
    :func:`_gradient_sync` says; returns the step's loss and weighting (``_loss_weighting``).

    As in a pipeline, micro-batch ``j`` backpropagates ``L_j c_j / (u m)`` when its loss counted
    ``c_j`` targets (``u``: its number of labels), ``L_j / m`` otherwise, and once every micro-batch
    has run one all-reduce gives the count over all micro-batches and replicas, by which the
    gradients are then scaled (:func:`.weigh_microbatches`): the step's gradient is that of the
    global batch's mean over its valid targets, whatever the micro-batches' padding."""
    m = plan.microbatches
    if x.shape[0] % m:
        raise ValueError(f"a rank's share of {x.shape[0]} samples does not split into {m} equal micro-batches")
    counts_once = mesh["tp"].get_local_rank() == 0  # tensor-parallel peers compute copies of one loss
    losses: list[torch.Tensor] = []
    counts: list[float | None] = []
    for j, (xj, yj) in enumerate(zip(x.chunk(m), y.chunk(m), strict=True)):
        with _gradient_sync(model, plan, j == m - 1), step_context(plan, mesh):
            counter = TargetCount()
            with counter, prec.autocast():
                loss = model(xj, yj)
            count = counter.count_for(loss)
            part = loss if count is None else loss * (count / yj.numel())
            prec.scale(part / m).backward()
        if counts_once:
            losses.append(_local(part).detach())
            counts.append(count)
    factor, global_loss, weighting = weigh_microbatches(losses, counts, m, replicas, device, unit=y.numel() // m)
    scale_gradients(model.parameters(), factor)
    return global_loss, weighting


def _whole_batch(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, plan: Any, mesh: Any, prec: Precision,
                 replicas: Any, device: torch.device) -> tuple[float, str]:
    """Without accumulation: the rank's share in one forward and backward, its loss weighted over the
    replicas (``_loss_weighting``); returns the step's loss and weighting."""
    def forward() -> torch.Tensor:
        with prec.autocast():
            return model(x, y)

    with step_context(plan, mesh):
        loss, global_loss, weighting = weighed_forward(forward, replicas.get_group(), replicas.size(), device)
        prec.scale(loss).backward()
    return global_loss, weighting


def _whole_model_mode(job: dict[str, Any], device: torch.device) -> TrainingMode:
    """The model whole on every rank, parallelised over the strategy's mesh (:func:`_apply`); each
    ``dp`` replica trains on a contiguous share of the batch, each ``sp`` rank on its block of the
    sequence."""
    plan = job["plan"]
    torch.manual_seed(job["seed"])  # every rank builds the same initial weights
    model = resolve(job["model_fn"])().to(device)
    prec = Precision(plan.dtype, device)
    model, mesh = _apply(model, job, device, prec.fsdp_kwargs())
    opt = make_optimizer(job["optimizer"], model.parameters(), job["lr"], device)
    dp_rank = mesh["dp"].get_local_rank()
    local = plan.global_batch // plan.dp
    sl = slice(dp_rank * local, (dp_rank + 1) * local)
    replicas = replica_mesh(mesh, plan)  # dp, times sp: each holds an equal share of the tokens

    def share(inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (sequence_shard(t[sl], plan, mesh).to(device) for t in (inputs, labels))
        return x, y

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> tuple[float, str]:
        if plan.microbatches > 1:
            return _accumulate(model, x, y, plan, mesh, prec, replicas.size(), device)
        return _whole_batch(model, x, y, plan, mesh, prec, replicas, device)

    # rank0_input_shape: what a rank trains on, its dp and sp share
    return TrainingMode(model, opt, prec, share, forward_backward,
                        log_first=lambda x: {"rank0_input_shape": list(x.shape)},
                        log_last={"microbatches": plan.microbatches} if plan.microbatches > 1 else {})


def run_worker(run_dir: Path) -> None:
    job = pickle.loads((run_dir / "job.pkl").read_bytes())
    rank = int(os.environ["RANK"])
    step = -1
    try:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dist.init_process_group("nccl" if cuda else "gloo")
        if job["plan"].pipeline is not None:  # the exported graph cut into stages (same loop, log and checkpoints)
            mode = pipeline_mode(job, device)
        else:
            mode = _whole_model_mode(job, device)
        for step in train(job, run_dir, rank, device, mode):  # noqa: B007 - a failure names `step`
            pass
        # every rank leaves together: a rank tearing gloo down while its peer still has work in
        # flight aborts the peer ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:
        # written whole then renamed: the launcher kills the surviving ranks, possibly mid-write
        tmp = run_dir / f".failure-rank{rank}.tmp"
        tmp.write_text(json.dumps({"rank": rank, "step": step, "time": time.time(),
                                   "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))
        os.replace(tmp, run_dir / f"failure-rank{rank}.json")
        raise
