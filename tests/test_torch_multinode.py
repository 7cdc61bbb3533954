"""Torch backend across nodes: a strategy whose mesh spans two nodes runs as one launch per node.

The two "nodes" are two ``train`` calls on this machine that meet at a rendezvous on loopback
(torch.distributed.run with --nnodes 2 --node-rank i), exactly the commands a user runs on two hosts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import polyparallel as pp
from polyparallel.backends.torch import MultiNode, launch_commands, node_layout, train
from polyparallel.backends.torch import _examples as ex
from polyparallel.backends.torch._procs import free_port
from tests.test_torch_backend import EX, LR, SEED, STEPS, _max_rel, _single, _strategy

pytestmark = pytest.mark.slow


def _on_hosts(s: pp.Strategy, hosts: list[list[int]]) -> pp.Strategy:
    """The strategy with a cluster echo placing mesh devices on the given hosts."""
    nodes = [{"name": f"host{i}", "devices": [s.mesh.devices[r] for r in ranks]} for i, ranks in enumerate(hosts)]
    return s.model_copy(update={"cluster": {"name": "two-hosts", "centers": [{"name": "dc", "nodes": nodes}]}})


def test_node_layout_and_commands() -> None:
    s = _strategy(ex.tiny_gpt(), ex.gpt_data, dp=2, tp=1, zero_stage=0)
    assert [rs for _, rs in node_layout(s)] == [[0, 1]]  # local-cpu: one node
    two = _on_hosts(s, [[0], [1]])
    assert node_layout(two) == [("host0", [0]), ("host1", [1])]
    cmds = launch_commands(two, f"{EX}:tiny_gpt", f"{EX}:gpt_data", steps=3, master_addr="10.0.0.1")
    assert len(cmds) == 2 and "--node-rank 1 --master-addr 10.0.0.1" in cmds[1] and "# on host1" in cmds[1]
    with pytest.raises(MultiNode, match=r"(?s)2 nodes.*--node-rank 0.*--node-rank 1"):
        train(two, f"{EX}:tiny_gpt", f"{EX}:gpt_data", steps=1)
    # torch.distributed.run numbers ranks node by node: a node must hold one contiguous block of the mesh
    s4 = s.model_copy(update={"mesh": s.mesh.model_copy(update={"devices": [0, 1, 2, 3], "axes": [
        a.model_copy(update={"size": 4}) for a in s.mesh.axes]})})
    with pytest.raises(ValueError, match=r"mesh rank 2 .* not next to it"):
        node_layout(_on_hosts(s4, [[0, 2], [1, 3]]))
    with pytest.raises(ValueError, match=r"different numbers of mesh ranks"):
        node_layout(_on_hosts(s4, [[0], [1, 2, 3]]))


@pytest.mark.timeout(150)
def test_two_node_data_parallel_matches_single_process(tmp_path: Path) -> None:
    """Node 1 is started by its printed CLI command in its own process, node 0 through the Python API."""
    s = _on_hosts(_strategy(ex.tiny_gpt(), ex.gpt_data, dp=2, tp=1, zero_stage=0), [[0], [1]])
    path = tmp_path / "strategy.json"
    s.to_json(path)
    port = free_port()
    cmd = launch_commands(path, f"{EX}:tiny_gpt", f"{EX}:gpt_data", steps=STEPS, master_addr="127.0.0.1",
                          master_port=port)[1].splitlines()[1].split()
    assert cmd[:2] == ["polyparallel", "train"]
    node1 = subprocess.Popen([sys.executable, "-m", "polyparallel", *cmd[1:], "--lr", str(LR), "--seed", str(SEED),
                              "--log-dir", str(tmp_path / "node1")], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = train(path, f"{EX}:tiny_gpt", f"{EX}:gpt_data", steps=STEPS, lr=LR, seed=SEED,
                    log_dir=tmp_path / "node0", node_rank=0, master_port=port, timeout_s=120)
        out, _ = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.communicate()
    assert node1.returncode == 0, out
    assert not (tmp_path / "node1" / "train.jsonl").exists()  # rank 0 (on node 0) writes the log
    err = _max_rel(log, _single(ex.tiny_gpt, ex.gpt_data))
    print(f"two nodes x 1 process, DP=2: max relative loss difference {err:.2e}")
    assert err <= 1e-4
