"""Recurrent layers (LSTM, GRU, RNN) as loop nests: FLOPs, parameters and shapes against an unrolled
cell-by-cell run of the module, the nest's index maps by brute-force enumeration, which dims may be
split, the ONNX path, and the search on a small recurrent model."""

from __future__ import annotations

import collections
import io
import itertools
import warnings

import onnx
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import polyparallel
from polyparallel.cost_models import ParallelConfig
from polyparallel.cost_models.megatron_rule import op_plans
from polyparallel.frontends.onnx import capture_onnx
from polyparallel.frontends.torch import capture_torch
from polyparallel.ir import ANY, Graph, Op, OpKind
from polyparallel.ops import flops_per_element
from polyparallel.poly import DeviceMesh, legal_placements

CELLS = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN, "rnn_relu": torch.nn.RNN}
# (num_layers, bidirectional, batch_first, bias)
CONFIGS = [(1, False, False, True), (2, True, True, True), (2, False, False, False)]


def _module(cell: str, layers: int, bi: bool, bf: bool, bias: bool, i: int = 5, h: int = 6) -> torch.nn.Module:
    kw = {"nonlinearity": cell[4:]} if cell.startswith("rnn") else {}
    torch.manual_seed(0)
    return CELLS[cell](i, h, num_layers=layers, bidirectional=bi, batch_first=bf, bias=bias, **kw)


def _capture(m: torch.nn.Module, x: torch.Tensor) -> tuple[Graph, Op]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = capture_torch(m, (x,))
    rec = [op for op in g.ops if op.kind is OpKind.RECURRENT]
    assert len(rec) == 1 and not g.opaque_ops(), [(o.target, o.opaque_reason) for o in g.opaque_ops()]
    return g, rec[0]


def _unrolled(m: torch.nn.Module, cell: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The cell equations of torch's documentation, step by step; the pointwise FLOPs they execute
    (each op's elements times its cost in the FLOP table), matmuls left to FlopCounterMode."""
    tally = 0.0

    def ew(name: str, t: torch.Tensor) -> torch.Tensor:
        nonlocal tally
        tally += t.numel() * flops_per_element(name)
        return t

    L, D, H = m.num_layers, 2 if m.bidirectional else 1, m.hidden_size
    inp = x.transpose(0, 1) if m.batch_first else x
    T, B = inp.shape[:2]
    last = []
    for layer in range(L):
        outs = []
        for d in range(D):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(m, "weight_ih" + sfx), getattr(m, "weight_hh" + sfx)
            h, c = torch.zeros(B, H), torch.zeros(B, H)
            ys = [torch.empty(0)] * T
            for t in range(T) if d == 0 else reversed(range(T)):
                gi, gh = inp[t] @ w_ih.T, h @ w_hh.T
                if m.bias:
                    gi, gh = ew("add", gi + getattr(m, "bias_ih" + sfx)), ew("add", gh + getattr(m, "bias_hh" + sfx))
                if cell == "lstm":
                    i, f, g, o = ew("add", gi + gh).chunk(4, 1)
                    i, f, o = (ew("sigmoid", torch.sigmoid(v)) for v in (i, f, o))
                    c = ew("add", ew("mul", f * c) + ew("mul", i * ew("tanh", torch.tanh(g))))
                    h = ew("mul", o * ew("tanh", torch.tanh(c)))
                elif cell == "gru":
                    (ir, iz, inn), (hr, hz, hn) = gi.chunk(3, 1), gh.chunk(3, 1)
                    r = ew("sigmoid", torch.sigmoid(ew("add", ir + hr)))
                    z = ew("sigmoid", torch.sigmoid(ew("add", iz + hz)))
                    n = ew("tanh", torch.tanh(ew("add", inn + ew("mul", r * hn))))
                    h = ew("add", ew("mul", ew("sub", 1 - z) * n) + ew("mul", z * h))
                else:
                    a = ew("add", gi + gh)
                    h = ew("tanh", torch.tanh(a)) if cell == "rnn_tanh" else ew("relu", torch.relu(a))
                ys[t] = h
            outs.append(torch.stack(ys))
            last.append(h)
        inp = torch.cat(outs, -1)
    out = inp.transpose(0, 1) if m.batch_first else inp
    return out, torch.stack(last), tally


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "L{}{}{}{}".format(c[0], "bi" * c[1], "bf" * c[2], "" if c[3]
                                                                           else "nobias"))
@pytest.mark.parametrize("cell", list(CELLS))
def test_flops_params_shapes_match_unrolled_cells(cell: str, cfg: tuple) -> None:
    m = _module(cell, *cfg)
    x = torch.randn(3, 4, 5)  # (batch, time) or (time, batch) by batch_first
    g, op = _capture(m, x)
    with torch.no_grad():
        ref = m(x)
        with FlopCounterMode(display=False) as fc:
            out, h_n, pointwise = _unrolled(m, cell, x)
    ref_out, ref_h = ref[0], (ref[1][0] if cell == "lstm" else ref[1])
    torch.testing.assert_close(out, ref_out)  # the unrolled equations are the module's
    torch.testing.assert_close(h_n, ref_h)
    assert op.flops == fc.get_total_flops() + pointwise  # matmuls 2·M·N·K, counted by torch
    assert g.param_count() == sum(p.numel() for p in m.parameters())
    assert [g.tensors[t].shape for t in op.outputs] == [tuple(ref_out.shape), *[tuple(v.shape) for v in (
        ref[1] if cell == "lstm" else (ref[1],))]]


def _points(op: Op, st) -> collections.abc.Iterator[dict[str, int]]:
    assert not st.constraints
    ext = op.nest.extents
    for vals in itertools.product(*(range(ext[d]) for d in st.dims)):
        yield dict(zip(st.dims, vals))


def _check_coverage(g: Graph, op: Op) -> dict[tuple[str, int], dict[int, int]]:
    """Every output element written exactly once, every temporary element read written first; the
    time each direction's step ``s`` reads its input at (``ih0_d``) and writes its output at (``yd``)."""
    written: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    read: dict[str, set] = collections.defaultdict(set)
    step_time: dict[tuple[str, int], dict[int, int]] = {}
    for st in op.nest.statements:
        for env in _points(op, st):
            for w in st.writes:
                written[w.operand][tuple(e.eval(env) for e in w.index)] += 1
            for r in st.reads:
                assert all(e is not ANY for e in r.index)
                read[r.operand].add(tuple(e.eval(env) for e in r.index))
            if st.name.startswith(("ih0_", "y")):
                acc = st.reads[0] if st.name.startswith("ih") else st.writes[0]
                t = acc.index[1].eval(env)  # batch_first: (b, t, ...)
                step_time.setdefault((st.name[:2], int(st.name[-1])), {})[env["s"]] = t
    for i, t in enumerate(op.outputs):
        shape = g.tensors[t].shape
        assert set(written[f"out{i}"]) == set(itertools.product(*map(range, shape))), t
        assert set(written[f"out{i}"].values()) == {1}
    for tmp in ("h", "c", "gi", "gh"):
        assert read[tmp] <= set(written[tmp]), tmp
    return step_time


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_index_maps_by_enumeration(cell: str) -> None:
    """Every output element is written exactly once, every temporary element read was written, and
    step s of each direction reads the input at the time its output is written."""
    m = _module(cell, 2, True, True, True, i=3, h=2)
    g, op = _capture(m, torch.randn(2, 3, 3))
    step_time = _check_coverage(g, op)
    T = 3
    assert step_time[("ih", 0)] == step_time[("y0", 0)] == {s: s for s in range(T)}
    assert step_time[("ih", 1)] == step_time[("y1", 1)] == {s: T - 1 - s for s in range(T)}


def test_only_batch_and_input_features_split() -> None:
    """The recurrence carries the steps, the hidden units, the gates, layers and directions: only the
    batch (data parallelism) and the layer-0 input features (a partial-sum gate all-reduce) split."""
    m = _module("lstm", 2, True, False, True, i=4, h=4)
    g, op = _capture(m, torch.randn(4, 2, 4))
    split = {d for p in legal_placements(g, op, DeviceMesh.of(tp=2)) for d in p.dims}
    assert split == {"b", "k"}
    from polyparallel.backends.torch.capabilities import expressible

    ok = expressible(g, 2)
    assert not any(ok(op, p) for p in legal_placements(g, op, DeviceMesh.of(tp=2)) if p.splits)


def test_proj_size_is_opaque_with_a_reason() -> None:
    m = torch.nn.LSTM(4, 6, proj_size=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = capture_torch(m, (torch.randn(2, 3, 4),))
    (op,) = [o for o in g.ops if "lstm" in o.target]
    assert op.is_opaque and "proj_size" in op.opaque_reason


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_onnx_export_has_the_torch_numbers(cell: str) -> None:
    m = _module(cell, 2, True, True, True)
    x = torch.randn(3, 4, 5)
    gt, op = _capture(m, x)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (x,), buf, dynamo=False, do_constant_folding=False)
        go = capture_onnx(onnx.load_from_string(buf.getvalue()))
    rec = [o for o in go.ops if o.target in ("LSTM", "GRU", "RNN")]
    assert len(rec) == 2 and all(o.kind is OpKind.RECURRENT for o in rec), [o.opaque_reason for o in rec]
    assert sum(o.flops for o in rec) == op.flops
    assert go.param_count() == gt.param_count() == sum(p.numel() for p in m.parameters())


class _Tagger(torch.nn.Module):
    """Embedding, LSTM, per-token classifier; the mean cross entropy when labels are given."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = torch.nn.Embedding(50, 16), torch.nn.LSTM(16, 32, batch_first=True), \
            torch.nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        y = self.head(self.rnn(self.emb(ids))[0])
        return y if labels is None else torch.nn.functional.cross_entropy(y.flatten(0, 1), labels.flatten())


def tagger() -> torch.nn.Module:
    return _Tagger()


def tagger_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank
    return torch.randint(0, 50, (8, 12), generator=g), torch.randint(0, 5, (8, 12), generator=g)


def test_search_never_splits_the_time_steps() -> None:
    ids = torch.randint(0, 50, (8, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = polyparallel.search(_Tagger(), (ids,), cluster="local-cpu:2", constraints={"placements": "any"})
        g = capture_torch(_Tagger(), (ids,))
    assert s.sp == 1, s
    with pytest.raises(ValueError, match="recurrence over its sequence"):
        op_plans(g, ParallelConfig(dp=1, sp=2))
    with pytest.raises(polyparallel.DoesNotFit, match=r"'lstm' .* carries a recurrence"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        polyparallel.search(_Tagger(), (ids,), cluster="local-cpu:2", constraints={"placements": "any", "sp": 2})
    assert op_plans(g, ParallelConfig(dp=1, tp=2))  # tp is priced: the LSTM replicated, not split


def _onnx_lstm(T: int, B: int, I: int, H: int, peepholes: bool) -> onnx.ModelProto:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.zeros(s, np.float32), n)
             for n, s in (("W", (1, 4 * H, I)), ("R", (1, 4 * H, H)), ("B", (1, 8 * H)), ("P", (1, 3 * H)))]
    node = helper.make_node("LSTM", ["X", "W", "R", "B", "", "", "", "P" if peepholes else ""], ["Y"], hidden_size=H)
    g = helper.make_graph([node], "lstm", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [T, B, I])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [T, 1, B, H])],
                          inits if peepholes else inits[:3])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])


def test_onnx_peepholes_add_six_flops_per_unit_and_step() -> None:
    T, B, I, H = 3, 2, 4, 5
    plain, peep = (capture_onnx(_onnx_lstm(T, B, I, H, p)).ops[0] for p in (False, True))
    assert plain.kind is peep.kind is OpKind.RECURRENT
    g, gates = 4 * H, T * B * 4 * H
    cell = 4 + 3 * flops_per_element("sigmoid") + 2 * flops_per_element("tanh") + 4  # gate sums, c and h updates
    assert plain.flops == T * (2 * B * g * I + 2 * B * g * H) + 2 * gates + T * B * H * cell
    assert peep.flops - plain.flops == 6 * T * B * H


class _CellLoop(torch.nn.Module):
    """A recurrent layer written as a Python loop of one cell: one cell op per step in the graph."""

    def __init__(self, cell: str, i: int, h: int) -> None:
        super().__init__()
        cls = {"lstm": torch.nn.LSTMCell, "gru": torch.nn.GRUCell, "rnn_tanh": torch.nn.RNNCell}[cell]
        self.cell, self.lstm = cls(i, h), cell == "lstm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = None
        for t in range(x.shape[0]):
            state = self.cell(x[t], state)
        return state[0] if self.lstm else state


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_cell_ops_count_the_layer_step_by_step(cell: str) -> None:
    m, x = _CellLoop(cell, 5, 6), torch.randn(4, 3, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = capture_torch(m, (x,))
    steps = [op for op in g.ops if op.kind is OpKind.RECURRENT]
    assert len(steps) == 4 and not g.opaque_ops()
    layer = _module(cell, 1, False, False, True)  # the same equations, fused: its unrolled run counts them
    layer.load_state_dict({f"{k}_l0": v for k, v in m.cell.state_dict().items()})
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        _, h_n, pointwise = _unrolled(layer, cell, x)
    assert sum(op.flops for op in steps) == fc.get_total_flops() + pointwise
    torch.testing.assert_close(h_n[0], m(x))
    assert g.param_count() == sum(p.numel() for p in m.parameters())
    _check_coverage(g, steps[0])


@pytest.mark.slow  # two processes, as the torch backend's tests
@pytest.mark.timeout(90)
def test_tensor_parallel_plan_trains_like_one_process() -> None:
    """tp=2 runs the LSTM replicated (the backend splits no recurrent op): the plan the search writes
    is accepted before launch and trains to the single-process losses."""
    from polyparallel.backends.torch import _examples as ex
    from polyparallel.backends.torch import train
    from polyparallel.backends.torch.capabilities import plan_problems

    x, y = tagger_data(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = polyparallel.search(tagger(), (x,), "local-cpu:2", example_kwargs={"labels": y}, batch_size=8,
                                constraints={"dp": 1, "tp": 2, "pp": 1, "microbatches": 1, "recompute": "none"})
        g = capture_torch(tagger(), (x,), {"labels": y})
    assert (s.dp, s.tp) == (1, 2) and plan_problems(g, s) == []
    assert all(p.placement == "" for p in s.placements if any("lstm" in o for o in p.ops))
    log = train(s, tagger, tagger_data, steps=2, lr=0.1, seed=0)
    ref = ex.single_process_losses(tagger, tagger_data, steps=2, lr=0.1, seed=0)
    assert max(abs(r["loss"] - want) / want for r, want in zip(log, ref)) <= 1e-5
