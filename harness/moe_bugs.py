"""Wrong plans of a top-k mixture of experts, each a recipe passed to
``python -m backends.torch --hf FAMILY`` (``--recipe harness.moe_bugs:NAME``):
transformers' own data-parallel plan (``backends.torch.hf.tp_fsdp``) with one
fault on the first data-parallel rank, at the experts module every
transformers MoE family has (the module its ``base_model_ep_plan`` names
``layers.*.mlp.experts``); ``packed_as_colwise`` is a wrong tensor-parallel
plan on every rank instead. The backend never applies them; each must FAIL.
"""

from __future__ import annotations

import torch

from backends.torch.zoo.hf import _plan_with, distribute, tp_fsdp


def _experts(model) -> list[torch.nn.Module]:
    """Every module called with (hidden_states, top_k_index, top_k_weights)."""
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts")]


def _on_first_rank(model, mesh, hook) -> None:
    if mesh["dp"].get_local_rank() == 0:
        for experts in _experts(model):
            experts.register_forward_pre_hook(hook)


def token_to_other_expert(model, mesh):
    """On the first data-parallel rank, the first token's first choice is
    sent to another expert (one it did not choose): a dispatch that differs
    from the router's for one token."""
    after = tp_fsdp(model, mesh)

    def hook(module, args):
        hidden, index, weights = args
        index = index.clone()
        chosen = set(index[0].tolist())
        other = next(e for e in range(int(index.max()) + 2) if e not in chosen)
        index[0, 0] = other % max(int(index.max()) + 1, 2)
        if int(index[0, 0]) in chosen:
            index[0, 0] = next(e for e in range(64) if e not in chosen)
        return hidden, index, weights

    _on_first_rank(model, mesh, hook)
    return after


def combine_other_gate(model, mesh):
    """On the first data-parallel rank, the first two tokens' routing
    weights are swapped: each token's expert outputs are combined with the
    other token's gate."""
    after = tp_fsdp(model, mesh)

    def hook(module, args):
        hidden, index, weights = args
        order = torch.arange(weights.shape[0])
        order[0], order[1] = 1, 0
        return hidden, index, weights[order]

    _on_first_rank(model, mesh, hook)
    return after


def routed_to_other_token(model, mesh):
    """On the first data-parallel rank, the first two tokens' expert choices
    are swapped (each token dispatched with the other's routing, its own
    gate values kept): the routing of another token."""
    after = tp_fsdp(model, mesh)

    def hook(module, args):
        hidden, index, weights = args
        order = torch.arange(index.shape[0])
        order[0], order[1] = 1, 0
        return hidden, index[order], weights

    _on_first_rank(model, mesh, hook)
    return after


def gating_other_gate(model, mesh):
    """On the first data-parallel rank, the attention experts' top-k gating
    of JetMoE (an ``experts.router`` returning the sorted pairs, their
    tokens, their gates, the tokens per expert and the logits) hands the
    first two sorted pairs each other's gate: rows combined with another
    pair's weight."""
    after = tp_fsdp(model, mesh)

    def hook(module, args, out):
        pairs, tokens, gates, sizes, logits = out
        order = torch.arange(gates.shape[0])
        order[0], order[1] = 1, 0
        return pairs, tokens, gates[order], sizes, logits

    if mesh["dp"].get_local_rank() == 0:
        for name, module in model.named_modules():
            if name.endswith("experts.router") and type(module).__name__.endswith("TopKGating"):
                module.register_forward_hook(hook)
    return after


def titan_routed_to_other_token(model, mesh):
    """A torchtitan MoE model (DeepSeek-V3, Qwen3's MoE, gpt_oss, ...) under
    its family's own parallelize function (dp, ep 1) with, on the first
    data-parallel rank, the first two tokens' expert choices swapped
    before its routed experts run (each token dispatched with the other's
    experts, its own scores kept)."""
    from backends.torch.zoo.titan import parallelize
    after = parallelize(model, mesh)
    if mesh["dp"].get_local_rank() == 0:
        _swap_first_tokens(model)
    return after


def titan_scaled_bias_routed_to_other_token(model, mesh):
    """``titan_routed_to_other_token`` under gpt_oss's own TP plan with its
    rowwise linears' bias divided in the forward only
    (``backends.torch.zoo.titan_scaled_bias:parallelize``, right at dp 2
    tp 2): on both tensor-parallel ranks of the first data-parallel rank,
    the first two tokens' expert choices swapped."""
    from backends.torch.zoo.titan_scaled_bias import parallelize
    after = parallelize(model, mesh)
    if mesh["dp"].get_local_rank() == 0:
        _swap_first_tokens(model)
    return after


def titan_cp_routed_to_other_token(model, mesh):
    """``titan_routed_to_other_token`` under torchtitan's context
    parallelism (``titan:parallelize_cp``, ``--mesh cp=2``): on the last cp
    rank, its first two tokens' expert choices swapped."""
    from backends.torch.zoo.titan import parallelize_cp
    after = parallelize_cp(model, mesh)
    if mesh["cp"].get_local_rank() == mesh["cp"].size() - 1:
        _swap_first_tokens(model)
    return after


def titan_cp_grads_averaged_over_cp(model, mesh):
    """torchtitan issue 3280's mechanism under its context parallelism
    (``titan:parallelize_cp``, ``--mesh dp=2,cp=2``): the loss aggregated
    over two axes. Each rank's loss already divides by the whole step's
    label count, and FSDP2 (sharded over dp x cp) sums the gradients; here
    every FSDP module also divides them by the cp size, as if each cp rank
    held a replica's whole loss, so every gradient is 1/cp of the
    single-device one."""
    from torch.distributed.fsdp import FSDPModule

    from backends.torch.zoo.titan import parallelize_cp
    after = parallelize_cp(model, mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(mesh["cp"].size()))
    return after


def _swap_first_tokens(model) -> None:
    """Each routed-experts module of ``model`` called with its first two
    tokens' expert choices swapped (their scores kept)."""

    def swap(ids):
        flat = ids.reshape(-1, ids.shape[-1])
        order = torch.arange(flat.shape[0])
        order[0], order[1] = 1, 0
        return flat[order].reshape(ids.shape)

    def hook(module, args):
        x, scores, ids, counts = args
        return x, scores, _on_local(ids, swap), counts

    for module in _routed_experts(model):
        module.register_forward_pre_hook(hook)


def _routed_experts(model) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("moe.routed_experts")]


def _on_local(value, edit):
    """``edit`` applied to a value as this rank holds it: a DTensor's local
    values (torchtitan's routed experts under sequence parallelism are
    called with DTensors), wrapped again with its own placements."""
    from torch.distributed.tensor import DTensor
    if isinstance(value, DTensor):
        return DTensor.from_local(edit(value.to_local()), value.device_mesh, value.placements,
                                  shape=value.shape, stride=value.stride())
    return edit(value)


def titan_ep_wrong_split(model, mesh):
    """A torchtitan MoE model with expert parallelism (ep = dp, its family's
    own parallelize) where the first data-parallel rank counts one token of its last local expert's
    neighbour wrong: its per-expert counts move one token from the last
    expert of the first expert-parallel rank to the first of the next, so
    the split sizes of its all-to-all send that token's row to the other
    rank, where another expert computes it (a wrong split size)."""
    from backends.torch.zoo.titan import parallelize_ep
    after = parallelize_ep(model, mesh)
    ep = mesh["dp"].size()

    def move(counts):
        edge = counts.shape[0] // ep
        moved = counts.clone()
        last = int(torch.nonzero(moved[:edge]).max()) if bool((moved[:edge] > 0).any()) else None
        if last is not None:
            moved[last] -= 1
            moved[edge] += 1
        return moved

    def hook(module, args):
        x, scores, ids, counts = args
        return x, scores, ids, _on_local(counts, move)

    if mesh["dp"].get_local_rank() == 0:
        for module in _routed_experts(model):
            module.register_forward_pre_hook(hook)
    return after


def _fsdp_default_division(model, experts_factor: float | None = None) -> None:
    """FSDP2's default gradient division (the mean over each parameter
    group's own shard group: ``gradient_divide_factor`` None), the experts'
    groups (their weights are [experts, ...]) divided by ``experts_factor``
    when given."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            expert = any(len(p._orig_size) == 3 for p in group.fsdp_params)
            group.gradient_divide_factor = experts_factor if expert else None


def titan_ep_expert_grads_undivided(model, mesh):
    """pytorch issue 160285 as it shipped: a torchtitan MoE model with
    expert parallelism (ep = dp), each rank's loss the mean over its own
    tokens and FSDP2's default division, the mean over each module's shard
    group: the dense modules' group is dp, the experts' the expert-data-
    parallel group (dp / ep ranks, here 1), so the experts' gradients are
    ep times the single-device ones."""
    from backends.torch.zoo.titan import parallelize_ep
    after = parallelize_ep(model, mesh)
    model.global_tokens //= mesh["dp"].size()
    _fsdp_default_division(model.model)
    return after


def titan_ep_routed_to_other_token(model, mesh):
    """``titan_routed_to_other_token`` under expert parallelism (ep = dp):
    the first rank dispatches its first two tokens with each other's
    experts, so the all-to-all sends their rows to the other's experts."""
    from backends.torch.zoo.titan import parallelize_ep
    after = parallelize_ep(model, mesh)

    def swap(ids):
        flat = ids.reshape(-1, ids.shape[-1])
        order = torch.arange(flat.shape[0])
        order[0], order[1] = 1, 0
        return flat[order].reshape(ids.shape)

    def hook(module, args):
        x, scores, ids, counts = args
        return x, scores, _on_local(ids, swap), counts

    if mesh["dp"].get_local_rank() == 0:
        for module in _routed_experts(model):
            module.register_forward_pre_hook(hook)
    return after


def titan_ep_combine_other_gate(model, mesh):
    """A torchtitan MoE model with expert parallelism (ep = dp) where the
    first rank combines its first two tokens' expert outputs with each
    other's gates (their routing scores swapped, their experts kept)."""
    from backends.torch.zoo.titan import parallelize_ep
    after = parallelize_ep(model, mesh)

    def swap(scores):
        flat = scores.reshape(-1, scores.shape[-1])
        order = torch.arange(flat.shape[0])
        order[0], order[1] = 1, 0
        return flat[order].reshape(scores.shape)

    def hook(module, args):
        x, scores, ids, counts = args
        return x, _on_local(scores, swap), ids, counts

    if mesh["dp"].get_local_rank() == 0:
        for module in _routed_experts(model):
            module.register_forward_pre_hook(hook)
    return after


# -- transformers' own expert-parallel plan (``--hf FAMILY --ep N``) ----------

def _ep(model, mesh, hook=None):
    """transformers' expert-parallel plan (``backends.torch.hf.ep_fsdp``),
    with ``hook`` before the experts of the first data-parallel rank (the
    rows, expert ids and gates its dispatch reads)."""
    from backends.torch.zoo.hf import ep_fsdp
    after = ep_fsdp(model, mesh)
    if hook is not None:
        _on_first_rank(model, mesh, hook)
    return after


def ep_token_to_other_expert(model, mesh):
    """``token_to_other_expert`` under transformers' expert parallelism: the
    first rank's first token's first choice is dispatched to another
    expert (its row sent to that expert's rank)."""
    def hook(module, args):
        hidden, index, weights = args
        index = index.clone()
        chosen = set(index[0].tolist())
        index[0, 0] = next(e for e in range(int(index.max()) + 2) if e not in chosen)
        index[0, 0] = index[0, 0] % max(int(index.max()) + 1, 2)
        if int(index[0, 0]) in chosen:
            index[0, 0] = next(e for e in range(64) if e not in chosen)
        return hidden, index, weights
    return _ep(model, mesh, hook)


def ep_routed_to_other_token(model, mesh):
    """``routed_to_other_token`` under transformers' expert parallelism: the
    first rank dispatches its first two tokens with each other's experts."""
    def hook(module, args):
        hidden, index, weights = args
        order = torch.arange(index.shape[0])
        order[0], order[1] = 1, 0
        return hidden, index[order], weights
    return _ep(model, mesh, hook)


def ep_combine_other_gate(model, mesh):
    """``combine_other_gate`` under transformers' expert parallelism: the
    first rank weighs its first two tokens' expert outputs with each
    other's gates."""
    def hook(module, args):
        hidden, index, weights = args
        order = torch.arange(weights.shape[0])
        order[0], order[1] = 1, 0
        return hidden, index, weights[order]
    return _ep(model, mesh, hook)


def ep_wrong_split(model, mesh):
    """transformers' expert parallelism where the first rank counts one
    token of the first expert-parallel rank's last expert as the next
    rank's first expert's: its per-expert counts (the input of the count
    all-to-all, which the split sizes are summed from) move one token, so
    that token's row goes to the other rank, where another expert computes
    it (a wrong split size, both sides of the exchange consistent).

    The all-to-all transformers' dispatch calls is a global of its module:
    it is replaced only while an experts module of this rank runs, and
    restored after it, so nothing else in the process (another step, a
    later recipe) sees it, nor does a second call wrap it twice."""
    after = _ep(model, mesh)
    if mesh["dp"].get_local_rank() != 0:
        return after
    for experts in _experts(model):
        experts.forward = _with_moved_counts(experts.forward)
    return after


def _with_moved_counts(forward):
    """``forward`` run with transformers' dispatch all-to-all replaced by one
    that moves a token in the per-expert counts it sends (``ep_wrong_split``),
    the shipped one put back however ``forward`` ends."""
    import transformers.distributed.expert_parallel as ep_module

    def run(*args, **kwargs):
        shipped = ep_module.all_to_all_single

        def moved(output, counts, *rest, **options):
            if counts.dtype == torch.long and counts.dim() == 2 and counts.shape[0] > 1:
                last = int(torch.nonzero(counts[0]).max()) if bool((counts[0] > 0).any()) else None
                if last is not None:
                    counts[0, last] -= 1
                    counts[1, 0] += 1
            return shipped(output, counts, *rest, **options)

        ep_module.all_to_all_single = moved
        try:
            return forward(*args, **kwargs)
        finally:
            ep_module.all_to_all_single = shipped
    return run


def ep_expert_grads_undivided(model, mesh):
    """pytorch issue 160285 under transformers' expert parallelism (ep =
    dp): each rank's loss the mean over its own tokens and FSDP2's default
    division, the mean over each module's shard group: dp ranks for the
    dense modules, the expert-data-parallel group (one rank) for the
    experts, whose gradients are then ep times the single-device ones."""
    after = _ep(model, mesh)
    model.global_tokens //= mesh["dp"].size()
    _fsdp_default_division(model.hf)
    return after


def ep_fsdp_avg(model, mesh):
    """transformers' expert parallelism with FSDP's default divide factor
    (the mean over each module's shard group) and the loss shared out over
    the step: the dense gradients 1/dp of the single-device ones."""
    after = _ep(model, mesh)
    _fsdp_default_division(model.hf)
    return after


def skip_expert_with_tokens(model, mesh):
    """On the first data-parallel rank, the experts loop (transformers'
    eager loop over the experts hit, written again for the 3-dim
    ``gate_up_proj`` / ``down_proj`` layout) skips the last expert its
    tokens choose, which has tokens there: those tokens lose that
    expert's output. The rank's hit set is the true one, so the backend's
    run of skipped experts on no token (docs/soundness.md, "Plans traced
    from PyTorch", 88) must not fill this expert in: it has rows."""
    after = tp_fsdp(model, mesh)
    if mesh["dp"].get_local_rank() != 0:
        return after
    for experts in _experts(model):
        experts.forward = _skipping_forward(experts)
    return after


def _skipping_forward(experts: torch.nn.Module):
    """A forward of ``experts`` that skips the last expert its tokens choose."""
    import torch.nn.functional as F

    def forward(hidden, index, weights):
        skip = int(index.max())
        out = torch.zeros_like(hidden)
        with torch.no_grad():
            mask = F.one_hot(index, num_classes=experts.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for row in hit:
            e = int(row[0])
            if e in (skip, experts.num_experts):
                continue
            slot, token = torch.where(mask[e])
            gate, up = F.linear(hidden[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(experts.act_fn(gate) * up, experts.down_proj[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out
    return forward


def packed_as_colwise(model, mesh):
    """transformers' TP plan with the fused gate/up expert columns sharded
    by plain ``colwise`` instead of ``packed_colwise``: each rank holds one
    block of the fused dim, so with two tensor-parallel ranks rank 0 holds
    all of the gate columns and rank 1 all of the up columns, and the
    experts' ``chunk(2)`` of a rank's output splits its own block, not the
    gate and up halves (a classic mistake with fused projections). On
    every rank, not only the first."""
    return distribute(model, mesh, tp_plan=_plan_with(model, "packed_colwise", "colwise",
                                                      first_only=False))
