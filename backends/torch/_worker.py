"""Worker body, one per rank, started by torch.distributed.run.

``python -m polyparallel.backends.torch._entry RUN_DIR`` reads ``RUN_DIR/job.pkl`` (the plan, the
model and data functions, optimiser settings), trains, and has rank 0 append one JSON line per step
to ``RUN_DIR/train.jsonl``. A failing rank writes ``RUN_DIR/failure-rank{R}.json`` (step, error,
traceback) before exiting non-zero, so the launcher can say which rank failed and why.
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

__all__ = ["resolve", "run_worker"]


def resolve(fn: Any) -> Any:
    """``"package.module:function"`` -> the function; a callable is returned as is."""
    if callable(fn):
        return fn
    import importlib

    mod, sep, name = str(fn).partition(":")
    if not sep or not mod or not name:
        raise ValueError(f"{fn!r}: expected 'package.module:function'")
    try:
        obj: Any = importlib.import_module(mod)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{fn!r}: cannot load it ({type(e).__name__}: {e}); give an importable "
                         "'package.module:function' (the current directory is on the path for the CLI)") from e
    if not callable(obj):
        raise ValueError(f"{fn!r} is a {type(obj).__name__}, not a function")
    return obj


def make_optimizer(name: str, params: Any, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """torch's ``sgd``/``adam``/``adamw``; on CUDA its fused kernel (one pass over every state, as the
    cost model prices a GPU's optimizer step) unless a parameter is sharded (DTensor: foreach)."""
    from torch.distributed.tensor import DTensor

    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    params = list(params)
    if device.type == "cuda" and not any(isinstance(p, DTensor) for p in params):
        return cls(params, lr=lr, fused=True)
    return cls(params, lr=lr)


def _apply(model: torch.nn.Module, job: dict[str, Any], device: torch.device) -> tuple[torch.nn.Module, Any]:
    from polyparallel.backends.torch._tensor_parallel import build_mesh, parallelize, replica_mesh

    plan = job["plan"]
    mesh = build_mesh(device.type, plan)
    parallelize(model, plan, mesh)
    if plan.data_parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=replica_mesh(mesh, plan).get_group(),
                                        device_ids=[device.index] if device.type == "cuda" else None)
    elif plan.data_parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=replica_mesh(mesh, plan))
    return model, mesh


@contextlib.contextmanager
def comm_profile(enabled: bool) -> Iterator[dict[str, Any]]:
    """Collect what torch's profiler records of collectives in the block into the yielded dict
    (``comm_s``: summed durations of ``gloo:*``/``nccl:*`` events; ``comm_ops``: their counts)."""
    rec: dict[str, Any] = {}
    if not enabled:
        yield rec
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield rec
    events = [e for e in prof.key_averages() if e.key.startswith(("gloo:", "nccl:"))]
    rec["comm_s"] = sum(e.cpu_time_total for e in events) * 1e-6
    rec["comm_ops"] = {e.key: e.count for e in events}


def _save(ckpt: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int,
          optim_key: str = "optim") -> None:
    """Save model and optimiser (sharded as they are) with torch.distributed.checkpoint after ``step``.

    ``LATEST`` is rewritten (atomically, by rank 0) only after every rank finished writing, so a
    kill mid-save leaves the previous checkpoint as the one to resume from.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, optim_key: osd}, checkpoint_id=str(ckpt / f"step-{step}"))
    dist.barrier()
    if rank == 0:
        tmp = ckpt / ".LATEST.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, ckpt / "LATEST")


def _resume(ckpt: Path | None, model: torch.nn.Module, opt: torch.optim.Optimizer, log: Path | None,
            optim_key: str = "optim") -> int:
    """Load the latest checkpoint if there is one; return the first step still to run.

    Rank 0 also drops log lines of steps after the checkpoint (they are run again).
    """
    if ckpt is None or not (ckpt / "LATEST").exists():
        return 0
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    done = int((ckpt / "LATEST").read_text())
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, optim_key: osd}
    dcp.load(state, checkpoint_id=str(ckpt / f"step-{done}"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state[optim_key])
    if log is not None and log.exists():
        kept = [line for line in log.read_text().splitlines() if json.loads(line)["step"] <= done]
        log.write_text("".join(line + "\n" for line in kept))
    return done + 1


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
        if job["plan"].pp > 1:  # pipeline stages have their own loop (same log and checkpoint format)
            from polyparallel.backends.torch._pipeline import train_pipeline

            for step in train_pipeline(job, run_dir, rank, device):  # noqa: B007 - a failure names `step`
                pass
            dist.barrier()
            dist.destroy_process_group()
            return
        plan = job["plan"]
        torch.manual_seed(job["seed"])  # every rank builds the same initial weights
        model = resolve(job["model_fn"])().to(device)
        model, mesh = _apply(model, job, device)
        data_fn = resolve(job["data_fn"])
        opt = make_optimizer(job["optimizer"], model.parameters(), job["lr"], device)
        dp_rank = mesh["dp"].get_local_rank()
        local = plan.global_batch // plan.dp
        from polyparallel.backends.torch._tensor_parallel import replica_mesh, sequence_shard, step_context

        replicas = replica_mesh(mesh, plan)  # dp, times sp: each holds an equal share of the tokens
        log = run_dir / "train.jsonl"
        ckpt = Path(job["checkpoint_dir"]) if job.get("checkpoint_dir") else None
        start = _resume(ckpt, model, opt, log if rank == 0 else None)
        for step in range(start, job["steps"]):
            inputs, labels = data_fn(step)
            if inputs.shape[0] != plan.global_batch:
                raise ValueError(f"data_fn({step}) returned a batch of {inputs.shape[0]}; the strategy's "
                                 f"global_batch is {plan.global_batch}")
            sl = slice(dp_rank * local, (dp_rank + 1) * local)
            x, y = (sequence_shard(t[sl], plan, mesh).to(device) for t in (inputs, labels))
            if cuda:
                torch.cuda.synchronize()
            with comm_profile(bool(job.get("profile_comm"))) as comm:
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                with step_context(plan, mesh):
                    loss = model(x, y)
                    loss.backward()
                opt.step()
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            val = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            val = val.detach().clone().reshape(1)
            # each dp (and sp) rank's loss is the mean over its equal share: the global mean is their mean
            dist.all_reduce(val, group=replicas.get_group())
            if rank == 0:
                rec = {"step": step, "loss": float(val.item()) / replicas.size(), "step_time_s": dt,
                       "rank0_input_shape": list(x.shape), "device": device.type,
                       "backend": dist.get_backend(), **comm}  # what a rank trains on: its dp and sp share
                with log.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
            if ckpt is not None and ((step + 1) % job["checkpoint_every"] == 0 or step + 1 == job["steps"]):
                _save(ckpt, step, model, opt, rank)
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
