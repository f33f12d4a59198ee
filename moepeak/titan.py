"""moepeak's four schedules as torchtitan overrides (optional extra: moepeak[titan]).

A stock torchtitan job turns them on from its command line, without a fork:

    --override.imports moepeak.titan.experts,moepeak.titan.loss,moepeak.titan.sco,moepeak.titan.stream_adamw,moepeak.titan.rope

Each name is an ``@override`` factory (torchtitan.config.override) that swaps
one component's Config in the trainer's config tree before anything is built:

  experts       RoutedExperts.Config -> LLEPRoutedExperts.Config: the routed
                experts run as PipelinedLLEP (moepeak.llep_moe), expert parallel
                over torchtitan's "ep" mesh dimension when it has more than one
                rank. The stock GroupedExperts stays the child module, so its
                parameters and state_dict keys (w1_EFD, w2_EDF, w3_EFD) are
                unchanged. The router, shared experts and load balancing stay
                stock.
  loss          the trainer's loss -> RingDTPLoss.Config: a ChunkedLossWrapper
                subclass, so the trainer skips the lm_head (its _skip_lm_head
                path) and hands the loss the final hidden states; the loss is
                moepeak.linear_cross_entropy, which never forms the logits. An
                FSDP2-sharded lm_head (DTensor, Shard(0) on a 1-D mesh) runs the
                vocab-sharded ring over that mesh's group on its local shard.
  sco           ActivationCheckpointing.Config (full or selective) ->
                SCOActivationCheckpointing.Config: full AC whose block inputs live
                in a pinned host arena between forward and backward
                (moepeak.apply_sco); module tree and state_dict keys unchanged.
                {"tile_tokens": N} also runs each block sequence-tiled
                (moepeak.tiled: the fifth peak), GQAttention or deepseek_v3's
                latent attention, with SDPA. {"keep_last": n}: the last n blocks'
                inputs stay on the GPU (default 1).
  stream_adamw  OptimizersContainer.Config -> StreamAdamWOptimizers.Config: each
                "AdamW" param group runs moepeak.StreamAdamW (fp32 state in host
                RAM); its state dict has torch AdamW's keys, so DCP checkpoints
                interchange with the stock optimizer's. {"device_state_mb": N}
                keeps the state of the parameters final last in backward on the
                GPU (StreamAdamW.backward_tail), so their update is not exposed.
  rope          CosSinRoPE / ComplexRoPE.Config -> SharedCosSinRoPE /
                SharedComplexRoPE.Config: one rotary table for every block
                instead of one each ([max_seq_len, 2 * head_dim] fp32 per block:
                1 GiB each at 1M positions with head_dim 128); same numbers, no
                state_dict entry (the table is a non-persistent buffer).

Options travel as JSON kwargs on the CLI, e.g.
    --override.imports 'moepeak.titan.experts={"save_budget_mb": 0}'

Expert weight layout: GroupedExperts stores w1 (gate) and w3 (up) as
[E, F, D] and w2 as [E, D, F]; llep_moe takes the gate/up pair
(w1^T, w3^T), each [E_local, D, F], and w_down = w2^T [E_local, F, D], all
three transpose(1, 2) views of the parameters (no per-step copy; the
gradients come back in the parameters' strides). Only where the compute
dtype differs from the parameters' does .to(dtype) make a cast copy.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from moepeak.titan_compat import provide_missing_torch_names

provide_missing_torch_names()  # torchtitan 0.3 on torch 2.11 / 2.13 (see moepeak/titan_compat.py)
try:
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss, BaseLoss, IGNORE_INDEX
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config import derive, override
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE, RoPE
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(f"moepeak.titan needs torchtitan 0.3 (pip install 'moepeak[titan]'); "
                      f"here torch {torch.__version__}: {e}") from e

import moepeak

__all__ = ["LLEPRoutedExperts", "RingDTPLoss", "SCOActivationCheckpointing", "StreamAdamWOptimizers",
           "SharedCosSinRoPE", "SharedComplexRoPE", "experts", "loss", "sco", "stream_adamw", "rope",
           "qwen3_moe_config"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (as torchtitan's GroupedExperts does), else t."""
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------------------
# Experts: PipelinedLLEP
# ---------------------------------------------------------------------------
class LLEPRoutedExperts(RoutedExperts):
    """torchtitan's RoutedExperts with dispatch + experts + combine replaced by
    moepeak.llep_moe. inner_experts (GroupedExperts) keeps the weights; the
    token dispatcher is built (no parameters) but not used."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        chunk_rows: Optional[int] = None
        """Rows per destination per chunk (None: llep_moe's default)."""
        alpha: float = 1.0
        min_tokens_per_gemm: int = 1024
        imbalance_threshold: float = 1.3
        save_budget_mb: Optional[int] = None
        """Activation cache per MoE layer (MiB; None: llep_moe's default)."""

    def __init__(self, config: Config):
        super().__init__(config)
        if type(self.inner_experts) is not GroupedExperts:
            raise ValueError(f"moepeak.titan.experts: inner_experts must be torchtitan's SwiGLU GroupedExperts, "
                             f"got {type(self.inner_experts).__name__}")
        self.llep_options = dict(chunk_rows=config.chunk_rows, alpha=config.alpha,
                                 min_tokens_per_gemm=config.min_tokens_per_gemm,
                                 imbalance_threshold=config.imbalance_threshold,
                                 save_budget_mb=config.save_budget_mb)
        self.ep_group = None

    def parallelize(self, parallel_dims) -> None:
        if getattr(parallel_dims, "tp_enabled", False) or getattr(parallel_dims, "etp_enabled", False):
            raise NotImplementedError("moepeak.titan.experts: tensor parallelism of the experts (tp/etp > 1) is "
                                      "not supported; PipelinedLLEP splits whole experts over the 'ep' dimension")
        super().parallelize(parallel_dims)
        ep_mesh = parallel_dims.get_optional_mesh("ep")
        self.ep_group = ep_mesh.get_group() if ep_mesh is not None and ep_mesh.size() > 1 else None

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        del num_local_tokens_per_expert_E  # llep_moe plans from the ids themselves
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        dtype = x_BLD.dtype
        ie = self.inner_experts
        w1, w2, w3 = (_local(w).to(dtype) for w in (ie.w1_EFD, ie.w2_EDF, ie.w3_EFD))
        w_gate_up = (w1.transpose(1, 2), w3.transpose(1, 2))  # gate and up [E_local, D, F]: views, no copy
        w_down = w2.transpose(1, 2)  # [E_local, F, D]: a view
        y = moepeak.llep_moe(x_BLD.reshape(B * L, D), topk_expert_ids_BLK.reshape(B * L, K),
                             topk_scores_BLK.reshape(B * L, K), w_gate_up, w_down, group=self.ep_group,
                             **self.llep_options)
        return y.view(B, L, D)


@override(target=RoutedExperts.Config, description="moepeak PipelinedLLEP routed experts")
def experts(cfg: RoutedExperts.Config, **options: Any) -> LLEPRoutedExperts.Config:
    if type(cfg.inner_experts) is not GroupedExperts.Config:
        raise ValueError(f"moepeak.titan.experts: PipelinedLLEP computes SwiGLU experts "
                         f"(silu(x w1) * (x w3)) w2; {type(cfg.inner_experts).__qualname__} "
                         f"(e.g. gpt_oss's clamped activation with biases) is not supported")
    return derive(cfg, LLEPRoutedExperts.Config, **options)


# ---------------------------------------------------------------------------
# Loss: Ring-DTP
# ---------------------------------------------------------------------------
class RingDTPLoss(ChunkedLossWrapper):
    """Sum cross-entropy of lm_head(hidden) over the batch, divided by the
    global valid-token count, computed by moepeak.linear_cross_entropy without
    the [B, L, V] logits. Being a ChunkedLossWrapper, the trainer sets the
    lm_head on it and runs the model with _skip_lm_head=True."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        ring: str = "auto"
        """Sharded head: "auto", "weights", "activations" or "gather" (linear_cross_entropy)."""
        mode: str = "auto"
        """Unsharded head: linear_cross_entropy's schedule."""
        chunk_tokens: Optional[int] = None
        chunk_vocab: Optional[int] = None

    def __init__(self, config: Config, *, compile_config=None):
        if type(config.loss_fn) is not CrossEntropyLoss.Config:
            raise ValueError(f"moepeak.titan.loss computes cross-entropy; the inner loss "
                             f"{type(config.loss_fn).__qualname__} is not supported")
        self.num_chunks = 1
        self.loss_fn = None
        self.lm_head = None
        self.options = dict(ring=config.ring, mode=config.mode, chunk_tokens=config.chunk_tokens,
                            chunk_vocab=config.chunk_vocab)

    def head_weight(self):
        """(weight, bias, group): the lm_head's weight as linear_cross_entropy
        takes it -- the whole [V, D] matrix, or this rank's dim-0 vocab shard
        [V/P, D] with the group of its 1-D mesh."""
        head = self.lm_head
        if head is None:
            raise RuntimeError("moepeak.titan.loss: the trainer did not set the lm_head (set_lm_head)")
        w, b = head.weight, getattr(head, "bias", None)
        if not hasattr(w, "placements"):
            return w, b, None
        from torch.distributed.tensor import Shard
        if w.device_mesh.ndim != 1 or tuple(w.placements) != (Shard(0),):
            raise NotImplementedError(f"moepeak.titan.loss: the lm_head weight must be whole or sharded on dim 0 "
                                      f"over a 1-D mesh (FSDP2); got placements {tuple(w.placements)} on a "
                                      f"{w.device_mesh.ndim}-D mesh")
        if b is not None:
            raise NotImplementedError("moepeak.titan.loss: a sharded lm_head with a bias is not supported")
        group = w.device_mesh.get_group()
        return w.to_local(), None, (group if w.device_mesh.size() > 1 else None)

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens=None, **loss_inputs):
        unknown = sorted(set(loss_inputs) - {"positions"})
        if unknown:
            raise ValueError(f"moepeak.titan.loss: unsupported loss inputs {unknown}")
        if hasattr(pred, "to_local"):
            raise NotImplementedError("moepeak.titan.loss: DTensor hidden states (tensor/sequence parallel "
                                      "loss) are not supported")
        w, b, group = self.head_weight()
        w = w.to(pred.dtype)
        b = b.to(pred.dtype) if b is not None else None
        opts = dict(self.options)
        if group is None:
            opts.pop("ring")
        else:
            opts.pop("mode")
        loss = moepeak.linear_cross_entropy(pred, w, labels, bias=b, ignore_index=IGNORE_INDEX, reduction="sum",
                                            group=group, **opts)
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}


@override(target=BaseLoss.Config, fqns=["loss"], description="moepeak Ring-DTP linear cross-entropy")
def loss(cfg: BaseLoss.Config, **options: Any) -> RingDTPLoss.Config:
    if type(cfg) is CrossEntropyLoss.Config:
        return RingDTPLoss.Config(loss_fn=cfg, **options)
    if type(cfg) is ChunkedLossWrapper.Config:
        return derive(cfg, RingDTPLoss.Config, **options)
    raise ValueError(f"moepeak.titan.loss replaces cross-entropy (CrossEntropyLoss or ChunkedLossWrapper); "
                     f"the job's loss is {type(cfg).__qualname__}")


# ---------------------------------------------------------------------------
# Activation checkpointing: SCO
# ---------------------------------------------------------------------------
class SCOActivationCheckpointing(ActivationCheckpointing):
    """Full activation checkpointing of every transformer block, each block's
    input kept in a pinned host arena between forward and backward; with
    tile_tokens, each block also runs sequence-tiled (moepeak.tiled): only its
    attention core holds full-length tensors, in forward and in the recompute."""

    @dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        max_in_flight: int = 2
        prefetch: int = 1
        keep_last: int = 1
        """How many of the last blocks keep their input on the GPU (SCOConfig.keep_last)."""
        arena_bytes: int = 0
        max_arena_bytes: Optional[int] = None
        tile_tokens: Optional[int] = None
        """Tokens per sequence tile of the position-wise parts (None: untiled).
        Blocks with GQAttention or deepseek_v3's latent Attention, and torchtitan's
        ScaledDotProductAttention, only."""

    def __init__(self, config: Config, dump_folder: str = ""):
        super().__init__(config, dump_folder)
        if not config.preserve_rng_state:
            raise ValueError("moepeak.titan.sco always preserves the RNG state (preserve_rng_state=False "
                             "is not supported)")
        tile = config.tile_tokens
        if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
            raise ValueError(f"moepeak.titan.sco: tile_tokens must be a positive integer or None, got {tile!r}")
        self.tile_tokens = tile
        self.sco_config = moepeak.SCOConfig(max_in_flight=config.max_in_flight, prefetch=config.prefetch,
                                            keep_last=config.keep_last, arena_bytes=config.arena_bytes,
                                            max_arena_bytes=config.max_arena_bytes)

    def apply(self, model: torch.nn.Module) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
        blocks = list(model.get_submodule("layers").children())
        if self.tile_tokens is not None:
            for i, block in enumerate(blocks):
                _tile_block(block, i, self.tile_tokens)
        moepeak.apply_sco(model, blocks, self.sco_config)
        for block in blocks:
            # torchtitan's MoE load-balancing hook halves the token counts of
            # blocks marked as non-reentrant checkpointed (the recompute counts
            # them twice); SCO recomputes the same way.
            block.checkpoint_impl = CheckpointImpl.NO_REENTRANT


def _tile_block(block: torch.nn.Module, index: int, tile_tokens: int) -> None:
    """block.forward runs moepeak.tiled_adapters.tiled_titan_block_forward in training with
    grad enabled (inside FSDP2's hooks, which wrap __call__), else the stock forward."""
    from torchtitan.models.common.attention import GQAttention, ScaledDotProductAttention

    from moepeak.tiled_adapters import tiled_titan_block_forward
    try:
        from torchtitan.models.deepseek_v3.model import Attention as LatentAttention
    except ImportError:  # a torchtitan without deepseek_v3
        LatentAttention = GQAttention
    attn = getattr(block, "attention", None)
    known = isinstance(attn, (GQAttention, LatentAttention))
    if not known or not isinstance(attn.inner_attention, ScaledDotProductAttention):
        what = type(attn).__name__ if not known else f"{type(attn).__name__} with {type(attn.inner_attention).__name__}"
        raise ValueError(f"moepeak.titan.sco: tile_tokens tiles blocks whose attention is GQAttention or deepseek_v3's "
                         f"latent Attention, with torchtitan's ScaledDotProductAttention; layers.{index} has {what}")
    untiled = block.forward

    def forward(x, attention_masks=None, positions=None, _block=block, _untiled=untiled):
        if not (_block.training and torch.is_grad_enabled()):
            return _untiled(x, attention_masks, positions)
        return tiled_titan_block_forward(_block, x, attention_masks, positions, tile_tokens=tile_tokens)
    block.forward = forward


@override(target=ActivationCheckpointing.Config, fqns=["activation_checkpoint"],
          description="moepeak SCO: full AC with block inputs in pinned host memory")
def sco(cfg: ActivationCheckpointing.Config, **options: Any) -> SCOActivationCheckpointing.Config:
    return SCOActivationCheckpointing.Config(preserve_rng_state=cfg.preserve_rng_state,
                                             determinism_check=cfg.determinism_check, debug=cfg.debug, **options)


# ---------------------------------------------------------------------------
# Rotary tables: one per configuration and device, not one per block
# ---------------------------------------------------------------------------
_ROTARY_TABLES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_MODULE_FIELDS = {f.name for f in dataclasses.fields(RoPE.__bases__[0].Config)}  # init/sharding: not the table's


class _SharedRotaryTable:
    """Over a torchtitan RoPE: every block whose RoPE config is equal, on the same device,
    holds the same cache tensor ([max_seq_len, ...], fp32 or complex64; torchtitan builds
    one per block). Built on the meta device (torchtitan's init flow), the buffer is a
    0-row placeholder, so to_empty() allocates no table per block; init_weights()
    (_init_self_buffers) then points it at the shared table. A later .to(device) copies
    each block's buffer apart again (values unchanged)."""

    def _precompute_cache(self) -> torch.Tensor:
        device = torch.get_default_device()  # the device both callers build the cache on
        if device.type == "meta":
            return super()._precompute_cache()[:0]
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        key = (type(self), tuple(getattr(self.config, f.name) for f in dataclasses.fields(self.config)
                                 if f.name not in _MODULE_FIELDS), device)
        table = _ROTARY_TABLES.get(key)
        if table is None:
            table = super()._precompute_cache()
            _ROTARY_TABLES[key] = table
        return table


class SharedCosSinRoPE(_SharedRotaryTable, CosSinRoPE):
    """CosSinRoPE with one table for all blocks (see _SharedRotaryTable)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass


class SharedComplexRoPE(_SharedRotaryTable, ComplexRoPE):
    """ComplexRoPE with one table for all blocks (see _SharedRotaryTable)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        pass


_SHARED_ROPE = {CosSinRoPE.Config: SharedCosSinRoPE.Config, ComplexRoPE.Config: SharedComplexRoPE.Config}


@override(target=RoPE.Config, description="moepeak: one rotary table for all blocks")
def rope(cfg: RoPE.Config) -> RoPE.Config:
    if type(cfg) in _SHARED_ROPE.values():
        return cfg
    shared = _SHARED_ROPE.get(type(cfg))
    if shared is None:
        raise ValueError(f"moepeak.titan.rope shares CosSinRoPE and ComplexRoPE tables; "
                         f"{type(cfg).__qualname__} is not supported")
    return derive(cfg, shared)


# ---------------------------------------------------------------------------
# Optimizer: StreamAdamW
# ---------------------------------------------------------------------------
_TORCH_IMPL_KEYS = ("fused", "foreach", "capturable", "differentiable")


class StreamAdamWOptimizers(OptimizersContainer):
    """torchtitan's optimizer container with every AdamW param group on
    moepeak.StreamAdamW (same hyperparameters, same state-dict keys)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        bucket_mb: float = 64
        threads: Optional[int] = None
        device_state_mb: float = 0
        """GPU memory (MiB per model part and rank) for the optimizer state of the leading
        parameters in the model's order, whose gradients are final last in backward
        (StreamAdamW.backward_tail): updated on the GPU, not on the host after backward."""

    def __init__(self, config: Config, *, model_parts):
        if config.implementation == "fused_opt_states_bf16":
            raise ValueError("moepeak.titan.stream_adamw keeps fp32 optimizer state in host RAM; "
                             "implementation='fused_opt_states_bf16' does not apply")
        budget = config.device_state_mb
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
            raise ValueError(f"moepeak.titan.stream_adamw: device_state_mb must be a number >= 0, got {budget!r}")
        self._device_state_bytes = int(budget * (1 << 20))
        self._stream_kwargs = dict(bucket_mb=config.bucket_mb, threads=config.threads)
        # Group keys torch.optim.AdamW has and StreamAdamW lacks, with the values
        # the stock container would give them: written into state_dict() so a
        # stock job finds every key it expects when it loads our checkpoint.
        self._adamw_group_keys = dict(fused=config.implementation == "fused",
                                      foreach=config.implementation == "foreach", capturable=False,
                                      differentiable=False, decoupled_weight_decay=True)
        super().__init__(config, model_parts=model_parts)

    def state_dict(self) -> dict:
        """torchtitan's flat FQN-keyed layout, interchangeable with the stock
        AdamW container's (same state keys, same param_group keys)."""
        sd = super().state_dict()
        for key in [k for k in sd if k.startswith("param_groups.") and k.endswith(".lr")]:
            prefix = key[:-len("lr")]
            for name, value in self._adamw_group_keys.items():
                sd.setdefault(prefix + name, value)
        return sd

    def _build_impl_kwargs(self, config) -> dict:
        return {}  # StreamAdamW has one implementation

    def _resolve_optimizer_factory(self, name: str):
        if name != "AdamW":
            raise NotImplementedError(f"moepeak.titan.stream_adamw replaces AdamW param groups; got optimizer {name!r}")
        stream_kwargs, container = self._stream_kwargs, self

        def build(param_groups, **factory_kwargs):
            groups = [{k: v for k, v in g.items() if k not in _TORCH_IMPL_KEYS} for g in param_groups]
            device_state = None
            if container._device_state_bytes:
                mine = {id(p) for g in groups for p in g["params"]}
                ordered = [p for m in container.model_parts for p in m.parameters() if id(p) in mine]
                device_state = moepeak.StreamAdamW.backward_tail(ordered, container._device_state_bytes)
            return moepeak.StreamAdamW(groups, device_state=device_state, **stream_kwargs, **factory_kwargs)

        return build


@override(target=OptimizersContainer.Config, fqns=["optimizer"], description="moepeak StreamAdamW")
def stream_adamw(cfg: OptimizersContainer.Config, **options: Any) -> StreamAdamWOptimizers.Config:
    return derive(cfg, StreamAdamWOptimizers.Config, **options)


def qwen3_moe_config(n_layers: int, num_experts: int, top_k: int, hidden_dim: int, *,
                     flavor: Optional[str] = None, max_seq_len: Optional[int] = None):
    """A stock torchtitan Qwen3-MoE Trainer.Config cut down for tests and benchmarks.

    qwen3_moe_debug()'s job (with the model of qwen3 `flavor`, e.g. "30B-A3B", if given)
    keeping its first n_layers blocks, each with num_experts routed experts of hidden_dim,
    top_k routing, SDPA attention, and full activation checkpointing. max_seq_len, if given,
    sets the rotary tables' length (the stock tables end at the flavor's training length).
    No moepeak override is applied: apply_overrides(...) on the result does that."""
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    cfg = qwen3_moe_debug()
    if flavor is not None:
        cfg.model_spec = model_registry(flavor)
    model = cfg.model_spec.model
    model.layers = model.layers[:n_layers]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        moe = layer.moe
        moe.num_experts = num_experts
        inner = moe.routed_experts.inner_experts
        inner.num_experts, inner.hidden_dim = num_experts, hidden_dim
        dispatcher = moe.routed_experts.token_dispatcher
        dispatcher.num_experts, dispatcher.top_k = num_experts, top_k
        moe.router.num_experts, moe.router.top_k, moe.router.gate.out_features = num_experts, top_k, num_experts
        if max_seq_len is not None and hasattr(rope := layer.attention.rope, "max_seq_len"):
            rope.max_seq_len = max_seq_len
    cfg.activation_checkpoint = FullAC.Config()
    return cfg
