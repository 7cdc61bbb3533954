"""Step-time model: tensor-parallel collectives by hand, data-parallel overlap, breakdown, errors."""

from __future__ import annotations

import pytest

from polyparallel.cluster import Cluster
from polyparallel.cost_models import ParallelConfig, estimate_step
from polyparallel.cost_models.synthetic import gpt_graph, mlp_graph

BW, ALPHA = 100e9, 5e-6


def node(p: int) -> Cluster:
    return Cluster.from_dict({"name": "n", "centers": [{"name": "c", "nodes": [
        {"device": "h100-sxm", "devices_per_node": p, "intra": {"bandwidth": BW, "latency": ALPHA}}]}]})


def ar2(n: float) -> float:  # all-reduce over 2 ranks (ring = tree here)
    return n / BW + 2 * ALPHA


LOSS = ar2(32)  # every step all-reduces its loss and target count over the replicas (4 float64)


def test_megatron_tp_collectives_by_hand():
    b = 32
    g = mlp_graph(batch=b, widths=(64, 128, 128), classes=10)
    m = 3
    e = estimate_step(g, node(2), ParallelConfig(tp=2, microbatches=m))
    # layer 0 column-parallel (input is data: no gradient all-reduce), layer 1 row-parallel (forward
    # all-reduce of its output), layer 2 column-parallel (backward all-reduce of its input's gradient),
    # vocab-parallel loss (all-reduce of 3 scalars per row)
    per_mb = ar2(4 * b * 128) + ar2(4 * b * 128) + ar2(3 * b * 4)
    assert e.stages[0].part("tensor_parallel") == pytest.approx(m * per_mb)


def test_tp_halves_matmul_compute():
    g = mlp_graph(batch=4096, widths=(4096, 4096, 4096), bias=False)
    one = estimate_step(g, node(2), ParallelConfig(tp=1, dtype="bf16")).stages[0].part("compute")
    two = estimate_step(g, node(2), ParallelConfig(tp=2, dtype="bf16")).stages[0].part("compute")
    assert 0.5 <= two / one < 0.6  # matmuls halve; the full-width relu after the row layer does not


def test_data_parallel_gradient_overlap():
    g = mlp_graph(batch=32, widths=(64, 128, 128), classes=10)
    grads = 4 * g.param_count()
    none = estimate_step(g, node(2), ParallelConfig(dp=2, grad_overlap=0.0))
    assert none.stages[0].part("data_parallel") == pytest.approx(ar2(grads) + LOSS)
    full = estimate_step(g, node(2), ParallelConfig(dp=2, grad_overlap=1.0))
    assert full.stages[0].part("data_parallel") <= none.stages[0].part("data_parallel")
    assert full.step_time <= none.step_time
    z1 = estimate_step(g, node(2), ParallelConfig(dp=2, zero_stage=1, grad_overlap=0.0))
    # reduce-scatter of gradients + all-gather of weights move what one all-reduce moves, but FSDP2
    # issues them per unit (one per numbered layer: 3 here), each paying the link's latency; and it
    # copies the gathered weights out of the collective's buffer (read + write, 8 bytes per fp32
    # element) and the gradients into the reduce-scatter's (8 more), streamed on the compute stream
    from polyparallel.cost_models.compute import streaming_bandwidth

    rs = (grads / 2) / BW + ALPHA
    copies = 16 * g.param_count() / streaming_bandwidth(node(2).devices[0].type)
    assert z1.stages[0].part("data_parallel") == pytest.approx(2 * rs + 2 * 2 * ALPHA + copies + LOSS)


def test_breakdown_sums_to_step_and_throughput():
    g = gpt_graph(layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=2)
    cfg = ParallelConfig(dp=2, tp=2, pp=2, microbatches=4, schedule="interleaved", chunks=2, dtype="bf16",
                         sequence_parallel=True, recompute="selective", zero_stage=1)
    e = estimate_step(g, Cluster.preset("dgx-a100"), cfg)
    for s in e.stages:
        assert s.total == pytest.approx(e.step_time)
        assert all(v >= 0 for _, v in s.parts)
    assert e.samples_per_step == 2 * 4 * 2
    assert e.throughput == pytest.approx(16 / e.step_time)
    assert e.pipeline.chunks == 2 and len(e.memory) == 2


def test_deepspeed_p2p_blocks_both_stages_by_hand():
    # two nodes of two GPUs (one NIC port each), tp 2 inside a node, pp 2 across the nodes
    nic = 25e9
    cl = Cluster.from_dict({"name": "two", "centers": [{"name": "c", "nodes": [
        {"count": 2, "device": "a100-80gb-sxm", "devices_per_node": 2, "intra": {"bandwidth": BW, "latency": ALPHA},
         "nic": {"bandwidth": nic, "ports": 2, "latency": ALPHA}}]}]})
    b, s, h, m = 2, 64, 128, 6
    g = gpt_graph(layers=4, hidden=h, heads=4, seq=s, vocab=256, batch=b)
    boundary = b * s * h * 4  # the fp32 residual stream, the one tensor crossing the cut
    base = ParallelConfig(tp=2, pp=2, microbatches=m, partition="layers")
    mega = estimate_step(g, cl, base)
    ds = estimate_step(g, cl, ParallelConfig(**{**base.__dict__, "pipeline_p2p": "deepspeed"}))
    # both: each tp rank sends half the tensor over its own port
    half = ALPHA + boundary / 2 / nic
    assert dict(mega.stages[0].collectives)["p2p"] == pytest.approx(2 * m * half)
    # DeepSpeed: the stream of both ends waits for the transfer, and the receiver all-gathers the
    # halves over its tp pair (ring over 2: half the bytes, one step): per micro-batch stage 0 sends
    # the activation and receives and gathers its gradient, stage 1 the reverse
    gather = boundary / 2 / BW + ALPHA
    for st in ds.stages:
        assert st.part("p2p") == pytest.approx(m * (2 * half + gather))
        assert st.total == pytest.approx(ds.step_time)
    # Megatron's asynchronous transfers only delay the fill; DeepSpeed's lengthen every micro-batch
    assert ds.step_time - mega.step_time >= m * (2 * half + gather) - 2 * half
    assert "p2p=deepspeed" in str(ds.config) and "p2p" not in str(mega.config)


def test_heterogeneous_stages_run_at_their_device_speed():
    c = Cluster.from_dict({"name": "h", "centers": [{"name": "c", "nodes": [
        {"device": "h100-sxm", "devices_per_node": 1, "nic": {"bandwidth": "100 Gb/s", "latency": "5 us"}},
        {"device": "v100-sxm2-32gb", "devices_per_node": 1, "nic": {"bandwidth": "100 Gb/s", "latency": "5 us"}}]}]})
    g = mlp_graph(batch=4096, widths=(4096,) * 4, bias=False)  # 4 equal layers: 2 per stage
    e = estimate_step(g, c, ParallelConfig(pp=2, microbatches=4, dtype="fp32"))
    h100, v100 = e.stages
    assert (h100.device_type, v100.device_type) == ("h100-sxm", "v100-sxm2-32gb")
    # the same FLOPs on a device with 67/15.7 of the fp32 peak
    assert v100.part("compute") / h100.part("compute") == pytest.approx(67 / 15.7, rel=0.1)
    assert h100.part("bubble") > v100.part("bubble")


def test_ulysses_sequence_parallel_adds_all_to_all():
    g = gpt_graph(layers=2, hidden=64, heads=4, seq=64, vocab=128, batch=1)
    e = estimate_step(g, node(2), ParallelConfig(sp=2))
    assert e.stages[0].part("sequence_parallel") > 0
    assert estimate_step(g, node(2), ParallelConfig(dp=2)).stages[0].part("sequence_parallel") == 0


@pytest.mark.parametrize(("cfg", "msg"), [
    (ParallelConfig(dp=4), "has 2"),
    (ParallelConfig(schedule="zigzag"), "schedule"),
    (ParallelConfig(chunks=2), "interleaved"),
    (ParallelConfig(sequence_parallel=True), "tp > 1"),
    (ParallelConfig(zero_stage=4), "zero_stage"),
    (ParallelConfig(recompute="most"), "recompute"),
    (ParallelConfig(pipeline_p2p="nccl"), "pipeline_p2p"),
    (ParallelConfig(grad_accumulation="fused"), "grad_accumulation"),
    (ParallelConfig(grad_accumulation="cast_add"), "16-bit gradients"),
    (ParallelConfig(dp=0), "dp=0: give a whole number"),
    (ParallelConfig(pp=2, devices=(0,)), "lists 1 devices"),
])
def test_config_validation(cfg, msg):
    with pytest.raises(ValueError, match=msg):
        estimate_step(mlp_graph(batch=4, widths=(8, 8, 8)), node(2), cfg)


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ValueError, match="cannot cut"):
        estimate_step(mlp_graph(batch=4, widths=(8, 8)), node(8), ParallelConfig(pp=8))


def test_equal_layer_partition_puts_embedding_and_head_on_end_stages():
    h, v, s = 32, 100, 8
    g = gpt_graph(layers=5, hidden=h, heads=4, seq=s, vocab=v, batch=1)
    e = estimate_step(g, node(2), ParallelConfig(pp=2, microbatches=2, partition="layers"))
    layer = 12 * h * h + 13 * h
    # first ceil(5/2) = 3 layers with the embeddings; 2 layers, the final norm and the tied head after
    assert e.memory[0].term("weights") == 4 * (3 * layer + v * h + s * h)
    assert e.memory[1].term("weights") == 4 * (2 * layer + 2 * h + v * h)
    with pytest.raises(ValueError, match="partition"):
        estimate_step(g, node(2), ParallelConfig(pp=2, partition="random"))


def test_zero3_exposed_gathers_by_hand():
    """FSDP/ZeRO-3: first gather exposed, the others only beyond the previous layer's compute; the
    backward's re-gathers and reduce-scatters summed against the backward (module docstring); the
    compute a collective runs beside slowed by σ = 24 / (132 − 24) on an H100 (NCCL's 24 channels
    hold 24 of its 132 SMs), and FSDP2's copies out of and into the collectives' buffers."""
    from dataclasses import replace

    from polyparallel.cost_models import op_cost
    from polyparallel.cost_models.compute import streaming_bandwidth
    from polyparallel.cost_models.step import layer_segments

    # layer 0 is big (its compute hides layer 1's gather); layer 1 is tiny (layer 2's gather shows)
    g = mlp_graph(batch=256, widths=(1024, 4096, 64, 4096), classes=64)
    cl = node(2)
    # a host that keeps ahead of the device (dispatch measured as free): this prices the kernels alone
    dt = replace(cl.devices[0].type, host_op_seconds=(("elementwise", 0.0),))
    for d in cl.devices:
        object.__setattr__(d, "type", dt)
    m = 3
    e = estimate_step(g, cl, ParallelConfig(dp=2, zero_stage=3, microbatches=m, grad_overlap=1.0))

    def ring(nbytes: float) -> float:  # all-gather / reduce-scatter over 2 ranks
        return nbytes / 2 / BW + ALPHA

    segs = layer_segments(g)
    assert len(segs) == 5  # four linear layers and the loss
    w = [4 * sum(g.tensors[t].numel for i in sg for t in g.ops[i].inputs if g.tensors[t].is_param) for sg in segs]
    c = [sum(op_cost(g, g.ops[i], dt, "fp32").forward for i in sg) for sg in segs]
    back = sum(op_cost(g, op, dt, "fp32").backward for op in g.ops)
    gather = [ring(x) if x else 0.0 for x in w]
    scatter = gather  # same volume, same ring steps
    sigma = 24 / (132 - 24)
    exposed_fwd = gather[0] + sum(max(0.0, gather[i] - c[i - 1]) + sigma * min(gather[i], c[i - 1])
                                  for i in range(1, len(w)))
    exposed_bwd = max(0.0, sum(gather) + sum(scatter) - back) + sigma * min(sum(gather) + sum(scatter), back)
    # copy-out of every gather (read + write) and the gradients into the reduce-scatter input, fp32:
    # w holds bytes already; the forward gathers every unit, the backward again, then reduces all
    exposed_fwd += 2 * sum(w) / streaming_bandwidth(dt)
    exposed_bwd += 4 * sum(w) / streaming_bandwidth(dt)
    assert gather[1] < c[0] and gather[2] > c[1]  # the configuration exercises both branches
    assert e.stages[0].part("data_parallel") == pytest.approx(m * (exposed_fwd + exposed_bwd) + LOSS, rel=1e-9)
    # every micro-batch after the first adds its gradient shard into the fp32 accumulator: a pass of
    # 4 + 2 x 4 bytes per local element
    accumulate = (m - 1) * 12 * g.param_count() / 2 / streaming_bandwidth(dt)
    # nothing else is exposed: the step is m micro-batches of compute plus those gathers, and the optimizer
    assert e.step_time == pytest.approx(m * (sum(c) + back + exposed_fwd + exposed_bwd) + accumulate + LOSS
                                        + e.stages[0].part("optimizer"), rel=1e-9)


def test_optimizer_step_fused_vs_torch_foreach_by_hand():
    # Adam at bf16 on one H100 (3350 GB/s at 80%): a fused step reads/writes each state once,
    # 3 bf16 (weight, gradient, updated weight) + 2 x (fp32 master + two fp32 moments) = 30 B per
    # parameter; torch's foreach Adam makes 7 passes, 18 fp32 accesses = 72 B per parameter
    g = mlp_graph(batch=8, widths=(4096, 4096, 4096), bias=False)
    n = g.param_count()
    bw = 3350e9 * 0.8
    fused = estimate_step(g, node(1), ParallelConfig(dtype="bf16", optimizer="adam"))
    foreach = estimate_step(g, node(1), ParallelConfig(dtype="bf16", optimizer="adam", fused_optimizer=False))
    assert fused.stages[0].part("optimizer") == pytest.approx(n * 30 / bw)
    assert foreach.stages[0].part("optimizer") == pytest.approx(n * 72 / bw)


def test_prices_cached_on_a_graph_keep_same_named_device_types_apart():
    from dataclasses import replace

    g = mlp_graph(batch=1024, widths=(4096, 4096, 4096))  # kernels well above the host's dispatch
    fast = node(1)
    slow_type = replace(fast.device(0).type, peak=(("fp32", 1e12),))  # same name, 67x slower
    slow = Cluster.from_dict({"name": "n", "device_types": {}, "centers": [{"name": "c", "nodes": [
        {"device": "h100-sxm", "devices_per_node": 1}]}]})
    object.__setattr__(slow.devices[0], "type", slow_type)
    a = estimate_step(g, fast, ParallelConfig()).stages[0].part("compute")
    b = estimate_step(g, slow, ParallelConfig()).stages[0].part("compute")  # same Graph object, cache warm
    assert b > 10 * a


def test_ddp_buckets_expose_the_last_bucket_or_the_slow_link(monkeypatch):
    """torch DDP's buckets (1 MiB first, 25 MiB after): with a fast link only the last bucket's
    all-reduce runs past the backward; with a slow one everything after the first bucket fills."""
    from polyparallel.cost_models import data_parallel as dpar

    alpha, mib = 1e-4, 2**20
    grads = 60.5 * mib  # buckets 1, 25, 25, 9.5 MiB
    sizes = [1 * mib, 25 * mib, 25 * mib, 9.5 * mib]
    for beta in (1e12, 1e8):  # bytes/s: fast, slow against a 10 ms backward
        monkeypatch.setattr(dpar, "group_seconds", lambda cl, cc, ev, grp, gid, beta=beta: alpha + ev[0][1] / beta)
        got = dpar.ddp_exposed(None, {}, [((0, 1), 0)], grads, 0.01)
        if beta == 1e12:
            want = alpha + 9.5 * mib / beta  # every earlier bucket finishes before the next is ready
        else:
            want = 0.01 * mib / grads + sum(alpha + b / beta for b in sizes) - 0.01
        assert got == pytest.approx(want)
    monkeypatch.setattr(dpar, "group_seconds", lambda *a: 1.0)
    assert dpar.ddp_exposed(None, {}, [((0, 1), 0)], 0.5 * mib, 0.01) == pytest.approx(1.0)  # one bucket


def test_uncalibrated_gpu_small_model_is_host_bound():
    """A GPU without a calibration of its own takes the eager host costs measured on the H200 machine:
    a tiny MLP's step lasts the host's time for its ops (forward + backward each) and the backward call."""
    from polyparallel.cluster.devices import EAGER_HOST_OP_SECONDS

    g = mlp_graph(batch=8, widths=(64, 64, 64))
    host = dict(EAGER_HOST_OP_SECONDS)
    per_op = {"linear": "linear", "relu": "elementwise", "cross_entropy": "cross_entropy"}
    want = sum(host[per_op[op.target]] for op in g.ops) + host["backward_call"]
    est = estimate_step(g, Cluster.preset("dgx-a100"), ParallelConfig(dtype="fp32", fused_elementwise=True))
    assert est.breakdown()["compute"] == pytest.approx(want)
    assert Cluster.preset("local-cpu:1").device(0).type.host_table("fp32") == {}  # CPUs: none


def test_gradient_accumulation_on_accelerators_by_hand():
    # an uncalibrated GPU adds every micro-batch's gradients after the first into the fp32 accumulator:
    # one pass reading the bf16 gradient and reading and writing fp32, 2 + 4 + 4 bytes per element
    from polyparallel.cost_models.compute import streaming_bandwidth

    g = mlp_graph(batch=64, widths=(512, 1024, 512), classes=16)
    cl = node(1)
    one = estimate_step(g, cl, ParallelConfig(dtype="bf16", microbatches=1))
    four = estimate_step(g, cl, ParallelConfig(dtype="bf16", microbatches=4))
    per_mb = four.stages[0].part("compute") / 4 - one.stages[0].part("compute")
    assert per_mb == pytest.approx(3 / 4 * 10 * g.param_count() / streaming_bandwidth(cl.devices[0].type), rel=1e-9)


def test_deepspeed_bf16_optimizer_accumulation_by_hand():
    # DeepSpeed's BF16_Optimizer casts every micro-batch's bf16 gradient, the first's included, into a
    # temporary fp32 tensor and adds it to its fp32 buffer: read 2 + write 4, then read 4 + 4, write 4
    from polyparallel.cost_models.compute import streaming_bandwidth

    g = mlp_graph(batch=64, widths=(512, 1024, 512), classes=16)
    cl = node(1)
    bw = streaming_bandwidth(cl.devices[0].type)
    for m in (1, 4):
        torch_like = estimate_step(g, cl, ParallelConfig(dtype="bf16", microbatches=m))
        ds = estimate_step(g, cl, ParallelConfig(dtype="bf16", microbatches=m, grad_accumulation="cast_add"))
        extra = ds.stages[0].part("compute") - torch_like.stages[0].part("compute")
        want = m * g.param_count() * (18 - 10 * (m - 1) / m) / bw
        assert extra == pytest.approx(want, rel=1e-9)
    assert "accum=cast_add" in str(ParallelConfig(dtype="bf16", grad_accumulation="cast_add"))
