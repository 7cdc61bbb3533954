"""One rank of a data-parallel MindSpore center, started by ``msrun`` (see :mod:`._center`).

msrun runs this script once per rank (``MS_ROLE=MS_WORKER``) and once as its scheduler
(``MS_ROLE=MS_SCHED``, whose ``init()`` serves the cluster and never returns to the script). A rank
joins MindSpore's communication (``init()``: MCCL on CPU), connects back to the center's trainer
(``POLYPARALLEL_MS_CENTER``, authenticated with ``POLYPARALLEL_MS_KEY``), receives the model spec,
the center's data and its SGD settings, builds the same :class:`ForeignTrainer` a one-process
MindSpore center builds, and serves rounds: each step trains on its contiguous share of the global
batch and averages the gradients over the ranks (``nn.DistributedGradReducer``, mean) before the
step, so every rank takes the one-process step.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import numpy as np


def _serve() -> None:
    from multiprocessing.connection import Client

    from polyparallel.backends.collab._foreign import import_frameworks

    import_frameworks(["torch", "mindspore"])  # the order the two share a process in
    import mindspore as ms
    from mindspore import nn
    from mindspore.communication import get_group_size, get_rank, init

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init()
    rank, size = get_rank(), get_group_size()
    host, port = os.environ["POLYPARALLEL_MS_CENTER"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["POLYPARALLEL_MS_KEY"]))
    conn.send(("hello", rank))
    try:
        from polyparallel.backends.collab._foreign import ForeignTrainer
        from polyparallel.backends.collab._mindspore import _MindSpore
        from polyparallel.backends.collab._models import ModelSpec

        class DataParallel(_MindSpore):
            """MindSpore's SGD on this rank's share, gradients averaged over the ranks."""

            def share(self, batch: np.ndarray) -> np.ndarray:
                k = len(batch) // size
                return batch[rank * k:(rank + 1) * k]

            def grad_reducer(self, parameters: Any) -> Any:
                return nn.DistributedGradReducer(parameters, mean=True, degree=size)

        spec_json, x, y, kw = conn.recv()
        trainer = ForeignTrainer(ModelSpec.from_json(spec_json), x, y, framework="mindspore", **kw)
        norms = [p for p, c in trainer.model.cells_and_names() if "BatchNorm" in type(c).__name__]
        if norms:
            raise ValueError(f"BatchNorm layers {norms[:3]}: the ranks of a data-parallel MindSpore center would "
                             "normalise their own shares (cross-rank BatchNorm is not implemented for MindSpore "
                             "centers); use a model without BatchNorm, devices=1 or framework='torch'")
        trainer.fw = DataParallel()
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
        conn.send(("start", rank))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, params, steps, round_idx, mu = msg
            local, metrics = trainer.train(params, steps=steps, round_idx=round_idx, proximal_mu=mu)
            conn.send(("round", local if rank == 0 else None, metrics["train_loss"]))
    except Exception as e:  # the trainer raises it in the federation's process, with the rank's reason
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
    finally:
        conn.close()


if __name__ == "__main__":
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        from mindspore.communication import init

        init()  # the scheduler serves the cluster here until the ranks leave
    else:
        _serve()
