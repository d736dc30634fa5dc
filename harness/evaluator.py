"""A float64 interpreter of plans that shares no arithmetic with the verifier.

    execute(plan, seed=0, inputs=None) -> list[np.ndarray | None]

The oracle (harness/oracle.py) runs both plans of a pair with it. The
verifier's own numeric backend (verdict/numeric.py) runs the operators'
rule table (verdict/ops); a rule that is wrong there is wrong on every
path that runs it. So nothing here imports verdict but the plan data model
(verdict/plan.py): every operator is defined again from what it means,

* the model operators by torch's own functions in float64, and their
  backward nodes by torch autograd through that forward (the vector-Jacobian
  product is the definition of a backward node, docs/plan-format.md);
* the operators torch has no function for (rotary embedding, the causal
  mask, top-k routing with a capacity) written out from their definitions;
* collectives from their definitions over the group's tensors (a sum, a
  maximum, a concatenation, the own chunk of a sum, an exchange of chunks);
* the training-step operators from theirs: accumulation is a sum, and the
  optimizer steps are torch.optim's SGD, Adam and AdamW run on the values.

Anything no machine could run raises :class:`EvaluationError`: a tensor
read before any node writes it, a node that reads or writes another rank's
memory without being a collective, a shape an operator cannot take or
make, an input loaded as a partial sum.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from verdict.plan import INPUT_KINDS, Logical, Node, Plan

Tensor = torch.Tensor
Forward = Callable[..., list[Tensor]]


class EvaluationError(ValueError):
    """A plan no machine could run."""


def input_value(t: Logical, seed: int) -> np.ndarray:
    """The full value of an input logical tensor, the same in every plan of a
    model: drawn from a generator seeded by (seed, name)."""
    rng = np.random.default_rng([seed, 7, zlib.adler32(t.name.encode())])
    shape = tuple(t.shape)
    if t.kind == "tokens":  # one-hot rows
        return np.eye(shape[-1])[rng.integers(0, shape[-1], size=shape[:-1])]
    if t.kind == "param" and len(shape) == 1:
        return 1.0 + 0.2 * rng.random(shape) - 0.1
    if t.kind == "param":
        return (2.0 * rng.random(shape) - 1.0) / math.sqrt(shape[-1])
    if t.kind == "buffer" and t.name.endswith(".exp_avg_sq"):
        return rng.random(shape)  # a second moment is never negative
    if t.kind == "buffer":
        return 2.0 * rng.random(shape) - 1.0
    return rng.normal(size=shape)


# -- model operators: torch in float64 ----------------------------------------


def _dims(dim, ndim: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    if any(not -max(ndim, 1) <= d < max(ndim, 1) for d in dims):
        raise EvaluationError(f"dim {dim} out of range for rank {ndim}")
    return tuple(sorted({d % max(ndim, 1) for d in dims}))


def _reduce(fn: Callable, x: Tensor, dim, keepdim: bool) -> Tensor:
    dims = _dims(dim, x.dim())
    if not dims:  # a 0-d tensor: nothing to reduce
        return x.clone()
    return fn(x, dim=dims, keepdim=keepdim)


def _same_shape(*xs: Tensor) -> None:
    if any(x.shape != xs[0].shape for x in xs):
        raise EvaluationError(f"shapes differ: {[tuple(x.shape) for x in xs]}")


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    if a.dim() < 2 or a.dim() != b.dim() or a.shape[:-2] != b.shape[:-2]:
        raise EvaluationError(f"matmul of {tuple(a.shape)} and {tuple(b.shape)}")
    return torch.matmul(a, b)


def _embedding(onehot: Tensor, table: Tensor) -> Tensor:
    """A row lookup written as one_hot(ids) @ table (docs/ops.md), so that a
    vocabulary-parallel shard of the table is a slice of the contraction."""
    if table.dim() != 2 or onehot.shape[-1] != table.shape[0]:
        raise EvaluationError(f"embedding of {tuple(onehot.shape)} in {tuple(table.shape)}")
    return onehot @ table


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> list[Tensor]:
    """Rotary position embedding (Su et al.), q and k of [B, S, heads, D],
    cos and sin of [S, D]: x * cos + rotate_half(x) * sin."""
    if q.dim() != 4 or k.dim() != 4 or cos.shape != (q.shape[1], q.shape[3]) \
            or sin.shape != cos.shape or k.shape[1] != q.shape[1] or q.shape[3] % 2:
        raise EvaluationError("rotary: q, k, cos, sin do not fit")
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return [q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s]


def _causal_mask(x: Tensor, row_chunk: int = 0, col_chunk: int = 0,
                 order: list[int] | None = None) -> Tensor:
    """Scores of a key after its query set to -inf; the local rows are query
    positions row_chunk * S_q + i, the local columns key positions
    col_chunk * S_k + j; with a chunk ``order``, row (or column) i is in
    chunk slot i // n of n positions, which holds chunk order[slot]."""
    if x.dim() < 2:
        raise EvaluationError("causal mask of fewer than 2 dims")
    s_q, s_k = x.shape[-2:]
    rows = torch.arange(s_q) + row_chunk * s_q
    cols = torch.arange(s_k) + col_chunk * s_k
    if order is not None:
        m = len(order)
        if s_q != s_k or s_q % m or sorted(order) != list(range(m)) or row_chunk or col_chunk:
            raise EvaluationError("attention: a chunk order that does not lay out the sequence")
        n = s_q // m
        chunks = torch.tensor(list(order))
        rows, cols = chunks[rows // n] * n + rows % n, chunks[cols // n] * n + cols % n
    return x.masked_fill(cols[None, :] > rows[:, None], float("-inf"))


def _masked_scores(q: Tensor, k: Tensor, scale: float, causal: bool, row_chunk: int,
                   col_chunk: int, order: list[int] | None = None) -> Tensor:
    if q.dim() < 2 or k.dim() != q.dim() or q.shape[:-2] != k.shape[:-2] \
            or q.shape[-1] != k.shape[-1]:
        raise EvaluationError("attention: q and k do not fit")
    s = (q @ k.transpose(-1, -2)) * scale
    return _causal_mask(s, row_chunk, col_chunk, order) if causal else s


def _attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = False,
               row_chunk: int = 0, col_chunk: int = 0,
               order: list[int] | None = None) -> list[Tensor]:
    """softmax(masked scores) @ v and the rows' log-sum-exp; a row that sees
    no key gives 0 and -inf (what flash kernels return)."""
    if v.dim() != k.dim() or v.shape[:-1] != k.shape[:-1]:
        raise EvaluationError("attention: k and v do not fit")
    s = _masked_scores(q, k, scale, causal, row_chunk, col_chunk, order)
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return [torch.exp(s - finite[..., None]) @ v, lse]


def _attention_grad(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    scale: float, causal: bool = False, row_chunk: int = 0,
                    col_chunk: int = 0, order: list[int] | None = None) -> list[Tensor]:
    """The flash backward from the given out and lse: p = exp(s - lse),
    dv = p^T dout, ds = p (dout v^T - rowsum(dout out)), dq = scale ds k,
    dk = scale ds^T q."""
    _same_shape(dout, out)
    s = _masked_scores(q, k, scale, causal, row_chunk, col_chunk, order)
    p = torch.exp(s - lse[..., None])
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    return [(ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ dout]


def _lse_merge(oa: Tensor, la: Tensor, ob: Tensor, lb: Tensor) -> list[Tensor]:
    """The attention over the union of two disjoint key sets from each one's
    output and log-sum-exp: lse = logaddexp(la, lb), out = exp(la - lse) oa
    + exp(lb - lse) ob (0 and -inf when neither saw a key)."""
    _same_shape(oa, ob)
    _same_shape(la, lb)
    if oa.shape[:-1] != la.shape:
        raise EvaluationError("lse_merge: outs and lses do not fit")
    lse = torch.logaddexp(la, lb)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa, wb = torch.exp(la - finite), torch.exp(lb - finite)
    return [wa[..., None] * oa + wb[..., None] * ob, lse]


def _route(scores: Tensor, topk: int, capacity: int) -> Tensor:
    """Dispatch mask [B, S, E, C] of top-k routing with a static capacity:
    per sample, tokens in order, each token's experts by decreasing score
    (ties to the lower expert); a token takes its expert's next free slot
    and is dropped once the expert has ``capacity`` tokens."""
    if scores.dim() != 3 or not 1 <= topk <= scores.shape[2]:
        raise EvaluationError(f"route: top-{topk} of scores {tuple(scores.shape)}")
    b, s, e = scores.shape
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    out = torch.zeros(b, s, e, capacity, dtype=torch.float64)
    for i in range(b):
        taken = [0] * e
        for t in range(s):
            for ex in order[i, t].tolist():
                if taken[ex] < capacity:
                    out[i, t, ex, taken[ex]] = 1.0
                taken[ex] += 1
    return out


def _expand(x: Tensor, shape) -> Tensor:
    shape = tuple(shape)
    if len(shape) < x.dim() or any(a != b and a != 1 for a, b in
                                   zip(reversed(x.shape), reversed(shape))):
        raise EvaluationError(f"expand {tuple(x.shape)} to {shape}")
    return x.expand(shape)


def _linear(x: Tensor, w: Tensor) -> Tensor:
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise EvaluationError(f"linear of {tuple(x.shape)} by {tuple(w.shape)}")
    return F.linear(x, w)


def _unflatten(x: Tensor, dim: int, sizes) -> Tensor:
    if math.prod(sizes) != x.shape[dim]:
        raise EvaluationError(f"unflatten {tuple(x.shape)}[{dim}] into {tuple(sizes)}")
    return torch.unflatten(x, dim, tuple(sizes))


def _softmax(x: Tensor, dim: int) -> Tensor:
    if x.dim() == 0:
        raise EvaluationError("softmax of a 0-d tensor")
    return torch.softmax(x, dim=dim)


#: Operators with a gradient: forward(args, **kwargs) -> outputs. Their
#: ``bw`` nodes are the vector-Jacobian product of this forward.
DIFFERENTIABLE: dict[str, Forward] = {
    "add": lambda x: [x[0] + x[1]],
    "sub": lambda x: [x[0] - x[1]],
    "mul": lambda x: [x[0] * x[1]],
    "add_scalar": lambda x, value: [torch.add(x[0], value)],
    "mul_scalar": lambda x, value: [torch.mul(x[0], value)],
    "div": lambda x, value: [torch.div(x[0], value)],
    "pow": lambda x, exponent: [torch.pow(x[0], exponent)],
    "rsqrt": lambda x: [torch.rsqrt(x[0])],
    "exp": lambda x: [torch.exp(x[0])],
    "log": lambda x: [torch.log(x[0])],
    "silu": lambda x: [F.silu(x[0])],
    "softmax": lambda x, dim: [_softmax(x[0], dim)],
    "linear": lambda x: [_linear(x[0], x[1])],
    "matmul": lambda x: [_matmul(x[0], x[1])],
    "einsum": lambda x, eq: [torch.einsum(eq, *x)],
    "embedding": lambda x: [_embedding(x[0], x[1])],
    "transpose": lambda x, dim0, dim1: [torch.transpose(x[0], dim0, dim1)],
    "unflatten": lambda x, dim, sizes: [_unflatten(x[0], dim, sizes)],
    "flatten": lambda x, start, end: [torch.flatten(x[0], start, end)],
    "repeat_interleave": lambda x, repeats, dim: [torch.repeat_interleave(x[0], repeats, dim)],
    "sum": lambda x, dim=None, keepdim=False: [_reduce(torch.sum, x[0], dim, keepdim)],
    "mean": lambda x, dim=None, keepdim=False: [_reduce(torch.mean, x[0], dim, keepdim)],
    "max": lambda x, dim=None, keepdim=False: [_reduce(torch.amax, x[0], dim, keepdim)],
    "apply_rotary_emb": lambda x: _rotary(*x),
    "causal_mask": lambda x, row_chunk=0, col_chunk=0: [_causal_mask(x[0], row_chunk, col_chunk)],
    "attention": lambda x, **kw: _attention(*x, **kw),
    "multiref": lambda x, times: [x[0].clone() for _ in range(times)],
    "expand": lambda x, shape: [_expand(x[0], shape)],
    "gelu": lambda x, approximate="none": [F.gelu(x[0], approximate=approximate)],
    "tanh": lambda x: [torch.tanh(x[0])],
    "sigmoid": lambda x: [torch.sigmoid(x[0])],
    "relu": lambda x: [torch.relu(x[0])],
    "cat": lambda x, dim: [torch.cat(list(x), dim=dim)],
    "narrow": lambda x, dim, start, length: [torch.narrow(x[0], dim, start, length)],
}

#: Inputs that never take a gradient: the one-hot ids of an embedding, the
#: cos and sin buffers of rotary embedding.
NO_GRADIENT = {"embedding": {0}, "apply_rotary_emb": {2, 3}}


# -- collectives: definitions over the group's tensors -------------------------


def _chunk(x: Tensor, parts: int, dim: int, index: int) -> Tensor:
    if x.dim() == 0 or x.shape[dim] % parts or not 0 <= index < parts:
        raise EvaluationError(f"chunk {index} of {parts} of {tuple(x.shape)} along {dim}")
    return torch.chunk(x, parts, dim=dim)[index]


def _group_sum(xs: Sequence[Tensor]) -> Tensor:
    _same_shape(*xs)
    return torch.stack(list(xs)).sum(dim=0)


def _group_max(xs: Sequence[Tensor]) -> Tensor:
    _same_shape(*xs)
    return torch.stack(list(xs)).amax(dim=0)


def _all_gather(xs: Sequence[Tensor], dim: int) -> Tensor:
    _same_shape(*xs)
    return torch.cat(list(xs), dim=dim)


def _all_to_all(xs: Sequence[Tensor], index: int, split_dim: int, concat_dim: int) -> Tensor:
    """What the rank at ``index`` receives: chunk ``index`` (along
    split_dim) of every member's tensor, in group order along concat_dim."""
    _same_shape(*xs)
    if split_dim % xs[0].dim() == concat_dim % xs[0].dim():
        raise EvaluationError("all_to_all splits and concatenates one dim")
    return torch.cat([_chunk(x, len(xs), split_dim, index) for x in xs], dim=concat_dim)


def _one(xs: Sequence[Tensor]) -> Tensor:
    if len(xs) != 1:
        raise EvaluationError(f"moves one tensor, got {len(xs)}")
    return xs[0].clone()


#: Collectives: forward(group tensors, **kwargs) -> outputs of the node's own
#: rank, whose position in the group is ``index``. They run the same in
#: every direction (the backward of a collective is another collective,
#: emitted as its own node).
COLLECTIVES: dict[str, Forward] = {
    "all_reduce": lambda x, index: [_group_sum(x)],
    "reducer": lambda x, index: [_group_sum(x)],
    "all_reduce_max": lambda x, index: [_group_max(x)],
    "all_gather": lambda x, index, dim: [_all_gather(x, dim)],
    "reduce_scatter": lambda x, index, dim: [_chunk(_group_sum(x), len(x), dim, index)],
    "all_reduce_avg": lambda x, index: [_group_sum(x) / len(x)],
    "reduce_scatter_avg": lambda x, index, dim: [_chunk(_group_sum(x) / len(x), len(x), dim, index)],
    "all_to_all": lambda x, index, split_dim, concat_dim: [
        _all_to_all(x, index, split_dim, concat_dim)],
    "send_recv": lambda x, src, dst: [_one(x)],
    "broadcast": lambda x, src: [_one(x)],
}


# -- local operators without a gradient and the training step ------------------


def _accumulate(buffer: Tensor, grad: Tensor) -> Tensor:
    _same_shape(buffer, grad)
    return buffer + grad


def _optimizer_step(make: Callable[[Tensor], torch.optim.Optimizer], param: Tensor,
                    grad: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict]:
    """Run one torch.optim step on copies: the updated parameter and state."""
    p = param.detach().clone().requires_grad_(True)
    p.grad = grad.detach().clone()
    opt = make(p)
    if state:
        opt.state[p] = {k: v.clone() for k, v in state.items()}
    opt.step()
    return p.detach(), opt.state[p]


def _sgd(x: list[Tensor], lr: float, weight_decay: float) -> list[Tensor]:
    """torch.optim.SGD without momentum: p - lr * (g + weight_decay * p)."""
    p, g = x
    _same_shape(p, g)
    return [_optimizer_step(lambda t: torch.optim.SGD([t], lr=lr, weight_decay=weight_decay,
                                                      foreach=False), p, g, {})[0]]


def _adam(x: list[Tensor], lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, decoupled: bool, step: int) -> list[Tensor]:
    """torch.optim.Adam (L2 through the gradient) or AdamW (decoupled decay)
    at step ``step`` (1 for the first) from moments m and v: the updated
    parameter and moments."""
    p, g, m, v = x
    _same_shape(p, g, m, v)
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    state = {"step": torch.tensor(float(step - 1)), "exp_avg": m, "exp_avg_sq": v}

    def make(t: Tensor) -> torch.optim.Optimizer:
        return kind([t], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                    foreach=False)

    p_new, after = _optimizer_step(make, p, g, state)
    if float(after["step"]) != step:
        raise EvaluationError(f"adam step {step}: torch took step {float(after['step'])}")
    return [p_new, after["exp_avg"].detach(), after["exp_avg_sq"].detach()]


LOCAL: dict[str, Forward] = {
    "split": lambda x, dim, parts, index: [_chunk(_single(x), parts, dim, index).clone()],
    "zeros": lambda x, shape: [torch.zeros(tuple(shape), dtype=torch.float64)],
    "ones": lambda x, shape: [torch.ones(tuple(shape), dtype=torch.float64)],
    "local_grad_accumulation": lambda x: [_accumulate(*x)],
    "detach": lambda x: [_single(x).detach().clone()],
    "route": lambda x, topk, capacity: [_route(_single(x), topk, capacity)],
    "attention_grad": lambda x, **kw: _attention_grad(*x, **kw),
    "lse_merge": lambda x: _lse_merge(*x),
    "sgd_step": _sgd,
    "adam_step": _adam,
    "clamp": lambda x, min=None, max=None: [torch.clamp(_single(x), min=min, max=max)],  # noqa: A006
}


def _single(xs: Sequence[Tensor]) -> Tensor:
    if len(xs) != 1:
        raise EvaluationError(f"takes one input, got {len(xs)}")
    return xs[0]


def known_ops() -> set[str]:
    return set(DIFFERENTIABLE) | set(COLLECTIVES) | set(LOCAL)


def is_collective(op: str) -> bool:
    return op in COLLECTIVES


# -- running nodes --------------------------------------------------------------


def _call(fn: Forward, args: list, kwargs: dict) -> list[Tensor]:
    try:
        return list(fn(args, **kwargs))
    except EvaluationError:
        raise
    except (RuntimeError, TypeError, IndexError, ValueError, ZeroDivisionError) as e:
        raise EvaluationError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _backward(op: str, node: Node, args: list, shapes: list) -> list[Tensor | None]:
    """A bw node: inputs are the forward inputs it keeps (None elsewhere),
    then one gradient per forward output; outputs one gradient per forward
    input. The gradients are torch autograd's through the forward."""
    n = len(node.outputs)
    saved, grads = args[:n], args[n:]
    shape_hint = next((g.shape for g in grads if g is not None), None)
    skip = NO_GRADIENT.get(op, set())
    leaves: list[Tensor] = []
    for k, x in enumerate(saved):
        shape = shapes[k] if shapes[k] is not None else (x.shape if x is not None else shape_hint)
        if shape is None:
            raise EvaluationError(f"{op} backward: no shape for forward input {k}")
        value = x.detach().clone() if x is not None else torch.zeros(shape, dtype=torch.float64)
        leaves.append(value.requires_grad_(shapes[k] is not None and k not in skip))
    with torch.enable_grad():
        outs = _call(DIFFERENTIABLE[op], leaves, node.kwargs)
    if len(outs) != len(grads):
        raise EvaluationError(f"{op} backward: {len(grads)} gradients for {len(outs)} outputs")
    pairs = []
    for out, g in zip(outs, grads):
        if g is None:
            continue
        if tuple(g.shape) != tuple(out.shape):
            raise EvaluationError(f"{op} backward: gradient {tuple(g.shape)} of an output "
                                  f"{tuple(out.shape)}")
        if out.requires_grad:
            pairs.append((out, g))
    wanted = [x for x in leaves if x.requires_grad]
    got: dict[int, Tensor | None] = {}
    if pairs and wanted:
        results = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                      allow_unused=True)
        got = {id(x): r for x, r in zip(wanted, results)}
    result: list[Tensor | None] = []
    for k, x in enumerate(leaves):
        if shapes[k] is None:
            result.append(None)
        elif k in skip:
            raise EvaluationError(f"{op} backward: input {k} takes no gradient")
        else:
            r = got.get(id(x))
            result.append(torch.zeros(x.shape, dtype=torch.float64) if r is None else r.detach())
    return result


def run(node: Node, args: list, shapes: list) -> list[Tensor | None]:
    """Outputs of one node from its input values (None at absent slots) and
    the shapes of its outputs (None at absent slots)."""
    op = node.op
    if node.dir == "bw" and op in DIFFERENTIABLE:
        return _backward(op, node, args, shapes)
    present = [a for a in args if a is not None]
    if len(present) != len(args):
        raise EvaluationError(f"{op} ({node.dir}) with an absent input")
    for table in (DIFFERENTIABLE, COLLECTIVES, LOCAL):
        if op in table:
            with torch.no_grad():
                return _call(table[op], present, node.kwargs)
    raise EvaluationError(f"unknown operator '{op}'")


def execute(plan: Plan, seed: int = 0,
            inputs: Callable[[Logical, int], np.ndarray] = input_value) -> list:
    """Values (float64 numpy arrays) of every tensor after all nodes ran in
    order; None for a tensor nothing wrote that is not an input. ``inputs``
    draws the full value of an input logical tensor."""
    values: list[Tensor | None] = [None] * len(plan.tensors)
    written = {o for node in plan.nodes for o in node.outputs if o >= 0}
    full: dict[int, Tensor] = {}
    for i, t in enumerate(plan.tensors):
        logical = plan.logical[t.tid]
        if i in written or logical.kind not in INPUT_KINDS:
            continue
        if t.parts != (0, 1, 1):
            raise EvaluationError(f"input {logical.name} is loaded as a partial sum")
        if t.tid not in full:
            full[t.tid] = torch.as_tensor(np.asarray(inputs(logical, seed), dtype=np.float64))
        piece = full[t.tid][tuple(slice(a, b) for a, b in t.slices)]
        if tuple(piece.shape) != tuple(t.shape):
            raise EvaluationError(f"input {logical.name} on rank {t.rank}: slices "
                                  f"{t.slices} are not of shape {t.shape}")
        values[i] = piece.clone()
    for node in plan.nodes:
        _check_memory(plan, node, values)
        args = [values[i] if i >= 0 else None for i in node.inputs]
        shapes = [plan.tensors[o].shape if o >= 0 else None for o in node.outputs]
        outs = run(node, args, shapes)
        if len(outs) != len(node.outputs):
            raise EvaluationError(f"{node.op} on rank {node.rank} makes {len(outs)} outputs, "
                                  f"the plan has {len(node.outputs)}")
        for o, v in zip(node.outputs, outs):
            if o < 0:
                continue
            if v is None or tuple(v.shape) != tuple(plan.tensors[o].shape):
                raise EvaluationError(f"{node.op} ({node.dir}, {node.name}) on rank {node.rank} "
                                      f"makes a wrong shape")
            values[o] = v.detach().to(torch.float64)
    return [None if v is None else v.numpy() for v in values]


def _check_memory(plan: Plan, node: Node, values: list) -> None:
    group = is_collective(node.op)
    for i in node.inputs:
        if i < 0:
            continue
        if values[i] is None:
            raise EvaluationError(f"{node.op} on rank {node.rank} reads a tensor never written")
        if not group and plan.tensors[i].rank != node.rank:
            raise EvaluationError(f"{node.op} on rank {node.rank} reads rank "
                                  f"{plan.tensors[i].rank}'s memory")
    for o in node.outputs:
        if o >= 0 and plan.tensors[o].rank != node.rank:
            raise EvaluationError(f"{node.op} on rank {node.rank} writes another rank's memory")
