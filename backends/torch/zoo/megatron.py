"""Megatron-Core's training step, parallelized and run by Megatron itself.

    python -m backends.torch --model backends.torch.megatron:gpt \\
        --recipe backends.torch.megatron:tp_sp --dp 1 --tp 2

The model (``MegatronModel``) is a Megatron model provider and forward step
function as a Megatron user writes them (``GPTStep`` is the one for
Megatron's ``GPTModel`` with its local, non-TransformerEngine layer spec).
On one device it is the provider's model at tensor- and pipeline-parallel
size 1 (Megatron's ``parallel_state`` on a single rank: its collectives run
on groups of one rank), its forward the user's forward step on the whole
batch and its loss function.

In every rank's process a recipe (``Options``) initializes ``parallel_state``
on the backend's process group at the mesh's sizes (Megatron's rank order,
tensor-parallel fastest then data then pipeline, is the backend's mesh
order, checked), builds the rank's model chunks with the provider (Megatron
shards its layers at construction; a pipeline stage holds its layers), loads
into each parameter its piece of the single-device weights (the block its
``partition_dim`` names, as a checkpoint loader does), wraps each chunk in
Megatron's ``DistributedDataParallel`` and returns an ``OwnSchedule``: the
rank's step is Megatron's ``get_forward_backward_func()`` over the rank's
rows in ``microbatches`` microbatches, ending in ``finalize_model_grads``
(the data-parallel reduction, the sequence-parallel norms' all-reduce, the
tied embedding's all-reduce between the first and the last stage). The
final gradient of a parameter is its ``main_grad`` (what Megatron's
optimizer steps on); with the distributed optimizer, the blocks of
``main_grad`` its range map gives the rank (``optimizer_ranges``: what its
optimizer reads). Megatron's CPU adaptations (``megatron_shim``) are
applied and printed on every run.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from backends.torch.tracer.pipeline import OwnSchedule
from backends.torch.tracer.placements import strided_marker
from backends.torch.zoo import megatron_optim, megatron_shim

#: the seed of Megatron's RNG tracker (its dropout streams; dropout is 0 here)
TRACKER_SEED = 1234


@contextlib.contextmanager
def _cpu_rng_kept() -> Iterator[None]:
    """The CPU generator's state restored after: Megatron's seeding does not
    change the weights the backend's seed draws."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


def init_parallel_state(tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
                        etp: int | None = None) -> None:
    """Megatron's ``parallel_state`` at these sizes on the default process
    group (one of a single rank when none is initialized, as on one
    device), and its RNG tracker (``ep``, ``etp``: the experts' parallel
    sizes, ``etp`` None for Megatron's default, the tensor-parallel size)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # its gloo side groups (CPU copies of the data-parallel groups) are not built: under
    # the fake process group a gloo group cannot be created, and nothing traced uses them
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp,
                                             create_gloo_process_groups=False)
    with _cpu_rng_kept():
        model_parallel_cuda_manual_seed(TRACKER_SEED)


# -- the user's side: a model provider and a forward step -----------------------------

class GPTStep:
    """Megatron's ``GPTModel`` (local spec: learned positions, LayerNorm, fused
    QKV ``ColumnParallelLinear``, ``RowParallelLinear``, GELU MLP, a
    ``VocabParallelEmbedding`` tied to the output layer, the
    vocabulary-parallel cross-entropy, dropout 0) and the forward step of
    Megatron's GPT pretraining: per-token losses, their mean over the
    microbatch's tokens."""

    def __init__(self, sizes: dict[str, int], mtp: bool = False, mtp_mask_below: int | None = None,
                 per_token_loss: bool = False):
        self.sizes = sizes
        #: Megatron's ``calculate_per_token_loss``: the loss function returns the
        #: loss summed over the microbatch's kept tokens with their count, the
        #: MTP loss is summed too, and ``finalize_model_grads`` divides every
        #: gradient by the count all-reduced over the data-parallel ranks
        self.per_token_loss = per_token_loss
        #: Megatron's multi-token prediction block (one layer, its local spec)
        self.mtp = mtp
        #: the loss mask the model's MTP loss reads: the labels below this id
        #: (None: every token, GPTModel's default)
        self.mtp_mask_below = mtp_mask_below

    def config(self, **parallel: Any):
        """The ``TransformerConfig`` (``parallel``: its parallelism fields)."""
        from megatron.core.transformer import TransformerConfig
        s = self.sizes
        return TransformerConfig(
            num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
            ffn_hidden_size=s["ffn"], hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, params_dtype=torch.float32,
            mtp_num_layers=1 if self.mtp else None,
            calculate_per_token_loss=self.per_token_loss, **parallel)

    def model_provider(self, config, pre_process: bool = True, post_process: bool = True,
                       vp_stage: int | None = None) -> nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_mtp_block_spec,
        )
        spec = get_gpt_layer_local_spec()
        mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False,
                                     vp_stage=vp_stage) if self.mtp else None
        return GPTModel(config, spec, vocab_size=self.sizes["vocab"],
                        max_sequence_length=self.sizes["seqlen"], pre_process=pre_process,
                        post_process=post_process, share_embeddings_and_output_weights=True,
                        mtp_block_spec=mtp, vp_stage=vp_stage)

    #: a shipped mistake of the loss function (None: Megatron's GPT pretraining's)
    loss_bug: str | None = None
    #: the step's microbatches per rank (set by the recipe)
    microbatches: int = 1

    def forward_step(self, data_iterator: Iterator, model: nn.Module):
        batch = next(data_iterator)
        mask = None
        if self.mtp_mask_below is not None:
            mask = (batch["labels"] < self.mtp_mask_below).to(torch.float64)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       loss_mask=mask)

        if self.per_token_loss:
            return losses, functools.partial(_per_token_loss, mask)

        def loss_func(per_token: torch.Tensor):
            loss = per_token.sum() / per_token.numel()
            if self.loss_bug == "over_microbatches":  # divided again by the schedule
                loss = loss / self.microbatches
            elif self.loss_bug == "global_mean":  # a global mean, averaged again by DDP
                from megatron.core import parallel_state
                loss = loss / parallel_state.get_data_parallel_world_size()
            return loss, {"lm loss": loss.detach()}
        return losses, loss_func


def _per_token_loss(mask: torch.Tensor | None, per_token: torch.Tensor):
    """The loss function of Megatron's GPT pretraining with
    ``calculate_per_token_loss``: the per-token losses summed over the kept
    tokens, and the count of kept tokens (an integer tensor) the schedule
    adds up over microbatches for ``finalize_model_grads``."""
    mask = torch.ones_like(per_token) if mask is None else mask.to(per_token.dtype)
    loss = (per_token.view(-1) * mask.view(-1)).sum()
    count = mask.sum().detach().to(torch.int)
    return loss, count, {"lm loss": loss.detach()}


class MoEGPTStep(GPTStep):
    """``GPTStep`` with a mixture of experts in place of every layer's MLP
    (Megatron's local MoE spec: its ``TopKRouter`` (softmax scores, top-k),
    the all-to-all token dispatcher, a ``SequentialMLP`` of ``experts``
    experts, each a local ``MLP``: the grouped GEMMs need CUDA), top-2
    routing, no auxiliary loss (Megatron's default coefficient 0), and no
    linear biases (``add_bias_linear=False``, as Megatron's MoE recipes
    run: with biases the local expert MLP adds its bias in place into the
    output of a tensor-parallel reduction, which autograd refuses)."""

    experts = 4
    topk = 2

    def config(self, **parallel: Any):
        return super().config(num_moe_experts=self.experts, moe_router_topk=self.topk,
                              moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                              moe_ffn_hidden_size=self.sizes["ffn"], add_bias_linear=False,
                              **parallel)

    def model_provider(self, config, pre_process: bool = True, post_process: bool = True,
                       vp_stage: int | None = None) -> nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        spec = get_gpt_layer_local_spec(num_experts=self.experts, moe_grouped_gemm=False)
        return GPTModel(config, spec, vocab_size=self.sizes["vocab"],
                        max_sequence_length=self.sizes["seqlen"], pre_process=pre_process,
                        post_process=post_process, share_embeddings_and_output_weights=True,
                        vp_stage=vp_stage)


def batch_of(tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """A microbatch as Megatron's GPT data loaders give it (one row of
    positions, broadcast over the rows by the embedding's addition)."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    return {"tokens": tokens, "labels": labels, "position_ids": positions}


class MegatronModel(nn.Module):
    """A user's Megatron step (``user``: ``config(**parallel)``,
    ``model_provider(config, pre_process, post_process, vp_stage)`` and
    ``forward_step(data_iterator, model)``) as the backend's model: on one
    device the provider's model, ``forward(tokens, labels)`` the forward
    step's loss on the whole batch; after a recipe, the rank's chunks, its
    parameters named as the single-device model's."""

    def __init__(self, user: Any):
        super().__init__()
        self.user = user
        self.model = user.model_provider(user.config())
        self.global_tokens = 1  # set by the backend (unused: the loss function is the user's)
        self.sequence_first = True  # Megatron's activations are [s, b, h]
        self.chunks: nn.ModuleList | None = None
        self.names: dict[int, str] = {}
        self._hooks: list = []

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
        # the MTP loss's backward scale Megatron's schedule sets for one microbatch
        MTPLossAutoScaler.set_loss_scale(torch.ones(1))
        output, loss_func = self.user.forward_step(iter([batch_of(tokens, labels)]), self.model)
        returned = loss_func(output)
        if len(returned) == 3:  # calculate_per_token_loss: a sum and its token count
            self._divide_gradients(returned[1])
        return returned[0]

    def _divide_gradients(self, count: torch.Tensor) -> None:
        """Megatron's step at one rank with ``calculate_per_token_loss``: the
        backward of the summed losses, then every parameter's gradient
        divided by the step's token count (``finalize_model_grads``), here as
        each parameter's gradient hook (its whole gradient, once)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = [p.register_hook(lambda g: g / count) for p in self.model.parameters()]

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        if self.chunks is None:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        # at pipeline size > 1 with multi-token prediction the last stage holds
        # the embedding (its MTP block's) and an output layer weight it never
        # reads (the output layer reads the embedding's weight): both take the
        # tied weight's name, the first (the one the step reads) is kept
        seen: set[str] = set()
        for chunk in self.chunks:
            for p in chunk.parameters():
                name = self.names[id(p)]
                if name not in seen:
                    seen.add(name)
                    yield name, p


    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):
        if self.chunks is None:
            yield from super().named_buffers(prefix, recurse, remove_duplicate)
            return
        for chunk in self.chunks:  # the single-device model's names (``global_names``)
            for b in chunk.buffers():
                yield self.names[id(b)], b


def user_model(user: Any) -> MegatronModel:
    """A user's Megatron step (an object with ``config(**parallel)``,
    ``model_provider(config, pre_process, post_process, vp_stage)`` and
    ``forward_step(data_iterator, model)``) as the backend's model: the CPU
    shim applied, ``parallel_state`` on one rank, the provider's model
    built (docs/torch-backend.md, "Megatron-Core")."""
    megatron_shim.apply()
    init_parallel_state()
    return MegatronModel(user)


def gpt(**sizes: int) -> MegatronModel:
    """Megatron's GPTModel at the size flags (``layers``, ``hidden``, ``heads``,
    ``ffn``, ``vocab``, ``seqlen``) with GPT pretraining's forward step."""
    return user_model(GPTStep(sizes))


def gpt_mtp(**sizes: int) -> MegatronModel:
    """``gpt`` with Megatron's multi-token prediction block (``mtp_num_layers=1``):
    GPTModel adds the MTP loss (its labels rolled by one position, the last
    masked) to the gradients through its ``MTPLossAutoScaler``."""
    return user_model(GPTStep(sizes, mtp=True))


def gpt_mtp_masked(**sizes: int) -> MegatronModel:
    """``gpt_mtp`` with a loss mask (the labels below half the vocabulary) the
    MTP loss reads: GPTModel divides each rank's MTP loss by the rank's own
    count of kept tokens (Megatron-LM issue 7452)."""
    return user_model(GPTStep(sizes, mtp=True, mtp_mask_below=sizes["vocab"] // 2))


def gpt_mtp_per_token(**sizes: int) -> MegatronModel:
    """``gpt_mtp_masked`` with the fix of Megatron-LM issue 7452
    (``calculate_per_token_loss=True``): the main and the MTP loss summed
    over the kept tokens, the microbatches' counts added up by the schedule,
    all-reduced over the data-parallel ranks in ``finalize_model_grads``,
    which divides every gradient by that total."""
    return user_model(GPTStep(sizes, mtp=True, mtp_mask_below=sizes["vocab"] // 2,
                              per_token_loss=True))


def moe_gpt(**sizes: int) -> MegatronModel:
    """``gpt`` with a mixture of four experts, top-2 routed, in every layer
    (``MoEGPTStep``); ``ffn`` is each expert's hidden size."""
    return user_model(MoEGPTStep(sizes))


# -- the recipe: Megatron's parallelism, its schedule, DDP and finalize ------------

@dataclasses.dataclass(frozen=True)
class Options:
    """How Megatron parallelizes and runs the step (its own configuration
    fields where it has them)."""
    sequence_parallel: bool = False
    microbatches: int = 1
    virtual_pp: int | None = None
    batch_p2p_comm: bool = True
    overlap_grad_reduce: bool = False
    average_in_collective: bool = False
    use_distributed_optimizer: bool = False
    #: DDP's ``bucket_size`` in elements (None: Megatron's default, one bucket
    #: per chunk unless overlapping or the distributed optimizer)
    bucket_size: int | None = None
    #: the experts' parallel sizes (``expert_model_parallel_size``,
    #: ``expert_tensor_parallel_size``; None: Megatron's default, the
    #: tensor-parallel size)
    ep: int = 1
    etp: int | None = None
    #: Megatron-LM PR 5916's fix of the expert topology, applied to the
    #: installed 0.16.1 (which ships without it): an expert's parameters are
    #: marked ``allreduce=False`` (reduced over the expert-data-parallel
    #: group) whenever the experts' layout differs from the dense one
    #: (``ep > 1`` or ``etp`` other than the tensor-parallel size), not only
    #: when ``ep > 1``
    expert_topology_fix: bool = False
    #: shipped mistakes, each on Megatron's own code path (docs/torch-backend.md)
    bug: str | None = None


def global_names(chunk: nn.Module, ep_rank: int = 0) -> dict[str, str]:
    """A chunk's parameter (and buffer) names as the single-device model's: a stage's
    layer ``i`` is global layer ``layer_number - 1``; a last stage's output
    weight tied to the embedding is the embedding's; local expert ``i`` of
    expert-parallel rank ``ep_rank`` is expert ``ep_rank * local + i`` (the
    experts Megatron gives the rank)."""
    layers = {}
    local = {}
    for name, module in chunk.named_modules():
        if hasattr(module, "local_experts"):
            local[name] = len(module.local_experts)
    decoder = getattr(chunk, "decoder", None)
    for i, layer in enumerate(getattr(decoder, "layers", [])):
        layers[str(i)] = str(layer.layer_number - 1)
    out = {}
    for name in [n for n, _ in chunk.named_parameters()] + [n for n, _ in chunk.named_buffers()]:
        g = re.sub(r"^(.*)\.local_experts\.(\d+)\.",
                   lambda m: f"{m[1]}.local_experts.{ep_rank * local[m[1]] + int(m[2])}.", name)
        g = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{layers[m[1]]}.", g)
        if g == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights",
                                                  False):
            g = "embedding.word_embeddings.weight"
        out[name] = "model." + g
    return out


def load_pieces(full: dict[str, torch.Tensor], chunk: nn.Module, names: dict[str, str],
                tp_rank: int, tp: int, etp_rank: int = 0, etp: int = 1) -> None:
    """Each of the chunk's parameters set to its piece of the single-device
    weight of its global name: the ``tp_rank``-th of ``tp`` equal blocks along
    its ``partition_dim`` for a tensor-parallel one (its ``mesh_axes`` then
    say so; an expert's: the ``etp_rank``-th of ``etp``, Megatron's expert
    tensor parallelism, whose group must then be the tensor-parallel one),
    the whole otherwise."""
    with torch.no_grad():
        for name, p in chunk.named_parameters():
            whole = full[names[name]]
            expert = ".local_experts." in name
            n, at = (etp, etp_rank) if expert else (tp, tp_rank)
            if getattr(p, "tensor_model_parallel", False) and n > 1:
                if n != tp:
                    raise ValueError(f"Megatron's expert tensor-parallel size {n} is neither 1 nor "
                                     f"the tensor-parallel size {tp}: not supported")
                stride = getattr(p, "partition_stride", 1)
                # Megatron's strided partition (a gated MLP's fused linear_fc1): the
                # dim read as `stride` equal parts, the rank's block of each, side by
                # side (docs/soundness.md, "Plans traced from PyTorch", 87, 108 (e))
                whole = torch.cat([part.chunk(n, dim=p.partition_dim)[at]
                                   for part in whole.chunk(stride, dim=p.partition_dim)],
                                  dim=p.partition_dim)
                axes: list[list[str]] = [[] for _ in range(p.dim())]
                axes[p.partition_dim] += [strided_marker(stride)] if stride > 1 else []
                axes[p.partition_dim].append("tp")
                p.mesh_axes = axes
            p.data = whole.detach().clone()


def load_buffers(full: dict[str, torch.Tensor], chunk: nn.Module, names: dict[str, str]) -> None:
    """Each of the chunk's buffers (rotary positions' ``inv_freq``) set to the
    single-device model's buffer of its global name, whole: a chunk built by
    the provider computes its constants in Megatron's dtype, the single-device
    model holds them in the dtype the backend runs in (float64), and both
    steps must read the same numbers."""
    for name, b in chunk.named_buffers():
        whole = full.get(names[name])
        if whole is None or whole.shape != b.shape:
            raise ValueError(f"the chunk's buffer {name} ({names[name]}, {list(b.shape)}) is no "
                             "buffer of the single-device model's of that shape")
        b.data = whole.detach().clone()


def _check_rank_order(mesh) -> None:
    from megatron.core import parallel_state as ps
    mine = (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(),
            ps.get_tensor_model_parallel_rank())
    mesh_coords = tuple(mesh[n].get_local_rank() for n in ("pp", "dp", "tp"))
    if mine != mesh_coords:
        raise ValueError(f"Megatron's (pp, dp, tp) coordinates {mine} are not the mesh's "
                         f"{mesh_coords}")


def parallelize(model: MegatronModel, mesh, options: Options) -> OwnSchedule:
    """Megatron's parallelism of ``model`` on the mesh (docstring of the module)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    tp, pp = mesh["tp"].size(), mesh["pp"].size()
    vpp = options.virtual_pp
    if options.sequence_parallel and tp == 1:
        raise ValueError("Megatron sequence parallelism needs --tp 2 or more")
    if vpp is not None and pp == 1:
        raise ValueError("Megatron's interleaved schedule needs --pp 2 or more")
    init_parallel_state(tp, pp, vpp, options.ep, options.etp)
    _check_rank_order(mesh)
    user = model.user
    if isinstance(user, GPTStep):
        user.microbatches = options.microbatches
        if options.bug in ("over_microbatches", "global_mean"):
            user.loss_bug = options.bug
    parallel = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                "sequence_parallel": options.sequence_parallel,
                "batch_p2p_comm": options.batch_p2p_comm}
    if options.ep > 1 or options.etp is not None:
        parallel["expert_model_parallel_size"] = options.ep
        parallel["expert_tensor_parallel_size"] = options.etp or tp
    if pp > 1:
        parallel["pipeline_dtype"] = torch.float64  # what the backend runs in
    if vpp is not None:
        parallel["virtual_pipeline_model_parallel_size"] = vpp
    config = user.config(**parallel)
    full = {n: p for n, p in nn.Module.named_parameters(model)}
    full_buffers = dict(nn.Module.named_buffers(model))
    chunks = []
    for stage in range(vpp or 1):
        vp = stage if vpp is not None else None
        chunk = user.model_provider(config, ps.is_pipeline_first_stage(ignore_virtual=False,
                                                                      vp_stage=vp),
                                    ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                                    vp_stage=vp)
        names = global_names(chunk, ps.get_expert_model_parallel_rank())
        load_pieces(full, chunk, names, ps.get_tensor_model_parallel_rank(), tp,
                    ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
        load_buffers(full_buffers, chunk, names)
        model.names.update({id(p): names[n] for n, p in chunk.named_parameters()})
        model.names.update({id(b): names[n] for n, b in chunk.named_buffers()})
        chunks.append(chunk)
    if options.bug == "sp_norm_unmarked":
        for chunk in chunks:  # 1446: a norm without the flag finalize_model_grads reads
            for name, p in chunk.named_parameters():
                if "layernorm" in name and hasattr(p, "sequence_parallel"):
                    del p.sequence_parallel
    if options.bug == "experts_sorted_wrong":
        # the received rows sorted into the local experts' blocks in the reverse
        # order: each local expert runs on rows the routing sent another
        for chunk in chunks:
            for module in chunk.modules():
                dispatcher = getattr(module, "token_dispatcher", None)
                if dispatcher is not None and hasattr(dispatcher, "sort_input_by_local_experts"):
                    dispatcher.sort_input_by_local_experts = \
                        dispatcher.sort_input_by_local_experts.flip(0)
    if options.bug == "experts_reduced_over_dp":
        # each rank's own experts' gradients summed with the other ranks' (other
        # experts') over the dense data-parallel group
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if ".local_experts." in name:
                    p.allreduce = True
    if options.expert_topology_fix and (options.ep > 1 or (options.etp or tp) != tp):
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if ".local_experts." in name:
                    p.allreduce = False
    del model.model
    model.chunks = nn.ModuleList(chunks)
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=options.overlap_grad_reduce,
        use_distributed_optimizer=options.use_distributed_optimizer,
        average_in_collective=options.average_in_collective, bucket_size=options.bucket_size)
    with _cpu_rng_kept():
        wrapped = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    for w in wrapped:
        w.zero_grad_buffer()
    if options.bug == "wrong_group":  # the buckets reduced over the tensor-parallel group
        for w in wrapped:
            for group in w.bucket_groups:
                group.data_parallel_group = ps.get_tensor_model_parallel_group()
                # the distributed optimizer's reduce-scatter runs over this one
                group.intra_distributed_optimizer_instance_group = \
                    ps.get_tensor_model_parallel_group()
    config.finalize_model_grads_func = finalize.finalize_model_grads
    if options.bug == "tied_embedding_not_reduced":
        config.finalize_model_grads_func = _without_embedding_all_reduce
    if options.bug == "token_count_over_tp":
        config.finalize_model_grads_func = _token_count_over_tp
    if options.bug == "mtp_positions_reduced":
        config.finalize_model_grads_func = _mtp_positions_reduced
    if options.overlap_grad_reduce:
        config.no_sync_func = [w.no_sync for w in wrapped] if vpp else wrapped[0].no_sync
        config.grad_sync_func = [w.start_grad_sync for w in wrapped] if vpp \
            else wrapped[0].start_grad_sync
    run = functools.partial(megatron_step, model, wrapped, config, options, padding_views(wrapped))
    shift = 1 if options.bug == "range_shifted" else 0
    after = _optimizer_ranges(wrapped, shift) if options.use_distributed_optimizer \
        else _main_grads(wrapped)
    model.own_optimizer = functools.partial(megatron_optim.megatron_step, wrapped,
                                            distributed=options.use_distributed_optimizer,
                                            bug=options.bug)
    return OwnSchedule(run, after_backward=after, microbatches=options.microbatches)


def _without_embedding_all_reduce(model: list, *args: Any, **kwargs: Any) -> None:
    """``finalize_model_grads`` with its all-reduce of the tied embedding's
    gradient between the first and the last stage left out."""
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    kept = finalize._allreduce_word_embedding_grads
    finalize._allreduce_word_embedding_grads = lambda *a, **k: None
    try:
        finalize.finalize_model_grads(model, *args, **kwargs)
    finally:
        finalize._allreduce_word_embedding_grads = kept


def _mtp_positions_reduced(model: list, *args: Any, **kwargs: Any) -> None:
    """``finalize_model_grads`` after the position embeddings' gradients of
    the first stage and of the MTP block on the last stage are all-reduced
    over the embedding group (the two stages), as the tied word embeddings'
    are: a fix written here for the MTP block at pipeline size > 1, whose
    position embeddings 0.16.1 never reduces with the first stage's (its
    position-embedding group is the first stage alone)."""
    from megatron.core import parallel_state as ps
    group = ps.get_embedding_group(check_initialized=False)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        chunk = model[0] if ps.is_pipeline_first_stage(ignore_virtual=True) else model[-1]
        embedding = getattr(chunk.module, "embedding", None)
        if embedding is not None:
            torch.distributed.all_reduce(embedding.position_embeddings.weight.main_grad,
                                         group=group)
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    finalize.finalize_model_grads(model, *args, **kwargs)


def _token_count_over_tp(model: list, num_tokens: Any = None, pg_collection: Any = None,
                         **kwargs: Any) -> None:
    """``finalize_model_grads`` with the token count all-reduced over the
    tensor-parallel group, not the data-parallel one (at tp 1 each rank
    divides its gradients by its own count); DDP's buckets still reduce
    over their own groups."""
    from megatron.core import parallel_state as ps
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    groups = copy.copy(pg_collection)
    groups.dp_cp = ps.get_tensor_model_parallel_group()
    finalize.finalize_model_grads(model, num_tokens, pg_collection=groups, **kwargs)


def _main_grads(wrapped: list) -> Callable:
    """After the step: each parameter's gradient is its ``main_grad`` (what
    Megatron's optimizer reads)."""
    def after(model: nn.Module, mesh) -> None:
        for w in wrapped:
            for p in w.module.parameters():
                p.grad = p.main_grad
    return after


def optimizer_ranges(wrapped: list, shift: int = 0) -> dict[int, list[tuple[int, int]]]:
    """For each parameter (by id), the flat ranges [start, end) of its
    gradient, flattened, that this rank's distributed optimizer reads: its
    ``param_range_map`` entries' ``"param"`` ranges, as Megatron's
    ``DistributedOptimizer`` builds them from each DDP buffer's buckets
    (``_build_gbuf_range_map``: the rank's equal share of each bucket); no
    entry for a parameter of which the rank's shares hold no element.
    ``shift``: a wrong plan's, the map of the data-parallel rank ``shift``
    further on."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    out: dict[int, list[tuple[int, int]]] = {}
    for w in wrapped:
        for buffer in [*w.buffers, *w.expert_parallel_buffers]:
            group = buffer.data_parallel_group
            if shift:
                buffer.data_parallel_group = megatron_optim.ShiftedRank(group, shift)
            try:
                maps = DistributedOptimizer._build_gbuf_range_map(buffer)
            finally:
                buffer.data_parallel_group = group
            for per_bucket in maps.values():
                for data in per_bucket:
                    for param, ranges in data["param_map"].items():
                        r = ranges["param"]
                        out.setdefault(id(param), []).append((r.start, r.end))
    return out


def _optimizer_ranges(wrapped: list, shift: int = 0) -> Callable:
    """After the step, with the distributed optimizer: each parameter's final
    gradient is the blocks of its ``main_grad`` its flat ranges make
    (``optimizer_ranges``; ``flat_ranges.flat_blocks``), what the rank's
    optimizer reads (``main_grad.view(-1)[start:end]`` in its
    ``_copy_model_grads_to_main_grads``), none where its ranges hold none
    of it; the rest of ``main_grad`` is no gradient the rank ends with."""
    from backends.torch.lowering.flat_ranges import flat_blocks

    def after(model: nn.Module, mesh) -> None:
        ranges = optimizer_ranges(wrapped, shift)
        for w in wrapped:
            for p in w.module.parameters():
                blocks = [b for start, end in ranges.get(id(p), [])
                          for b in flat_blocks(tuple(p.shape), start, end)]
                p.grad = None
                p.grad_blocks = (p.main_grad, blocks)
                p.grad_ranges = list(ranges.get(id(p), []))
    return after


class _Microbatches:
    """The recorder's microbatch id while Megatron's schedule runs: its
    ``forward_step`` and ``backward_step`` wrapped (for the duration of the
    step) to report the microbatch of each chunk's call, in the order each
    chunk's forwards and backwards run (first in, first out, as every
    schedule of Megatron's does)."""

    def __init__(self, set_mb: Callable[[int], None], chunks: list):
        self.set_mb = set_mb
        self.chunks = chunks
        self.started = [0] * len(chunks)
        self.pending: list[tuple[Any, int]] = []  # (output tensor, microbatch)
        self.losses: list[torch.Tensor] = []

    def forward(self, original: Callable) -> Callable:
        def wrapped(forward_step_func, data_iterator, model, *args, **kwargs):
            chunk = next(i for i, c in enumerate(self.chunks) if c is model)
            mb = self.started[chunk]
            self.started[chunk] += 1
            self.set_mb(mb)
            out = original(forward_step_func, data_iterator, model, *args, **kwargs)
            self.pending.append((out[0], mb))
            return out
        return wrapped

    def backward(self, original: Callable) -> Callable:
        def wrapped(input_tensor, output_tensor, output_tensor_grad, *args, **kwargs):
            hit = next((k for k, (t, _) in enumerate(self.pending) if t is output_tensor), None)
            if hit is None:
                raise ValueError("Megatron's schedule ran a backward of an output it did not "
                                 "forward")
            out, mb = self.pending.pop(hit)
            self.set_mb(mb)
            if output_tensor_grad is None or output_tensor_grad == [None]:
                self.losses.append(out[0] if isinstance(out, list) else out)
            return original(input_tensor, output_tensor, output_tensor_grad, *args, **kwargs)
        return wrapped


def _sends_first(batch_isend_irecv: Callable) -> Callable:
    """``batch_isend_irecv`` with a batch's sends posted before its receives
    (each kind in its own order). The ops of a batch run concurrently and a
    receive from a peer matches that peer's sends to it in the order both
    were posted, so the messages are the same; the trace, read in program
    order, then has every send of a batch before the receives that may
    wait for the peer's (docs/soundness.md, "Plans traced from PyTorch")."""
    def batch(ops: list) -> list:
        sends = [op for op in ops if op.op in (dist.isend, dist.send)]
        return batch_isend_irecv(sends + [op for op in ops if op not in sends])
    return batch


def padding_views(wrapped: list) -> list[torch.Tensor]:
    """Views of the ranges of Megatron's grad buffers no parameter's
    gradient occupies (the padding the distributed optimizer adds after
    parameters and buckets; none without it), made before the step as the
    parameters' ``main_grad`` views are: with them the step zeroes the
    whole buffer, as Megatron's ``zero_grad_buffer`` does."""
    views = []
    for w in wrapped:
        for buffer in w.buffers:
            taken = sorted((start, end) for start, end, _ in buffer.param_index_map.values())
            at = 0
            for start, end in taken + [(buffer.grad_data.numel(),) * 2]:
                if start > at:
                    views.append(buffer.grad_data[at:start])
                at = max(at, end)
    return views


def megatron_step(model: MegatronModel, wrapped: list, config, options: Options,
                  padding: list[torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor,
                  set_mb: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """The rank's step through Megatron's ``get_forward_backward_func()`` on
    its rows in ``options.microbatches`` microbatches; the loss tensors
    backward ran from (the last stage's)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    n = options.microbatches
    if tokens.shape[0] % n:
        raise ValueError(f"{tokens.shape[0]} rows per data-parallel rank do not split into "
                         f"{n} microbatches")
    from megatron.core import parallel_state as ps
    if tokens.shape[0] // n < 2 and n * ps.get_data_parallel_world_size() > 1:
        # a one-row microbatch of a one-row batch (dp 1, one microbatch) has the
        # single-device step's shapes, and verifies
        raise ValueError("a Megatron microbatch of one row out of a batch of several is not "
                         "traced (its [s, 1, h] views lower unlike the single-device step's): "
                         f"give --batch at least 2 x dp x {n}")
    batches = [batch_of(t, lab) for t, lab in zip(tokens.chunk(n), labels.chunk(n))]
    iterators = [iter(batches) for _ in wrapped]
    for w in wrapped:  # Megatron's zero_grad_buffer, one parameter's view at a time
        for p in w.module.parameters():
            p.main_grad.zero_()
    for view in padding:  # and the padding after them (the distributed optimizer's)
        view.zero_()
    track = _Microbatches(set_mb or (lambda mb: None), wrapped)
    kept = schedules.forward_step, schedules.backward_step
    schedules.forward_step = track.forward(kept[0])
    schedules.backward_step = track.backward(kept[1])
    batched = dist.batch_isend_irecv
    buffers = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
    scatter = buffers.dist_reduce_scatter_func
    if options.bug == "reduce_scatter_skipped":  # each rank's range keeps its local gradients
        buffers.dist_reduce_scatter_func = lambda *args, **kwargs: None
    if set_mb is not None:  # traced (a real run, scripts/gloo_truth.py, posts them as Megatron)
        dist.batch_isend_irecv = _sends_first(batched)
    try:
        get_forward_backward_func()(
            forward_step_func=model.user.forward_step,
            data_iterator=iterators if len(wrapped) > 1 else iterators[0],
            model=wrapped if len(wrapped) > 1 else wrapped[0], num_microbatches=n,
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0] // n,
            forward_only=False)
    finally:
        schedules.forward_step, schedules.backward_step = kept
        dist.batch_isend_irecv = batched
        buffers.dist_reduce_scatter_func = scatter
        track.set_mb(-1)
    return track.losses


# -- recipes -------------------------------------------------------------------------

def recipe(**fields: Any) -> Callable:
    options = Options(**fields)

    def apply(model: MegatronModel, mesh) -> OwnSchedule:
        return parallelize(model, mesh, options)
    apply.__doc__ = f"Megatron's parallelism with {options}."
    return apply


tp = recipe()
tp_sp = recipe(sequence_parallel=True)
ddp = recipe(microbatches=2)
pp_1f1b = recipe(microbatches=2)
pp_interleaved = recipe(microbatches=4, virtual_pp=2)
pp_interleaved_unbatched = recipe(microbatches=4, virtual_pp=2, batch_p2p_comm=False)
ddp_overlap = recipe(microbatches=2, overlap_grad_reduce=True)
ddp_average = recipe(microbatches=2, average_in_collective=True)
dist_opt = recipe(microbatches=2, use_distributed_optimizer=True)
dist_opt_overlap = recipe(microbatches=2, use_distributed_optimizer=True,
                          overlap_grad_reduce=True)
full = recipe(sequence_parallel=True, microbatches=2)
# shipped mistakes
tp_sp_norm_unmarked = recipe(sequence_parallel=True, bug="sp_norm_unmarked")
pp_tied_embedding_not_reduced = recipe(microbatches=2, bug="tied_embedding_not_reduced")
loss_over_microbatches = recipe(microbatches=2, bug="over_microbatches")
loss_global_mean = recipe(microbatches=2, bug="global_mean")
ddp_average_global_mean = recipe(microbatches=2, average_in_collective=True, bug="global_mean")
ddp_wrong_group = recipe(microbatches=2, bug="wrong_group")
# Megatron-LM issue 7452's fix (gpt_mtp_per_token) with its token count all-reduced over the
# tensor-parallel group instead of the data-parallel one: each rank's own count at tp 1
tp_token_count_over_tp = recipe(bug="token_count_over_tp")
# a fix for the MTP block at pp > 1: its position embeddings' gradient all-reduced with the
# first stage's over the embedding group (0.16.1 reduces the first stage's alone)
pp_1f1b_mtp_positions_reduced = recipe(microbatches=2, bug="mtp_positions_reduced")
# wrong optimizer steps (--optimizer): Megatron's learning rate multiplied by the dp size
# (refused: an update no single-device step computes); the tensor-parallel duplicates
# (norms, row-parallel biases) stepped on tp rank 0 only, the other ranks keep them stale
ddp_lr_times_dp = recipe(microbatches=2, bug="lr_times_dp")
# a correct step with the same numbers scaled (SGD: lr x dp, weight decay and gradients / dp)
ddp_lr_times_dp_compensated = recipe(microbatches=2, bug="lr_times_dp_compensated")
ddp_duplicates_on_tp_rank0 = recipe(microbatches=2, bug="duplicates_on_tp_rank0")
# the distributed optimizer's wrong plans: each rank reads the next rank's range of every
# bucket; the reduce-scatter left out (each range keeps the rank's local gradients); the
# buckets reduce-scattered over the tensor-parallel group (dp 2 tp 2)
dist_opt_range_shifted = recipe(microbatches=2, use_distributed_optimizer=True, bug="range_shifted")
dist_opt_not_reduced = recipe(microbatches=2, use_distributed_optimizer=True,
                              bug="reduce_scatter_skipped")
dist_opt_wrong_group = recipe(microbatches=2, use_distributed_optimizer=True, bug="wrong_group")
# the distributed optimizer's wrong steps (--optimizer): the all-gather of the updated ranges
# left out (each rank keeps the others' ranges as loaded); each rank all-gathering the next
# rank's range of its buffer (stale there); each rank stepping the next rank's ranges
dist_opt_gather_skipped = recipe(microbatches=2, use_distributed_optimizer=True,
                                 bug="param_gather_skipped")
dist_opt_gather_wrong_shard = recipe(microbatches=2, use_distributed_optimizer=True,
                                     bug="param_gather_wrong_shard")
dist_opt_step_shifted = recipe(microbatches=2, use_distributed_optimizer=True, bug="step_shifted")
# mixtures of experts (moe_gpt): expert parallelism over the data-parallel ranks (dp 2 ep 2)
# or, with tensor parallelism, expert tensor parallelism of the tp size or 1
moe_ep2 = recipe(ep=2)
moe_ep2_etp1 = recipe(ep=2, etp=1)
# tensor and sequence parallelism with the experts over the tensor-parallel ranks
# (tp 2 ep 2 etp 1), or each rank holding every expert whole (tp 2 ep 1 etp 1: the
# experts' gradients all-reduced over the expert-data-parallel group, the tp ranks)
moe_tp_sp_ep2 = recipe(sequence_parallel=True, ep=2, etp=1)
moe_tp_sp_etp1_fixed = recipe(sequence_parallel=True, ep=1, etp=1, expert_topology_fix=True)
# shipped: Megatron-LM PR 5916's uncommon case as 0.16.1 runs it (ep 1, etp 1 != tp 2: the
# experts' parameters keep allreduce=True, so DDP reduces their gradients over the dense
# data-parallel group, not over the expert-data-parallel group of the tp ranks)
moe_tp_sp_etp1 = recipe(sequence_parallel=True, ep=1, etp=1)
# a wrong step: the dispatcher sorts the received rows by local expert in the reverse order
moe_tp_sp_ep2_sorted_wrong = recipe(sequence_parallel=True, ep=2, etp=1, bug="experts_sorted_wrong")
# the same at dp 2 ep 2 (the ranks' token rows in the ranks' order: docs/soundness.md, "Plans
# traced from PyTorch", 89)
moe_ep2_sorted_wrong = recipe(ep=2, bug="experts_sorted_wrong")
# a wrong step at dp 2 ep 2: the experts' gradients reduced with the dense ones over the
# data-parallel group (each rank's experts are others than its peer's)
moe_ep2_experts_reduced_over_dp = recipe(ep=2, bug="experts_reduced_over_dp")


def clip_grad_norm(model: MegatronModel, mesh, max_norm: float) -> None:
    """Megatron's gradient clipping as its optimizer runs it (``--clipper``):
    the norm of the gradients each parameter counts once (not shared, not a
    tensor-parallel duplicate) over the model-parallel group
    (``get_grad_norm_fp32``), then ``clip_grad_by_total_norm_fp32``. Megatron
    reads the norm into Python (``.item()``, traced: ``tracer.numbers``) and
    branches on ``clip_coeff < 1.0``: a guard. The single-device step runs
    this clipper too (``one_device``: Megatron's code at world size 1, its
    groups of one rank), so both steps read the same numbers and take the
    same branches, each rank's number claimed and proved equal to the
    single-device one (docs/soundness.md, "Plans traced from PyTorch", 69-71).
    With the distributed optimizer the norm is over the main gradients'
    shards, reduced over the whole distributed-optimizer instance
    (``clip_shards``; items 79-81)."""
    from megatron.core import parallel_state as ps
    if _has_shards(model):
        clip_shards(model, max_norm, _grad_stats_group())
        return
    _clip_whole(model, max_norm, ps.get_model_parallel_group())


def _clip_whole(model: MegatronModel, max_norm: float, group: Any) -> None:
    """``get_grad_norm_fp32`` of the counted gradients over ``group``, then
    ``clip_grad_by_total_norm_fp32`` of every gradient."""
    from megatron.core.optimizer.clip_grads import (
        clip_grad_by_total_norm_fp32,
        get_grad_norm_fp32,
    )
    params = [p for p in model.parameters() if p.grad is not None]
    counted = [p.grad for p in params if _counted(p)]
    total = get_grad_norm_fp32(counted, norm_type=2, grad_stats_parallel_group=group)
    clip_grad_by_total_norm_fp32(params, max_norm, total)


def _counted(p: nn.Parameter) -> bool:
    """Megatron counts a gradient in the norm once: not a shared parameter's
    second copy, not a tensor-parallel duplicate."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
    return param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)


def _has_shards(model: nn.Module) -> bool:
    """The distributed optimizer's ranges are the gradients (``grad_blocks``)."""
    return any(getattr(p, "grad_blocks", None) is not None for p in model.parameters())


def _grad_stats_group() -> Any:
    """The group the distributed optimizer reduces its gradient statistics
    over: every rank of its instance (``DistributedOptimizer.
    get_grad_stats_parallel_group``), the whole world with one instance."""
    from megatron.core import parallel_state as ps
    get = getattr(ps, "get_intra_distributed_optimizer_instance_group", None)
    try:
        return get() if get is not None else None
    except (AssertionError, RuntimeError):
        return None  # not initialized as a group of its own: the whole world


class _ShardParam:
    """What the distributed optimizer's main parameter shows the clipper:
    its gradient, the flat range of the model parameter's ``main_grad``
    (``_copy_model_grads_to_main_grads``: ``main_grad.view(-1)[start:end]``;
    its ``.float()`` is the identity on the traced float values: item 59)."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad


def clip_shards(model: MegatronModel, max_norm: float, group: Any) -> None:
    """Megatron's clipping with the distributed optimizer: the 2-norm of the
    main gradients' shards (each rank's ranges of the counted parameters),
    its square all-reduced over ``group`` (the whole instance: every
    rank's shards), then every shard scaled in place by
    ``clip_grad_by_total_norm_fp32``, into the ranges the optimizer reads."""
    from megatron.core.optimizer.clip_grads import (
        clip_grad_by_total_norm_fp32,
        get_grad_norm_fp32,
    )
    from torch.utils._python_dispatch import _disable_current_modes
    shards: list[tuple[nn.Parameter, torch.Tensor]] = []
    # the shards are views of main_grad's memory (no op: each read of one is
    # a read of that memory, as the tracker records any view's)
    with _disable_current_modes():
        for p in model.parameters():
            main = getattr(p, "grad_blocks", None)
            for start, end in getattr(p, "grad_ranges", []) if main is not None else []:
                shards.append((p, main[0].view(-1)[start:end]))
    counted = [g for p, g in shards if _counted(p)]
    total = get_grad_norm_fp32(counted, norm_type=2, grad_stats_parallel_group=group)
    clip_grad_by_total_norm_fp32([_ShardParam(g) for _, g in shards], max_norm, total)


clip_grad_norm.one_device = True  # type: ignore[attr-defined]
