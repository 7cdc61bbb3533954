r"""Recurrent layers (LSTM, GRU, Elman RNN), stacked and bidirectional, as one loop nest.

A layer ``l < L`` in direction ``d < D`` runs ``T`` steps; step ``s`` of direction ``d`` reads input time
``τ(s, d) = s`` (forward) or ``T − 1 − s`` (reverse). With ``G`` gates (4 for LSTM, 3 for GRU, 1
for an RNN) of ``H`` hidden units each, per step:

    gi[l,d,s,b,q,n] = Σ_k W_ih^{l,d}[q·H + n, k] · x_l[τ(s,d), b, k]  (+ b_ih^{l,d}[q·H + n])
    gh[l,d,s,b,q,n] = Σ_j W_hh^{l,d}[q·H + n, j] · h[l,d,s−1,b,j]    (+ b_hh^{l,d}[q·H + n])
    h[l,d,s,b,n], c[l,d,s,b,n] = cell(gi[l,d,s,b,·,n], gh[l,d,s,b,·,n], h[l,d,s−1,b,n], c[l,d,s−1,b,n])

``x_0`` is the op's input (``k < I``); a layer above reads both directions of the one below
(``k = e·H + j``: ``h[l−1, e, step of τ in direction e, b, j]``). Step ``−1`` is the initial state
``h0[l·D + d, b, ·]`` (zeros when absent). The outputs copy ``h`` (no FLOPs): ``y[τ(s,d), b, d·H + n]``
of the last layer (ONNX: ``Y[τ, d, b, n]``), ``h_n[l·D + d, b, n] = h[l, d, T−1, b, n]``, ``c_n`` likewise.

Dims: ``s`` (steps), ``u`` (steps 1..T−1, the recurrence ``s = u + 1``), ``l`` (layer), ``dir``
(direction), ``b`` (batch), ``q`` (gate), ``n`` (hidden unit), ``k`` (input feature, layer 0) and ``j``
(hidden unit read: the reduction of the recurrent and upper-layer input matmuls). Each layer and
direction has its own weight tensors, so its matmuls are statements of their own; the cell and the
copies iterate ``l, dir``.

**What may be split.** ``h``, ``c``, ``gi`` and ``gh`` are temporaries of the op: one statement writes
``h[.., u + 1, .., n]`` and another reads ``h[.., u, .., j]``. A split of ``u``, ``s``, ``n``, ``j``,
``q``, ``l`` or ``dir`` would make one device read what another computes inside the op, step after
step, which the polyhedral model's placement rule refuses (a dim that indexes a temporary
differently where it is written and where it is read: :mod:`polyparallel.poly`). The batch ``b``
splits (data parallelism) and the layer-0 input features ``k`` split with ``gi`` all-reduced (the
model all-reduces the whole temporary, every layer's: exact for one layer, an over-count above).
Megatron-style splits of the hidden units would need ``h`` all-gathered at every step, a
communication inside the op the polyhedral model does not price, so they are not offered.

**FLOPs**, per layer, direction and step: ``2·B·G·H·H_in`` (input matmul, ``H_in = I`` or ``D·H``),
``2·B·G·H·H`` (recurrent matmul, counted at every step as the kernels compute it, also against
a zero initial state), ``2·B·G·H`` bias adds when the layer has biases, and ``B·H·e`` for the cell's
pointwise math with the table's costs of the activations (:data:`FLOPS_PER_ELEMENT`):

* LSTM ``e = 4 + 3·σ + 2·tanh + 4`` (``gi + gh`` per gate; ``c = f·c + i·g``; ``h = o·tanh(c)``), 6 more
  with ONNX's peepholes (``p ⊙ c`` added to the input, forget and output gates);
* GRU ``e = 2 + 2·σ + 2 + tanh + 4`` (``r, z``; ``n = tanh(gi_n + r·gh_n)``; ``h = (1 − z)·n + z·h``;
  ONNX's ``linear_before_reset = 0`` multiplies ``r·h`` before the matmul instead: the same count);
* RNN ``e = 1 + act`` (``tanh`` or ``relu``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from polyparallel.ir import Access, AffineExpr, Dim, E, Hint, LoopNest, Role, Statement

from ._common import NotModelled
from ._pointwise import flops_per_element

__all__ = ["GATES", "cell_flops", "onnx_recurrent", "torch_recurrent", "torch_recurrent_cell"]

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}

# (operand, constant leading indices, offset added to the gate row) of one weight of a layer-direction
WeightRef = tuple[str, tuple[int, ...], int]
Weights = Callable[[int, int, str], WeightRef | None]


def cell_flops(cell: str) -> float:
    """FLOPs of the cell's pointwise math per hidden unit and step (module docstring)."""
    sig, tanh = flops_per_element("sigmoid"), flops_per_element("tanh")
    if cell == "lstm":
        return 4 + 3 * sig + 2 * tanh + 4
    if cell == "gru":
        return 2 + 2 * sig + 2 + tanh + 4
    return 1 + (tanh if cell == "rnn_tanh" else flops_per_element("relu"))


def torch_recurrent(cell: str, x: Sequence[int], hx: Sequence[Sequence[int] | None], params: Sequence[Sequence[int]],
                    *, has_biases: bool, num_layers: int, bidirectional: bool, batch_first: bool) -> LoopNest:
    """``aten.lstm/gru/rnn_tanh/rnn_relu`` with operands ``(input, h0[, c0], *params)``: ``params`` per
    layer and direction ``w_ih, w_hh[, b_ih, b_hh]`` (torch's ``_flat_weights`` order); outputs
    ``(output, h_n[, c_n])``. Raises :class:`NotModelled` for unbatched input and ``proj_size``."""
    if cell not in GATES:
        raise NotModelled(f"recurrent cell {cell!r}")
    L, D = int(num_layers), 2 if bidirectional else 1
    per = 4 if has_biases else 2
    if len(x) != 3:
        raise NotModelled(f"{cell} of an unbatched input {list(x)}")
    if len(params) != L * D * per:
        raise NotModelled(f"{cell} with {len(params)} weight tensors for {L} layer(s) x {D} direction(s): "
                          "proj_size (an LSTM's w_hr) is not modelled")
    G = GATES[cell]
    T, B, I = (x[1], x[0], x[2]) if batch_first else tuple(x)
    H = params[1][1]
    for l in range(L):
        for d in range(D):
            w_ih, w_hh, *bs = params[(l * D + d) * per:(l * D + d + 1) * per]
            want = [(G * H, I if l == 0 else D * H), (G * H, H)] + [(G * H,)] * (per - 2)
            if [tuple(w_ih), tuple(w_hh), *map(tuple, bs)] != want:
                raise NotModelled(f"{cell} layer {l} weights {[list(w_ih), list(w_hh)]}: expected {want[:2]} "
                                  "(proj_size is not modelled)")

    def weights(l: int, d: int, which: str) -> WeightRef | None:
        i = ("w_ih", "w_hh", "b_ih", "b_hh").index(which)
        if i >= per:
            return None
        return f"in{len(hx) + 1 + (l * D + d) * per + i}", (), 0

    hx = list(hx)
    return recurrent(cell, T, B, I, H, num_layers=L, directions=D, weights=weights,
                     x=lambda t, b, k: ("in0", (b, t, k) if batch_first else (t, b, k)),
                     h0="in1" if hx and hx[0] is not None else None,
                     c0="in2" if cell == "lstm" and len(hx) > 1 and hx[1] is not None else None,
                     y=lambda t, d, b, n: ("out0", (b, t, d * H + n) if batch_first else (t, b, d * H + n)),
                     h_n="out1", c_n="out2" if cell == "lstm" else None)


def torch_recurrent_cell(cell: str, x: Sequence[int], w_ih: Sequence[int], w_hh: Sequence[int], *,
                         n_states: int, has_biases: bool) -> LoopNest:
    """One step: ``aten.lstm_cell/gru_cell/rnn_tanh_cell/rnn_relu_cell`` with operands ``(input, h[, c],
    w_ih, w_hh[, b_ih, b_hh])``, ``input [B, I]``, states ``[B, H]``; outputs ``h'[, c']``."""
    base = cell.removesuffix("_cell")
    if base not in GATES or len(x) != 2 or len(w_ih) != 2 or len(w_hh) != 2:
        raise NotModelled(f"{cell} with input {list(x)} (a batched [B, I] input is modelled)")
    H, G = w_hh[1], GATES[base]
    if tuple(w_ih) != (G * H, x[1]) or tuple(w_hh) != (G * H, H) or n_states != (2 if base == "lstm" else 1):
        raise NotModelled(f"{cell} with input {list(x)}, weights {list(w_ih)}, {list(w_hh)}")
    first = 1 + n_states

    def weights(_l: int, _d: int, which: str) -> WeightRef | None:
        i = ("w_ih", "w_hh", "b_ih", "b_hh").index(which)
        return None if i >= (4 if has_biases else 2) else (f"in{first + i}", (), 0)

    return recurrent(base, 1, x[0], x[1], H, num_layers=1, directions=1, weights=weights,
                     x=lambda _t, b, k: ("in0", (b, k)), h0="in1", c0="in2" if base == "lstm" else None,
                     y=None, h_n="out0", c_n="out1" if base == "lstm" else None, state_batch_major=None)


def onnx_recurrent(cell: str, X: Sequence[int], W: Sequence[int], R: Sequence[int], *, has_bias: bool,
                   operands: dict[str, str | None], direction: str = "forward", layout: int = 0) -> LoopNest:
    """ONNX ``LSTM`` / ``GRU`` / ``RNN`` (one layer): ``X [T, B, I]`` (``layout=1``: ``[B, T, I]``),
    ``W [D, G·H, I]``, ``R [D, G·H, H]``, ``B [D, 2·G·H]``; ``operands`` names the operand of ``x``,
    ``W``, ``R``, ``B``, ``initial_h``, ``initial_c`` and the outputs ``Y``, ``Y_h``, ``Y_c`` (None:
    absent). ``Y`` is ``[T, D, B, H]`` (``layout=1``: ``[B, T, D, H]``)."""
    if len(X) != 3 or len(W) != 3 or len(R) != 3:
        raise NotModelled(f"{cell} with X{list(X)}, W{list(W)}, R{list(R)}")
    D, H = int(W[0]), int(R[2])
    T, B, I = (X[1], X[0], X[2]) if layout else tuple(X)
    if (2 if direction == "bidirectional" else 1) != D or tuple(W) != (D, GATES[cell] * H, I) or \
            tuple(R) != (D, GATES[cell] * H, H):
        raise NotModelled(f"{cell} {direction} with W{list(W)}, R{list(R)} and {H} hidden units")
    G = GATES[cell]

    def weights(_l: int, d: int, which: str) -> WeightRef | None:
        if which in ("b_ih", "b_hh"):
            return (operands["B"], (d,), 0 if which == "b_ih" else G * H) if has_bias else None
        return operands["W" if which == "w_ih" else "R"], (d,), 0

    # a lone reverse direction runs the reverse pass as direction 0
    rev = direction == "reverse"
    y = operands.get("Y")
    return recurrent(cell, T, B, I, H, num_layers=1, directions=D, weights=weights, reverse_only=rev,
                     x=lambda t, b, k: (operands["x"], (b, t, k) if layout else (t, b, k)),
                     h0=operands.get("initial_h"), c0=operands.get("initial_c"),
                     y=None if y is None else
                     (lambda t, d, b, n: (y, (b, t, d, n) if layout else (t, d, b, n))),
                     h_n=operands.get("Y_h"), c_n=operands.get("Y_c"), state_batch_major=bool(layout),
                     peepholes=operands.get("P") if cell == "lstm" else None)


def recurrent(cell: str, T: int, B: int, I: int, H: int, *, num_layers: int, directions: int, weights: Weights,
              x: Callable[[AffineExpr, AffineExpr, AffineExpr], tuple[str, tuple]],
              h0: str | None, c0: str | None,
              y: Callable[[AffineExpr, AffineExpr, AffineExpr, AffineExpr], tuple[str, tuple]] | None,
              h_n: str | None, c_n: str | None, reverse_only: bool = False,
              state_batch_major: bool | None = False, peepholes: str | None = None) -> LoopNest:
    """The loop nest of the module docstring. ``x(t, b, k)`` and ``y(t, d, b, n)`` give the operand
    and index of the input and output; ``h0``/``c0``/``h_n``/``c_n`` are ``[L·D, B, H]`` operands
    (``state_batch_major``: ``[B, L·D, H]``, ONNX ``layout=1``; None: ``[B, H]``, a cell's);
    ``peepholes`` an ONNX LSTM's ``P [D, 3·H]`` (``p_i ⊙ c``, ``p_f ⊙ c``, ``p_o ⊙ c`` added to the
    gates: 6 more FLOPs per unit)."""
    L, D, G = num_layers, directions, GATES[cell]
    dims = [Dim("s", T, Role.PARALLEL, Hint.SEQUENCE), Dim("l", L), Dim("dir", D),
            Dim("b", B, Role.PARALLEL, Hint.BATCH), Dim("q", G), Dim("n", H, Role.PARALLEL, Hint.FEATURE),
            Dim("k", I, Role.REDUCTION, Hint.FEATURE), Dim("j", H, Role.REDUCTION, Hint.FEATURE)]
    if T > 1:
        dims.insert(1, Dim("u", T - 1, Role.PARALLEL, Hint.SEQUENCE))
    s, u, b, q, n, k, j = (E(v) for v in ("s", "u", "b", "q", "n", "k", "j"))
    zero = 0 * s

    def time(step: AffineExpr, d: int) -> AffineExpr:
        return step if (d == 0) != reverse_only else (T - 1) - step

    def state(operand: str, ld: AffineExpr, idx: AffineExpr) -> Access:
        if state_batch_major is None:  # a cell's [B, H] state: one layer and direction
            return Access(operand, (b, idx))
        return Access(operand, (b, ld, idx) if state_batch_major else (ld, b, idx))

    def weight(l: int, d: int, which: str, *tail: AffineExpr) -> Access | None:
        ref = weights(l, d, which)
        if ref is None:
            return None
        operand, lead, off = ref
        return Access(operand, (*(zero + c for c in lead), q * H + n + off, *tail))

    sts: list[Statement] = []
    for l in range(L):
        for d in range(D):
            at = (zero + l, zero + d)
            gi_s, gh_s = Access("gi", (*at, s, b, q, n)), Access("gh", (*at, s, b, q, n))
            if l == 0:
                xo, xi = x(time(s, d), b, k)
                sts.append(Statement(f"ih{l}_{d}", ("s", "b", "q", "n", "k"), flops_per_point=2,
                                     reads=(Access(xo, xi), weight(l, d, "w_ih", k)), writes=(gi_s,)))
            else:
                for e in range(D):  # the layer below, direction e, at the same input time
                    step_e = s if e == d else (T - 1) - s
                    sts.append(Statement(f"ih{l}_{d}_{e}", ("s", "b", "q", "n", "j"), flops_per_point=2,
                                         reads=(Access("h", (zero + (l - 1), zero + e, step_e, b, j)),
                                                weight(l, d, "w_ih", e * H + j)), writes=(gi_s,)))
            for which, tmp in (("b_ih", gi_s), ("b_hh", gh_s)):
                acc = weight(l, d, which)
                if acc is not None:
                    sts.append(Statement(f"{which}{l}_{d}", ("s", "b", "q", "n"), reads=(acc,), writes=(tmp,),
                                         flops_per_point=1))
            first = (state(h0, zero + (l * D + d), j),) if h0 else ()
            sts.append(Statement(f"hh0_{l}_{d}", ("b", "q", "n", "j"), flops_per_point=2,
                                 reads=(*first, weight(l, d, "w_hh", j)), writes=(Access("gh", (*at, zero, b, q, n)),)))
            if T > 1:
                sts.append(Statement(f"hh{l}_{d}", ("u", "b", "q", "n", "j"), flops_per_point=2,
                                     reads=(Access("h", (*at, u, b, j)), weight(l, d, "w_hh", j)),
                                     writes=(Access("gh", (*at, u + 1, b, q, n)),)))
    ld = (E("l"), E("dir"))
    ldi = E("l") * D + E("dir")
    lstm = cell == "lstm"
    e = cell_flops(cell) + (6 if peepholes else 0)
    peep = tuple(Access(peepholes, (E("dir"), E("n") + g * H)) for g in range(3)) if peepholes else ()
    # the state the cell carries besides the gates: c (LSTM), h (GRU's z·h); at step 0 the initial one
    carried = {"lstm": ("c", c0), "gru": ("h", h0)}.get(cell)
    for name, step, prev in (("cell0", zero, None), ("cell", u + 1, u)):
        if prev is not None and T == 1:
            continue
        if carried is None:
            reads_prev: tuple[Access, ...] = ()
        elif prev is None:
            reads_prev = (state(carried[1], ldi, n),) if carried[1] else ()
        else:
            reads_prev = (Access(carried[0], (*ld, prev, b, n)),)
        gates = tuple(Access(t, (*ld, step, b, zero + g, n)) for t in ("gi", "gh") for g in range(G))
        writes = (Access("h", (*ld, step, b, n)),) + ((Access("c", (*ld, step, b, n)),) if lstm else ())
        st_dims = ("l", "dir", *(() if prev is None else ("u",)), "b", "n")
        sts.append(Statement(name, st_dims, reads=gates + reads_prev + peep, writes=writes, flops_per_point=e))
    if y is not None:
        for d in range(D):
            yo, yi = y(time(s, d), zero + d, b, n)
            sts.append(Statement(f"y{d}", ("s", "b", "n"), reads=(Access("h", (zero + (L - 1), zero + d, s, b, n)),),
                                 writes=(Access(yo, yi),), flops_per_point=0))
    for operand, tmp in ((h_n, "h"), (c_n if lstm else None, "c")):
        if operand:
            sts.append(Statement(f"{tmp}_n", ("l", "dir", "b", "n"), reads=(Access(tmp, (*ld, zero + (T - 1), b, n)),),
                                 writes=(state(operand, ldi, n),), flops_per_point=0))
    sts = [Statement(st.name, st.dims, tuple(a for a in st.reads if a is not None), st.writes, st.flops_per_point)
           for st in sts]
    used = {d for st in sts for d in st.dims}
    return LoopNest(tuple(dm for dm in dims if dm.name in used), tuple(sts))
