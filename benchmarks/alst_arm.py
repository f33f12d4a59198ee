"""The ALST arms of bench_hf.py: Arctic Long Sequence Training (arXiv 2506.13996) on one GPU,
built from DeepSpeed's and ArcticTraining's own components, imported at run time.

ALST's single-GPU recipes (ArcticTraining projects/sequence-parallelism/run-h100-sp1-*.yml,
run-h200-sp1-llama-8b-liger-offload-tiled-mlp.yml; launched with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) combine, and these arms use as they do:
  - DeepSpeed ZeRO stage 3 with params and optimizer state offloaded to CPU, the optimizer
    DeepSpeedCPUAdam (deepspeed.ops.adam; JIT-built by DeepSpeed with ninja on first use),
    bf16, micro batch 1, gradient clipping 1.0 (ArcticTraining's default);
  - activation checkpointing (transformers' gradient_checkpointing_enable, reentrant) with
    ArcticTraining's CheckpointFunction patch that keeps each checkpointed layer's input
    hidden state in host memory (arctic_training/monkey_patches.py; its package __init__
    pulls in the trainer stack and pins transformers < 5, so that one file is loaded from
    the installed wheel on its own);
  - TiledMLP (deepspeed.runtime.sequence_parallel.ulysses_sp): the MLP recomputed per
    sequence tile in backward, ceil(tokens / hidden) tiles (ArcticTraining's "auto").
    ArcticTraining patches the dense `<Model>MLP` class; MoE layers do not use it, so here
    TiledMLP wraps the MoE block (router + experts: Qwen3MoeSparseMoeBlock,
    OlmoeSparseMoeBlock), whose routing is per token (top-k without capacity), so tiling
    does not change what any token computes;
  - the loss without full logits: arm "alst" uses DeepSpeed's TiledFusedLogitsLoss (lm_head
    + the model's loss_function per tile of ~1 GiB of fp32 logits, ArcticTraining's
    fallback where Liger has no model; each tile weighted inside, see tiled_logits_loss);
    arm "alst_liger" uses Liger-Kernel's fused linear
    cross-entropy, RMSNorm and RoPE as the recipes' `model.type: liger` does, SwiGLU left
    out as ArcticTraining does when tiled_mlp_compute is on (so the experts stay on
    transformers' grouped_mm in both arms).
One process, world size 1, so no Ulysses sequence parallelism and no cross-rank agreement
on tile counts. The router aux loss is not computed (output_router_logits=False, the
configs' default); a config asking for it is refused.

Correctness before speed (check_first_step): on the same weights and batch, stock
transformers' loss in fp32, under bf16 autocast (the hf arm's setting) and with bf16
params (ALST's setting; for alst_liger also with Liger's kernels applied) is computed
first; ALST's first-step loss must lie within twice the stock model's bf16 noise (the
larger of its own two bf16-vs-fp32 differences) of the stock loss in ALST's precision
and kernels. The distance to the fp32 loss is reported beside it.

Host RAM: ZeRO-3's offloaded state is 16 bytes a parameter (fp32 master copy, fp32
gradients, two Adam moments), 18 with the params offloaded too; the run is refused before
anything is built when that alone exceeds the RAM available (host_state_bytes). Measured
on an H200 machine (2.0B Qwen3-MoE, params offloaded): 46.6 GiB peak RSS, 25 bytes a
parameter, so a 6.9B model (OLMoE-1B-7B) needs ~160 GiB with the recipe's settings.
"""
from __future__ import annotations

import importlib.util
import math
import os
import socket
import time
from types import MethodType

import torch

ARMS = ("alst", "alst_liger")
ALLOC_CONF = "expandable_segments:True"  # ALST's launch setting; the parent sets it for these workers
DEEPSPEED_VERSION = "0.19.8"
LOGITS_SHARD_BYTES = 2**30  # ArcticTraining's tiled loss: ~1 GiB of fp32 logits per tile


def host_state_bytes(params, offload_param=True):
    """Host bytes of ZeRO-3's offloaded state alone: fp32 master params, fp32 gradients and
    two fp32 Adam moments (16 B a parameter), + the bf16 params themselves when offloaded."""
    return params * (18 if offload_param else 16)


def apply_liger(model):
    """Liger's Qwen3-MoE kernels on this model instance as ALST's recipes use them (RMSNorm,
    RoPE, fused linear cross-entropy; SwiGLU off beside TiledMLP). Applied once."""
    if getattr(model, "_alst_liger_applied", False):
        return
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe

    apply_liger_kernel_to_qwen3_moe(rope=True, rms_norm=True, swiglu=False, fused_linear_cross_entropy=True,
                                    model=model)
    model._alst_liger_applied = True


def import_components():
    """(deepspeed, ulysses_sp module, arctic_training's monkey_patches module). Raises
    ImportError naming what is missing (the caller records a "skipped" row)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    if deepspeed.__version__ != DEEPSPEED_VERSION:
        raise ImportError(f"deepspeed {deepspeed.__version__} is installed; these arms are set up for "
                          f"{DEEPSPEED_VERSION} (benchmarks/wheels.txt)")
    return deepspeed, ulysses_sp, load_checkpoint_offload()


def load_checkpoint_offload():
    """arctic_training/monkey_patches.py from the installed package, loaded without running
    arctic_training/__init__.py (find_spec of a top-level package only locates it)."""
    spec = importlib.util.find_spec("arctic_training")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("arctic_training is not installed (benchmarks/wheels.txt)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "monkey_patches.py")
    file_spec = importlib.util.spec_from_file_location("arctic_training_monkey_patches", path)
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


def moe_blocks(model):
    """The decoder layers' MoE blocks (a `gate` router and an `experts` module), in order."""
    return [layer.mlp for layer in model.model.layers
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")]


def tile_moe_blocks(model, tiled_mlp, tokens_per_tile=None):
    """Route every MoE block's forward through TiledMLP (an instance attribute: the class
    and other models are untouched). Tiles: ceil(tokens / tokens_per_tile), by default
    tokens_per_tile = hidden size (ArcticTraining's auto rule). Returns the block count."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"tile_moe_blocks: {type(model).__name__} has no decoder layer whose mlp has a router "
                         "(gate) and experts")
    per_tile = model.config.hidden_size if tokens_per_tile is None else tokens_per_tile
    if per_tile < 1:
        raise ValueError(f"tile_moe_blocks: tokens_per_tile must be >= 1, got {per_tile}")
    for block in blocks:
        untiled = type(block).forward  # transformers' block forward takes [batch, seq, hidden]

        def run_tile(blk, x_tile, _untiled=untiled):
            # TiledMLP hands over [tokens, hidden] rows (forward and backward alike, since x is flat)
            return _untiled(blk, x_tile.unsqueeze(0)).squeeze(0)

        def tiled_forward(hidden_states, _block=block, _run=run_tile):
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            tiles = math.ceil(flat.shape[0] / per_tile)
            out = tiled_mlp.apply(_run, _block, flat, tiles, list(_block.parameters()))
            return out.view(hidden_states.shape)

        block.forward = tiled_forward
    return len(blocks)


def shift_labels_of(labels, ignore_index=-100):
    """transformers' causal-LM targets: labels shifted left by one, ignore_index last."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def logits_tiles(tokens, vocab_size):
    """ArcticTraining's tile count for the tiled loss: ~LOGITS_SHARD_BYTES of fp32 logits each."""
    return max(1, math.ceil(tokens * vocab_size * 4 / LOGITS_SHARD_BYTES))


def tiled_logits_loss(causal_lm, hidden, labels, tiled_fused_logits_loss, tiles=None):
    """The model's mean causal-LM loss of final hidden states [B, T, H] against labels [B, T]
    through TiledFusedLogitsLoss: per tile, lm_head and the model's own loss_function (the
    mean over the tile's counted targets) weighted by the tile's share of all counted
    targets; the tiles' sum is the mean over all. The tiles' backward runs inside forward
    (no logits kept), so lm_head's gradient is final when the loss is returned: the weights
    go inside the tile function. (ArcticTraining sums count x mean per tile and divides the
    result afterwards; that division reaches the hidden states' gradient but not lm_head's,
    which stays count times too large.)"""
    targets = shift_labels_of(labels)
    vocab = causal_lm.config.vocab_size
    tiles = logits_tiles(targets.numel(), vocab) if tiles is None else tiles
    if tiles < 1:
        raise ValueError(f"tiled_logits_loss: tiles must be >= 1, got {tiles}")
    counted_all = (targets != -100).sum().clamp(min=1)

    def tile_share(lm, x_tile, y_tile):
        logits = lm.lm_head(x_tile)
        counted = (y_tile != -100).sum()
        if counted.item() == 0:  # the mean would be 0/0; a zero that still gives lm_head a gradient
            return (logits.sum() * 0.0).float()
        mean = lm.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=y_tile)
        return mean * counted / counted_all

    return tiled_fused_logits_loss.apply(tile_share, causal_lm, hidden, targets, None, tiles,
                                         [causal_lm.lm_head.weight], "sum")


def use_tiled_loss(model, tiled_fused_logits_loss, tiles=None):
    """Replace the model's forward (instance attribute) by the base model + tiled_logits_loss,
    so the DeepSpeed engine's forward returns the loss without logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def forward(self, input_ids, labels):
        hidden = self.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return CausalLMOutputWithPast(loss=tiled_logits_loss(self, hidden, labels, tiled_fused_logits_loss, tiles))

    model.forward = MethodType(forward, model)


def deepspeed_config(offload_param=True, torch_optimizer=False):
    """ALST's single-GPU DeepSpeed config (the sp1 recipes' zero_optimization, ArcticTraining's
    defaults for the rest). torch_optimizer: a torch optimizer on the offloaded state."""
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": zero, "gradient_clipping": 1.0, "steps_per_print": 1 << 30,
           "wall_clock_breakdown": False}
    if torch_optimizer:
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def init_single_process(deepspeed, device):
    """A world of one for DeepSpeed (nccl on CUDA, gloo on CPU), on a free loopback port."""
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port)).items():
            os.environ.setdefault(k, v)
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", auto_mpi_discovery=False,
                                   verbose=False)


def setup(arm, model, device, lr=1e-4, offload_param=True, optimizer="cpu_adam", tokens_per_tile=None,
          logits_tiles=None):
    """Apply ALST to a bf16 model (unpatched transformers) and wrap it in a DeepSpeed engine.
    Returns (step, note): step(ids) runs one training step on labels = ids and returns the
    loss (detached); note names the settings and the optimizer's build/load seconds.
    tokens_per_tile / logits_tiles: None for ArcticTraining's auto rules (tiny smoke runs
    pass small ones so that tiles are many)."""
    if arm not in ARMS:
        raise ValueError(f"alst_arm.setup: arm must be one of {ARMS}, got {arm!r}")
    if optimizer not in ("cpu_adam", "torch"):
        raise ValueError(f"alst_arm.setup: optimizer must be 'cpu_adam' or 'torch', got {optimizer!r}")
    if getattr(model.config, "output_router_logits", False):
        raise ValueError("alst_arm.setup: output_router_logits=True is not supported (the tiled MoE block "
                         "runs its router once per tile and again in backward)")
    import logging

    deepspeed, ulysses_sp, checkpoint_offload = import_components()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    init_single_process(deepspeed, device)

    if arm == "alst_liger":
        apply_liger(model)
    else:
        use_tiled_loss(model, ulysses_sp.TiledFusedLogitsLoss, logits_tiles)
    blocks = tile_moe_blocks(model, ulysses_sp.TiledMLP, tokens_per_tile)
    checkpoint_offload.monkey_patch_checkpoint_function_with_cpu_offload()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()

    t0 = time.perf_counter()
    if optimizer == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(model.parameters(), lr=lr, weight_decay=0.01, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    opt_s = time.perf_counter() - t0
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt,
                                      config=deepspeed_config(offload_param, optimizer == "torch"))

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    loss_name = "Liger FLCE+RMSNorm+RoPE" if arm == "alst_liger" else "TiledFusedLogitsLoss"
    note = (f"ZeRO-3, optimizer{' + params' if offload_param else ''} on CPU, "
            f"{'DeepSpeedCPUAdam' if optimizer == 'cpu_adam' else 'torch AdamW'} ({opt_s:.0f} s to build/load), "
            f"ckpt offload, TiledMLP over {blocks} MoE blocks ({tokens_per_tile or 'hidden size'} tokens a tile), "
            f"{loss_name}{f' ({logits_tiles} tiles)' if logits_tiles and arm == 'alst' else ''}, "
            f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}")
    return step, note


@torch.no_grad()
def stock_losses(model, ids, liger=False):
    """Stock transformers' loss of ids on a fp32 model: fp32 ("fp32"), under bf16 autocast
    ("autocast"), with the params cast to bf16 ("bf16"), and if liger, with Liger's kernels
    applied to the bf16 model as alst_liger applies them ("liger"). The model is left in
    bf16 (with Liger's kernels if liger), ready for setup."""
    if model.dtype != torch.float32:
        raise ValueError(f"alst_arm.stock_losses: the model must be fp32, got {model.dtype}")
    device = ids.device.type
    out = dict(fp32=model(input_ids=ids, labels=ids).loss.item())
    with torch.autocast(device, dtype=torch.bfloat16):
        out["autocast"] = model(input_ids=ids, labels=ids).loss.item()
    model.to(torch.bfloat16)
    out["bf16"] = model(input_ids=ids, labels=ids).loss.item()
    if liger:
        apply_liger(model)
        out["liger"] = model(input_ids=ids, labels=ids).loss.item()
    return out


REFERENCE_NAMES = dict(bf16="stock bf16 params", liger="stock bf16 params + Liger")


def check_first_step(loss, refs, same="bf16"):
    """(within, note): ALST's first-step loss against stock transformers' on the same weights
    and batch. refs: stock_losses' dict; same: the key of the stock loss in ALST's precision
    and kernels ("bf16", or "liger" for alst_liger). bf16 noise = the larger of the stock
    model's own differences |autocast - fp32| and |bf16 params - fp32|; within =
    |loss - refs[same]| <= 2 x that."""
    if same not in REFERENCE_NAMES:
        raise ValueError(f"alst_arm.check_first_step: same must be one of {sorted(REFERENCE_NAMES)}, got {same!r}")
    missing = {"fp32", "autocast", "bf16", same} - set(refs)
    if missing:
        raise ValueError(f"alst_arm.check_first_step: refs lacks {sorted(missing)}")
    stock = f"stock fp32 {refs['fp32']:.6f}, bf16 autocast {refs['autocast']:.6f}, bf16 params {refs['bf16']:.6f}" + (
        f", bf16 params + Liger {refs['liger']:.6f}" if "liger" in refs else "")
    if not all(math.isfinite(v) for v in (loss, *refs.values())):
        return False, f"non-finite loss: first-step loss {loss}; {stock}"
    noise = max(abs(refs["autocast"] - refs["fp32"]), abs(refs["bf16"] - refs["fp32"]))
    off = abs(loss - refs[same])
    within = off <= 2 * noise
    note = (f"first-step loss {loss:.6f}; {stock}; |ALST - {REFERENCE_NAMES[same]}| {off:.2e} "
            f"{'<=' if within else '>'} 2 x {noise:.2e} (bf16 noise); |ALST - fp32| {abs(loss - refs['fp32']):.2e}")
    return within, note
