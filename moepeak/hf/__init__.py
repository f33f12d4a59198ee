"""moepeak.hf: moepeak's schedules inside an existing Hugging Face transformers MoE model.

    from moepeak.hf import apply_moepeak
    report = apply_moepeak(model)          # model: a transformers *ForCausalLM instance
    print(report)

apply_moepeak patches one model instance in place. The module tree, the
parameters and the state_dict keys stay those of transformers (with group=None
the shapes too), so from_pretrained checkpoints load and save_pretrained writes
what transformers expects. Three parts, each can be turned off:

- experts: a "moepeak" implementation in transformers' experts registry
  (transformers.integrations.moe.ExpertsInterface), selected for this model with
  model.set_experts_implementation("moepeak"). Routing (top_k_index,
  top_k_weights) comes from the model's own router, unchanged. Each experts
  module whose layout and activation are in SUPPORTED_LAYOUTS runs through
  moepeak.llep_moe on views of its weights (gated SiLU: Qwen3-MoE, Qwen2-MoE,
  Mixtral, OLMoE, DeepSeek-V3, ...; GPT-OSS's interleaved, biased, clamped
  experts: llep_moe's "gpt_oss" activation); any other keeps the implementation
  the model had before (transformers' grouped_mm by default), and the report
  says why. With group=..., expert parallelism (moepeak/hf/expert_parallel.py):
  rank r keeps experts [r*E/P, (r+1)*E/P) of every supported experts module
  (the parameter is replaced by that slice: same key, shape [E/P, ...]), tokens
  stay on their rank and PipelinedLLEP moves them to the experts and back. Every
  gradient is that of the mean of the ranks' losses: the expert slices' are
  final after backward (divided by P on the way) and rank-local; the other
  parameters are replicated and their gradients are averaged over the group by
  DistributedDataParallel (apply_moepeak marks the slices for DDP to leave
  alone) or by average_gradients(model); clip with clip_grad_norm_(model, ...),
  which counts every rank's slices.
- loss: the *ForCausalLM.forward of the instance (families in LOSS_FAMILIES)
  computes moepeak.linear_cross_entropy on the last hidden state when labels
  are given in training, so the [tokens, vocab] logits never exist; logits
  come back as None. transformers' semantics are kept: labels shifted left by
  one (or shift_labels), ignore_index (-100), reduction "mean" over the
  non-ignored labels or, with num_items_in_batch (the Trainer's gradient
  accumulation), the sum divided by it; router_aux_loss_coef * aux_loss added
  when the model computes it (output_router_logits). Under autocast the
  projection runs in the autocast dtype, as lm_head would. In eval or without
  labels the model's own forward runs unchanged. With lean_norm (default) the
  final norm (the base model's .norm, a class in LEAN_NORMS) runs
  moepeak.norms.rms_norm: bitwise its forward, a backward that saves the input
  and fp32 rstd only and works in chunks of norm_chunk_tokens rows (the
  instance's forward is replaced; module tree and state_dict keys unchanged).
  With checkpoint and lean_norm, the decoder layers' RMSNorms (input,
  post-attention, per-head q/k) run it too, so a recomputed layer saves the
  norms' inputs and rstd instead of fp32 copies.
- checkpoint: SCO (moepeak.sco_checkpoint) as the model's gradient
  checkpointing function on every GradientCheckpointingLayer, enabled at once.
  The instance's _set_gradient_checkpointing is replaced, so a later
  model.gradient_checkpointing_enable(...) (also the Trainer's, with
  TrainingArguments(gradient_checkpointing=True)) installs SCO again instead of
  torch's checkpoint; its gradient_checkpointing_kwargs and offload=True are
  superseded (SCO offloads the boundaries itself); every_n_layers is honoured.
  model.gradient_checkpointing_disable() turns checkpointing off.

- tile_tokens (off unless given): every decoder layer of a family in TILED_LAYERS
  (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3; MoE and dense layers) runs
  moepeak.hf.tiled.tiled_hf_layer_training_forward (the block's position-wise parts in
  sequence tiles of tile_tokens tokens, only attention at full length) in training with
  grad; in eval / no_grad the layer's own forward runs. The call is the stock layer's:
  under the gradient-checkpointing function when checkpointing is on (SCO: the layer's
  input is SCO's boundary), and every argument but the mask, the rotary tables and the KV
  cache reaches the attention function unchanged (position_ids and cu_seq_lens_q/k of
  packed sequences included). With checkpointing off, the empty KV cache transformers makes
  in training (config.use_cache) is left empty (stock would store every layer's k, v in
  it); a cache that holds tokens is refused. Under autocast the backward's recompute runs
  under the forward's autocast and RNG state. With output_router_logits (config or call)
  each tiled MoE layer hands transformers' output collector one router-logits tensor [B*T,
  E] for all its tokens, as the untiled router does, instead of the per-tile ones its router
  produced (a dense layer hands none, as stock): an output of the tiled block's autograd
  node, so the model's own router aux loss (load_balancing_loss_func) is that of the
  untiled model and its gradient reaches the routers and the layer inputs through the tiled
  recompute. With output_attentions and an attention function that returns weights
  (eager), each layer hands the forward's weights [B, heads, T, T], equal to stock's but
  without a gradient path (a backward through them raises). (Reads transformers' private
  output collector, transformers.utils.output_capturing._active_collector; checked at apply
  time.) The logits cost L x [T, E] in the activation dtype: 32 B/token per layer at E = 16
  in bf16, 1/128 of one [T, H] at H = 2048 (transformers' aux loss also keeps each layer's
  softmax of them). Other families' layers are left alone (the report says so). Their
  attention runs in the fewest head groups (dividing num_key_value_heads) whose full-length
  set fits half the GPU memory free at the forward (attention_head_groups forces a count;
  with sequence_group num_key_value_heads, the same calls on every rank).

- attention_backend ("auto" unless given): the SDPA backends the attention runs on in training,
  in the tiled layers' core and in every self_attn (attention.py's patch_attention_backend):
  "auto" = cuDNN, then flash, efficient, math on Hopper for unmasked fp16/bf16 (torch's own choice
  elsewhere); "cudnn", "flash", "efficient", "math" = that one only; None or "torch" = off.

- sequence_group (off unless given): sequence parallelism from an existing engine (DeepSpeed
  Ulysses' UlyssesSPAttentionHF, torch's context_parallel through accelerate's cp_size): each
  rank of the group holds a shard of one sequence with its global position_ids and the
  pre-shifted shift_labels, and only the attention function reaches across ranks. moepeak's
  parts run on the shard unchanged; sequence.py says what becomes sequence-aware: the tiled
  layers call the attention with every head in one group when it exchanges heads (Ulysses;
  attention_head_groups forces a count) and apply self_attn's keyword forward pre-hooks
  (accelerate's context-parallel hook); the loss is the rank's share of the sequence's (CE
  over the sequence's label count, the router aux loss's share from all-reduced expert
  counts), whose value is the sequence's loss on every rank and whose gradient suits the
  engine's reduction (sequence_loss "mean": DDP/FSDP2; "sum": DeepSpeed); the batch is
  checked with the group (position_ids, no padding, packed documents only with a core that
  reads them: "moepeak_varlen_sdpa", attention.py, or flash attention). Experts may be split
  over the same ranks (group=the sequence group) or any group; with data-parallel replicas of
  the sequence group, average_gradients(model, expert_replica_group=...) also averages the
  slices over the replicas. SequenceParallelTrainerMixin (trainer.py) is the Trainer's loss
  under DeepSpeed sequence parallelism (accelerate ParallelismConfig(sp_backend="deepspeed")).

The optimizer is not patched: moepeak.StreamAdamW(model.parameters(), lr=...)
works in a plain loop, and with the Trainer as
Trainer(..., optimizers=(moepeak.StreamAdamW(model.parameters(), lr=...), None)).

Tested with transformers 5.17 (it uses the private
PreTrainedModel._set_gradient_checkpointing); other versions are refused.

Modules: apply (apply_moepeak), experts, loss, checkpoint, norms (the lean RMSNorms),
tiled (the tiled decoder layers), expert_parallel (the expert slices' gradients), report,
sequence (sequence parallelism's options, checks and shares), attention (moepeak_varlen_sdpa),
trainer (SequenceParallelTrainerMixin).

Public face (exported here, for users of transformers models): apply_moepeak and its
MoepeakReport; the families and layouts it handles (SUPPORTED_LAYOUTS, ExpertsLayout,
experts_layout, LOSS_FAMILIES, LEAN_NORMS, TILED_LAYERS, IMPLEMENTATION); the pieces usable
alone (causal_lm_loss, moepeak_experts_forward); for expert parallelism expert_slices,
average_gradients, clip_grad_norm_; for sequence parallelism SequenceOptions,
SequenceParallelTrainerMixin, sequence_aux_share, engine_sequence_group, and the packed-document
attention VARLEN_SDPA with register_varlen_sdpa. Everything else is internal to moepeak.hf.
"""
from .apply import apply_moepeak
from .attention import VARLEN_SDPA, register_varlen_sdpa
from .autoplace import place_model, placement_report
from .expert_parallel import average_gradients, clip_grad_norm_, expert_slices
from .experts import IMPLEMENTATION, SUPPORTED_LAYOUTS, ExpertsLayout, experts_layout, moepeak_experts_forward
from .loss import LOSS_FAMILIES, causal_lm_loss
from .norms import LEAN_NORMS
from .report import MoepeakReport
from .sequence import SequenceOptions, engine_sequence_group, sequence_aux_share
from .tiled import TILED_LAYERS
from .trainer import SequenceParallelTrainerMixin

__all__ = ["apply_moepeak", "place_model", "placement_report",
           "MoepeakReport", "ExpertsLayout", "SUPPORTED_LAYOUTS", "LOSS_FAMILIES", "LEAN_NORMS",
           "TILED_LAYERS", "experts_layout", "causal_lm_loss", "moepeak_experts_forward", "IMPLEMENTATION",
           "expert_slices", "average_gradients", "clip_grad_norm_", "SequenceOptions", "SequenceParallelTrainerMixin",
           "sequence_aux_share", "engine_sequence_group", "VARLEN_SDPA", "register_varlen_sdpa"]
