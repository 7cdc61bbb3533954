"""``train``: check the plan, launch the workers with torch.distributed.run, collect the log."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from polyparallel.backends.torch._plan import plan_for
from polyparallel.backends.torch._tensor_parallel import strategy_graph
from polyparallel.backends.torch._worker import resolve
from polyparallel.strategy import Strategy

__all__ = ["MultiNode", "TrainError", "launch_commands", "node_layout", "train"]


class TrainError(RuntimeError):
    """A worker failed; ``rank``, ``step`` and ``error`` say which, where and why."""

    def __init__(self, message: str, rank: int | None = None, step: int | None = None, error: str = "") -> None:
        super().__init__(message)
        self.rank, self.step, self.error = rank, step, error


class MultiNode(ValueError):
    """The strategy spans several nodes: run :func:`train` once per node with ``node_rank``; the
    message lists the per-node ``polyparallel train`` commands (also :func:`launch_commands`)."""


def node_layout(strategy: Strategy) -> list[tuple[str, list[int]]]:
    """``(node name, mesh ranks it runs)`` per node, in rank order, from the strategy's cluster echo.

    torch.distributed.run numbers ranks node by node (``node_rank * nproc_per_node + local_rank``),
    so mesh rank ``r`` (device ``mesh.devices[r]``) can only run where it lands: every node must
    hold one contiguous block of mesh ranks, all blocks of one size. A strategy without a node map
    (or on one node) runs on this machine.
    """
    where = {d: n.get("name", f"node{i}") for c in strategy.cluster.get("centers", [])
             for i, n in enumerate(c.get("nodes", [])) for d in n.get("devices", [])}
    ranks: list[tuple[str, list[int]]] = []
    for r, dev in enumerate(strategy.mesh.devices):
        name = where.get(dev, "")
        if ranks and ranks[-1][0] == name:
            ranks[-1][1].append(r)
        elif any(n == name for n, _ in ranks):
            raise ValueError(f"mesh rank {r} (device {dev}) is on node {name!r}, whose other ranks are not next to "
                             "it in mesh order; torch.distributed.run numbers ranks node by node, so each node "
                             "must hold one contiguous block of the mesh")
        else:
            ranks.append((name, [r]))
    if len({len(rs) for _, rs in ranks}) > 1:
        raise ValueError("nodes run different numbers of mesh ranks ("
                         + ", ".join(f"{n}: {len(rs)}" for n, rs in ranks)
                         + "); torch.distributed.run starts the same number of processes on every node")
    return ranks


def launch_commands(strategy: Strategy | str | Path, model_fn: str, data_fn: str, *, steps: int,
                    master_addr: str = "NODE0_ADDRESS", master_port: int = 29500) -> list[str]:
    """One ``polyparallel train`` command per node of a multi-node strategy (node 0 hosts the
    rendezvous at ``master_addr:master_port``)."""
    path = str(strategy) if not isinstance(strategy, Strategy) else "strategy.json"
    s = strategy if isinstance(strategy, Strategy) else Strategy.from_json(strategy)
    return [f"# on {name} (mesh ranks {rs[0]}..{rs[-1]})\npolyparallel train {path} --model {model_fn} "
            f"--data {data_fn} --steps {steps} --node-rank {i} --master-addr {master_addr} "
            f"--master-port {master_port}" for i, (name, rs) in enumerate(node_layout(s))]


def train(strategy: Strategy | str | Path, model_fn: Any, data_fn: Any, *, steps: int, optimizer: str = "sgd",
          lr: float = 0.1, seed: int = 0, log_dir: str | Path | None = None,
          checkpoint_dir: str | Path | None = None, checkpoint_every: int = 1,
          timeout_s: float = 600.0, check_fingerprint: bool = True, node_rank: int | None = None,
          master_addr: str = "127.0.0.1", master_port: int = 29500,
          profile_comm: bool = False, batchnorm: str = "cross_rank") -> list[dict[str, float]]:
    """Train ``model_fn()`` as ``strategy`` says on ``dp * sp * tp * pp`` local processes; return the step log.

    ``model_fn`` and ``data_fn`` are ``"package.module:function"`` strings or picklable callables
    (module-level functions). ``model_fn()`` builds the model, whose ``forward(inputs, labels)``
    returns the mean loss; ``data_fn(step)`` returns the global batch ``(inputs, labels)``, which is
    split into equal contiguous shares over the ``dp`` ranks. Every rank seeds torch with ``seed``
    before building the model. Rank 0 writes ``{"step", "loss", "step_time_s", "rank0_input_shape"}``
    JSON lines (the last, without pipeline stages: rank 0's share of the inputs after the dp and sp splits) to
    ``log_dir/train.jsonl`` (a temporary folder when ``log_dir`` is None); the list is returned.

    With ``checkpoint_dir``, model and optimiser are saved with torch.distributed.checkpoint every
    ``checkpoint_every`` steps (and after the last); a later call with the same ``checkpoint_dir``
    resumes after the latest complete checkpoint (so a run killed mid-way loses no saved step), and
    the log is ``checkpoint_dir/train.jsonl`` unless ``log_dir`` says otherwise.

    Before launching, ``model_fn()`` is captured (on the meta device) at the strategy's micro-batch
    size ``global_batch / (dp·microbatches)``, the size the planner fingerprinted, and must have the
    strategy's ``model.fingerprint``; ``check_fingerprint=False`` runs a stand-in model instead (e.g.
    a smaller model with the same module paths), matched to the placements by module path only.

    Raises :class:`~polyparallel.backends.torch.Unsupported` (a ValueError) before launching when the
    plan cannot be executed exactly, :class:`~polyparallel.backends.torch.FingerprintMismatch` (a
    ValueError) for another model than the strategy's, and :class:`TrainError` naming the rank when a
    worker fails.

    A strategy whose mesh spans several nodes of its cluster (:func:`node_layout`) runs as one
    ``train`` call per node with ``node_rank`` (0 hosts the rendezvous at ``master_addr:master_port``);
    without ``node_rank`` it raises :class:`MultiNode` listing the per-node commands. Only node 0's
    call returns the log (rank 0 writes it).

    ``profile_comm=True`` runs every step under ``torch.profiler`` and adds to each log line
    ``comm_s``, rank 0's seconds inside collectives as torch records them (``gloo:*`` / ``nccl:*``
    events, from issue to completion; they may overlap compute, so this is not the exposed part),
    and ``comm_ops`` (collective -> count). The profiler slows small steps down; off by default.

    Data-parallel replicas train as single-process training on the global batch does: BatchNorm
    normalises with the statistics of the whole global batch (``batchnorm="cross_rank"``;
    ``"per_replica"`` normalises each replica's share alone, which is cheaper and *not* equal to
    single-process training), and a mean cross entropy with ignored targets is weighted by the
    targets each replica and micro-batch saw (each log line's ``loss_weighting`` says
    ``"tokens"``, or ``"mean_of_means"`` for a loss it cannot count; see ``_worker.py``).
    """
    import torch

    if not isinstance(strategy, Strategy):
        strategy = Strategy.from_json(strategy)
    if steps < 1:
        raise ValueError(f"steps={steps}: need at least one step")
    if batchnorm not in ("cross_rank", "per_replica"):
        raise ValueError(f"batchnorm={batchnorm!r}: choose 'cross_rank' or 'per_replica'")
    if optimizer not in ("sgd", "adam", "adamw"):
        raise ValueError(f"optimizer {optimizer!r}: choose sgd, adam or adamw")
    torch.manual_seed(seed)
    batch = resolve(data_fn)(0)  # pipeline stages are cut, and the model captured, on (a micro-batch of) it
    graph = strategy_graph(strategy, resolve(model_fn), batch, check_fingerprint) if strategy.mode == "synchronous" \
        else None  # plan_for says where a collaborative strategy runs
    torch.manual_seed(seed)
    plan = plan_for(strategy, resolve(model_fn)(), batch if strategy.pp > 1 else None,
                    graph=graph)  # refuse before any process starts
    nproc = plan.dp * plan.sp * plan.tp * plan.pp
    nodes = node_layout(strategy)
    if len(nodes) > 1:
        if node_rank is None:
            cmds = launch_commands(strategy, model_fn if isinstance(model_fn, str) else "MODULE:FUNCTION",
                                   data_fn if isinstance(data_fn, str) else "MODULE:FUNCTION", steps=steps)
            raise MultiNode(f"the strategy runs on {len(nodes)} nodes; start one train per node with node_rank "
                            "(--node-rank), node 0 first:\n" + "\n".join(cmds))
        if not 0 <= node_rank < len(nodes):
            raise ValueError(f"node_rank={node_rank}: the strategy has nodes 0..{len(nodes) - 1}")
        nproc //= len(nodes)
    elif node_rank not in (None, 0):
        raise ValueError(f"node_rank={node_rank}, but the strategy runs on one node")
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        raise ValueError(f"the strategy needs {nproc} GPUs on this machine; {torch.cuda.device_count()} are visible")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every={checkpoint_every}: must be >= 1")
    if checkpoint_dir is not None:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        log_dir = checkpoint_dir if log_dir is None else log_dir
    resuming = checkpoint_dir is not None and (Path(checkpoint_dir) / "LATEST").exists()
    tmp = None
    if log_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="pp-train-")
        log_dir = tmp.name
    run_dir = Path(log_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stale = [*run_dir.glob("failure-rank*.json")] + ([] if resuming else [run_dir / "train.jsonl"])
    for old in stale:
        old.unlink(missing_ok=True)
    job = {"plan": plan, "model_fn": model_fn, "data_fn": data_fn, "steps": steps, "optimizer": optimizer,
           "lr": lr, "seed": seed, "checkpoint_every": checkpoint_every, "profile_comm": profile_comm,
           "batchnorm": batchnorm,
           "checkpoint_dir": str(Path(checkpoint_dir).resolve()) if checkpoint_dir is not None else None}
    try:
        (run_dir / "job.pkl").write_bytes(pickle.dumps(job))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(f"model_fn/data_fn must be 'package.module:function' strings or module-level "
                         f"functions (they are sent to the worker processes): {e}") from e
    env = dict(os.environ)
    # the workers must import whatever the caller could (e.g. a test module's functions)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    where = ["--standalone"] if len(nodes) <= 1 else [
        f"--nnodes={len(nodes)}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
        f"--master-port={master_port}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}",
           "--max-restarts=0", "-m", "polyparallel.backends.torch._entry", str(run_dir)]
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise TrainError(f"training did not finish within {timeout_s:.0f} s; all workers were killed") from None
        except BaseException:
            # interrupted (Ctrl-C, a test timeout): never leave the launcher and its workers behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        if proc.returncode != 0:
            failures = sorted((json.loads(p.read_text()) for p in run_dir.glob("failure-rank*.json")),
                              key=lambda f: f["time"])
            # the first rank to fail is the cause; the others typically died of its absence
            if failures:
                f = failures[0]
                raise TrainError(f"rank {f['rank']} failed at step {f['step']}: {f['error']}\n{f['traceback']}",
                                 rank=f["rank"], step=f["step"], error=f["error"])
            # no failure file: the rank died outside Python (a signal, an abort); the elastic agent's
            # summary names the root-cause rank
            m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*", out, re.S)
            if m:
                raise TrainError(f"rank {m.group(1)} failed (exit code {m.group(2)}); launcher output:\n"
                                 f"{out[-4000:]}", rank=int(m.group(1)), error=f"exit code {m.group(2)}")
            raise TrainError(f"torch.distributed.run exited with status {proc.returncode}:\n{out[-4000:]}")
        log = run_dir / "train.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    finally:
        if tmp is not None:
            tmp.cleanup()
