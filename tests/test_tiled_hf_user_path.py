"""apply_moepeak(model, tile_tokens=N) on what users really run (issue 37): every case below
compares the tiled model with stock transformers on the same weights (the state dict copied into
a second instance) and the same inputs, by loss and every parameter's gradient.

Stock's checkpointing follows the tiled model's: transformers' own (gradient_checkpointing_enable)
where apply_moepeak installs SCO, none with checkpoint=False (stock then builds a KV cache in
training, as config.use_cache asks). fp32 tolerance: tests/test_tiled_hf.py's (1e-5 of each
tensor's largest entry)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moepeak.hf import tiled as hf_tiled  # noqa: E402
from moepeak.hf import apply_moepeak  # noqa: E402

V, B, T, TILE = 101, 2, 14, 5
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)


def qwen3_moe(**extra):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{**COMMON, **extra}, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2))


def qwen2_moe(**extra):
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **{**COMMON, **extra}, intermediate_size=48, moe_intermediate_size=32, num_experts=8,
        shared_expert_intermediate_size=32, num_experts_per_tok=2, qkv_bias=True))


def mixtral(**extra):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **{**COMMON, **extra}, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2))


def olmoe(**extra):  # q/k norms over the whole projection; clip_qkv small enough to clip
    common = {k: v for k, v in COMMON.items() if k != "head_dim"}
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **{**common, **extra}, intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=0.5))


def deepseek_v3(**extra):  # latent attention; layer 0 dense, layer 1 MoE
    common = {k: v for k, v in COMMON.items() if k not in ("head_dim", "num_key_value_heads")}
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**common, **extra}, num_key_value_heads=COMMON["num_attention_heads"], intermediate_size=64,
        moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16))


FAMILIES = {"qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe, "mixtral": mixtral, "olmoe": olmoe,
            "deepseek_v3": deepseek_v3}


def stock_and_tiled(build, tile=TILE, attn=None, **apply_options):
    """(stock, tiled): the same weights; tiled = apply_moepeak(copy, tile_tokens=tile, **apply_options);
    stock checkpoints with transformers' own function where the tiled one runs SCO."""
    torch.manual_seed(0)
    stock = build()
    with torch.no_grad():  # transformers initialises routers to zero (all routes tie)
        for name, p in stock.named_parameters():
            if ".gate.weight" in name:
                p.normal_(0, 1.0)
    tiled = type(stock)(copy.deepcopy(stock.config))
    tiled.load_state_dict(stock.state_dict())
    for m in (stock, tiled):
        if attn is not None:
            m.set_attn_implementation(attn)
        m.train()
    report = apply_moepeak(tiled, tile_tokens=tile, **apply_options)
    assert "tile_tokens: " in " ".join(report.patched), str(report)
    if apply_options.get("checkpoint", True):
        stock.gradient_checkpointing_enable()
    return stock, tiled


@pytest.fixture
def tiled_forwards(monkeypatch):
    """How many tiled layer forwards ran (hf_moe_layer_spec calls outside backward)."""
    count = {"n": 0}
    real = hf_tiled.hf_moe_layer_spec

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(hf_tiled, "hf_moe_layer_spec", counting)
    return count


def step(model, **inputs):
    """(output, {name: grad}) of one forward (inputs) and backward of its loss."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(want, got, rel=1e-5):
    """Loss, aux loss and every gradient of got equal want's within rel of each tensor's largest entry."""
    (out0, g0), (out1, g1) = want, got
    assert out1.loss.item() == pytest.approx(out0.loss.item(), rel=rel, abs=1e-6)
    a0, a1 = getattr(out0, "aux_loss", None), getattr(out1, "aux_loss", None)
    assert (a0 is None) == (a1 is None) and (a0 is None or a1.item() == pytest.approx(a0.item(), rel=rel, abs=1e-7))
    assert set(g0) == set(g1), set(g0) ^ set(g1)
    for n in g0:
        err = (g0[n] - g1[n]).abs().max().item()
        assert err <= rel * max(g0[n].abs().max().item(), 1e-6), (n, err, g0[n].abs().max().item())


def packed(lengths, seed=1):
    """One row of documents of the given lengths, as transformers' DataCollatorWithFlattening makes
    it (with flash attention's kwargs): input_ids, labels (-100 at each document's first token),
    position_ids, cu_seq_lens_q/k, max_length_q/k."""
    g = torch.Generator().manual_seed(seed)
    docs = [{"input_ids": torch.randint(0, V, (n,), generator=g).tolist()} for n in lengths]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(docs, return_tensors="pt")
    return dict(batch)


# ------------------------------------------------------------------ item 1: packed sequences

CORE_CALLS = []  # the kwargs of every call of the attention function below


def document_causal_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Flash-attention varlen semantics on the CPU: documents from cu_seq_lens_q (one packed row)
    or from position_ids (a new document wherever they restart at 0), causal within each; the
    attention mask is not read (transformers builds none for an implementation it does not know).
    Without either kwarg every row is one document, as flash attention then does."""
    CORE_CALLS.append(kwargs)
    b, h, t, _ = query.shape
    key = key.repeat_interleave(h // key.shape[1], dim=1)
    value = value.repeat_interleave(h // value.shape[1], dim=1)
    if kwargs.get("cu_seq_lens_q") is not None:
        doc = torch.bucketize(torch.arange(t), kwargs["cu_seq_lens_q"][1:].cpu(), right=True).expand(b, t)
    elif kwargs.get("position_ids") is not None:
        doc = (kwargs["position_ids"] == 0).cumsum(-1).expand(b, t)
    else:
        doc = torch.zeros(b, t, dtype=torch.long)
    allowed = torch.ones(t, t, dtype=torch.bool).tril() & (doc[:, :, None] == doc[:, None, :])
    scores = (query @ key.transpose(-1, -2)) * scaling
    out = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ value
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("moepeak_test_document_causal", document_causal_attention)


def _same_kwargs(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        assert (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]), k


@pytest.mark.parametrize("checkpoint", [True, False])
@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_packed_documents_reach_the_attention_function(checkpoint, flash_kwargs, tiled_forwards):
    """Packed rows under flash-attention-like semantics: the attention function of every tiled
    core call gets exactly the kwargs stock's gets (position_ids, use_cache, cu_seq_lens_q/k,
    max_length_q/k, ...), so documents do not attend across each other; equal loss and grads."""
    stock, tiled = stock_and_tiled(qwen3_moe, attn="moepeak_test_document_causal", checkpoint=checkpoint)
    if flash_kwargs:  # DataCollatorWithFlattening(return_flash_attn_kwargs=True): one packed row
        inputs = packed([5, 1, 7, 3])
    else:  # two rows, position_ids restarting per document
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, V, (B, T), generator=g)
        pos = torch.tensor([[*range(5), *range(6), *range(3)], [*range(9), *range(5)]])
        inputs = dict(input_ids=ids, labels=ids, position_ids=pos)
    CORE_CALLS.clear()
    want = step(stock, **inputs)
    stock_calls = list(CORE_CALLS)
    CORE_CALLS.clear()
    got = step(tiled, **inputs)
    assert tiled_forwards["n"] >= 2
    assert stock_calls and CORE_CALLS
    for call in CORE_CALLS:  # forward and backward recompute, per head group
        _same_kwargs(stock_calls[0], call)
    assert_same(want, got)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_sdpa_and_eager(attn, tiled_forwards):
    """transformers' own packing without flash attention: DataCollatorWithFlattening's position_ids,
    no attention_mask; masking_utils finds the documents in position_ids and the mask carries them."""
    stock, tiled = stock_and_tiled(qwen3_moe, attn=attn)
    inputs = packed([6, 4, 9, 2])
    inputs = {k: inputs[k] for k in ("input_ids", "labels", "position_ids")}
    want, got = step(stock, **inputs), step(tiled, **inputs)
    assert tiled_forwards["n"] >= 2
    assert_same(want, got)
    # the documents are really separate: the same tokens as one document give another loss
    one_doc = step(stock, input_ids=inputs["input_ids"], labels=inputs["labels"])
    assert abs(one_doc[0].loss.item() - want[0].loss.item()) > 1e-4


# ------------------------------------------------------------------ item 2: autocast


def _autocast_step(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()  # outside autocast, as torch's AMP recipe has it
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpoint", [True, False])
@pytest.mark.parametrize("tile", [T, TILE])
def test_autocast_backward_recomputes_under_the_forward_autocast(checkpoint, tile):
    """fp32 weights, bf16 autocast forward, backward outside autocast. Every router call of the
    tiled backward's recompute sees what the forward's saw (bf16 logits, the same top-k experts),
    and the gradients are those of stock's bf16 function: with one tile equal to fp32 rounding,
    with several within 2 bf16 ulps of each tensor's largest entry (the weight gradients are sums
    of per-tile bf16 products in fp32 instead of one bf16 product: stock's own rounding is 1 ulp).
    Without the saved autocast state the recompute ran in fp32: 1.2-1.8% off here (other
    routing on real models: the 9-15% of issue 37). lean_norm=False: the lean norms' backward
    rounds differently from stock's under autocast (~1 ulp), which is not what this checks."""
    stock, tiled = stock_and_tiled(lambda: qwen3_moe(output_router_logits=True, router_aux_loss_coef=1.0), tile=tile,
                                   checkpoint=checkpoint, lean_norm=False)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    calls = []
    for layer in tiled.model.layers:
        def record(m, args, out, i=layer.self_attn.layer_idx):
            calls.append((i, torch.is_grad_enabled(), out[0], out[2]))
        layer.mlp.gate.register_forward_hook(record)
    want, got = _autocast_step(stock, ids), _autocast_step(tiled, ids)
    for i in range(len(tiled.model.layers)):
        forward = [c for c in calls if c[0] == i and not c[1]]  # tiles in order
        recompute = [c for c in calls if c[0] == i and c[1]][::-1]  # backward runs them last first
        assert len(forward) == len(recompute) == -(-T // tile)
        for (_, _, logits_f, experts_f), (_, _, logits_r, experts_r) in zip(forward, recompute):
            assert logits_r.dtype == logits_f.dtype == torch.bfloat16
            assert torch.equal(logits_r, logits_f) and torch.equal(experts_r, experts_f)
    assert_same(want, got, rel=1e-5 if tile >= T else 2 ** -7)


# ------------------------------------------------------------------ item 5: output_attentions


def test_output_attentions_eager_returns_the_maps_without_gradient_path(tiled_forwards):
    """eager attention, output_attentions=True in training: one [B, heads, T, T] map per layer,
    equal to stock's (the forward's per-head-group weights, concatenated); loss and grads unchanged;
    a loss on the maps raises, naming output_attentions (the tiled forward keeps no graph of them)."""
    stock, tiled = stock_and_tiled(qwen3_moe, attn="eager")
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    want = step(stock, input_ids=ids, labels=ids, output_attentions=True)
    got = step(tiled, input_ids=ids, labels=ids, output_attentions=True)
    assert tiled_forwards["n"] >= 2
    assert_same(want, got)
    maps0, maps1 = want[0].attentions, got[0].attentions
    assert len(maps0) == len(maps1) == 2
    for a, b in zip(maps0, maps1):
        assert a.shape == b.shape == (B, COMMON["num_attention_heads"], T, T)
        assert (a - b).abs().max().item() <= 1e-6
    with pytest.raises(RuntimeError, match="output_attentions"):
        maps1[1].sum().backward()


def test_output_attentions_sdpa_gives_none_like_stock():
    stock, tiled = stock_and_tiled(qwen3_moe, attn="sdpa")
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    want = step(stock, input_ids=ids, labels=ids, output_attentions=True)
    got = step(tiled, input_ids=ids, labels=ids, output_attentions=True)
    assert want[0].attentions == got[0].attentions == ()
    assert_same(want, got)


# ------------------------------------------------------------------ item 7: inputs without grad, frozen parts


@pytest.mark.parametrize("checkpoint", [True, False])
def test_layer_input_without_grad(checkpoint, tiled_forwards):
    """inputs_embeds made under no_grad: layer 0's input needs no gradient; every parameter but the
    embedding gets stock's gradient."""
    stock, tiled = stock_and_tiled(qwen3_moe, checkpoint=checkpoint)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        embeds = stock.model.embed_tokens(ids)
    want = step(stock, inputs_embeds=embeds, labels=ids)
    got = step(tiled, inputs_embeds=embeds, labels=ids)
    assert tiled_forwards["n"] >= 2
    assert "model.embed_tokens.weight" not in got[1]
    assert_same(want, got)


@pytest.mark.parametrize("checkpoint", [True, False])
def test_frozen_parts(checkpoint, tiled_forwards):
    """LoRA-style freezing: the embedding, all of layer 0 (its input and weights then need no
    gradient: it runs without a graph) and layer 1's projections and experts are frozen; the
    trainable rest (layer 1's norms and router, the final norm, lm_head) gets stock's gradients."""
    stock, tiled = stock_and_tiled(qwen3_moe, checkpoint=checkpoint)
    for model in (stock, tiled):
        for name, p in model.named_parameters():
            frozen = name.startswith(("model.embed_tokens", "model.layers.0.")) or \
                (name.startswith("model.layers.1.") and ("_proj" in name or "experts" in name))
            p.requires_grad_(not frozen)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(6))
    want, got = step(stock, input_ids=ids, labels=ids), step(tiled, input_ids=ids, labels=ids)
    assert tiled_forwards["n"] >= 2
    assert "model.layers.1.mlp.gate.weight" in got[1] and "model.layers.1.self_attn.q_proj.weight" not in got[1]
    assert_same(want, got)


# ------------------------------------------------------------------ item 8: dense layers with router logits


@pytest.mark.parametrize("build", [
    lambda: qwen3_moe(num_hidden_layers=3, mlp_only_layers=[0]),
    lambda: qwen3_moe(num_hidden_layers=4, decoder_sparse_step=2),
    lambda: qwen2_moe(num_hidden_layers=3, mlp_only_layers=[1]),
    deepseek_v3,
], ids=["qwen3_mlp_only_layers", "qwen3_decoder_sparse_step", "qwen2_mlp_only_layers", "deepseek_v3"])
@pytest.mark.parametrize("checkpoint", [True, False])
def test_dense_layers_with_router_logits(build, checkpoint, tiled_forwards):
    """Dense layers of a tiled family are tiled too and hand no router logits, as stock's give none:
    the same router logits (one per MoE layer), aux loss (weight 1.0), loss and gradients."""
    stock, tiled = stock_and_tiled(build, checkpoint=checkpoint)
    for model in (stock, tiled):
        model.router_aux_loss_coef = 1.0
    n_layers = stock.config.num_hidden_layers
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(7))
    want = step(stock, input_ids=ids, labels=ids, output_router_logits=True)
    got = step(tiled, input_ids=ids, labels=ids, output_router_logits=True)
    assert tiled_forwards["n"] >= n_layers
    # (transformers 5.17's DeepSeek-V3 output has no router_logits field)
    logits0, logits1 = getattr(want[0], "router_logits", None), getattr(got[0], "router_logits", None)
    assert (logits0 is None) == (logits1 is None)
    if logits0 is not None:
        assert 0 < len(logits0) == len(logits1) < n_layers
        for a, b in zip(logits0, logits1):
            assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
    assert_same(want, got)


# ------------------------------------------------------------------ item 9: checkpointing off, KV cache


@pytest.mark.parametrize("how", ["checkpoint=False", "gradient_checkpointing_disable"])
def test_training_without_checkpointing_ignores_the_models_own_cache(how, tiled_forwards):
    """Checkpointing off and config.use_cache True: transformers hands every layer a fresh
    DynamicCache and use_cache=True in training. The tiled layers train like stock (loss, grads)
    and leave that cache empty (stock fills it with every layer's k, v; nothing reads them)."""
    if how == "checkpoint=False":
        stock, tiled = stock_and_tiled(qwen3_moe, checkpoint=False)
    else:
        stock, tiled = stock_and_tiled(qwen3_moe)
        stock.gradient_checkpointing_disable()
        tiled.gradient_checkpointing_disable()
    assert tiled.config.use_cache
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(8))
    want, got = step(stock, input_ids=ids, labels=ids), step(tiled, input_ids=ids, labels=ids)
    assert tiled_forwards["n"] >= 2
    assert_same(want, got)
    assert want[0].past_key_values.get_seq_length(0) == T  # stock wrote its cache
    assert got[0].past_key_values.get_seq_length(0) == 0


def test_a_cache_with_tokens_in_training_is_refused_by_name():
    """Generation-style: a cache holding earlier tokens, passed to a training forward with grad
    and checkpointing off: a clear error naming the argument (the tiled layer cannot attend to it)."""
    _, tiled = stock_and_tiled(qwen3_moe, checkpoint=False)
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():  # the layers' own forward fills the cache
        cache = tiled(input_ids=ids, use_cache=True).past_key_values
    assert cache.get_seq_length(0) == T
    with pytest.raises(ValueError, match=fr"cannot attend to {T} cached tokens of layer 0 \((cache|past_key_values)\)"):
        tiled(input_ids=ids[:, :4], past_key_values=cache, labels=ids[:, :4])


# ------------------------------------------------------------------ every family, with SCO and without


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("checkpoint", [True, False])
def test_families_padding_free_with_and_without_sco(family, checkpoint, tiled_forwards):
    """What TRL's SFTTrainer passes with packing / padding_free: one packed row, position_ids and no
    attention_mask. Every family, with apply_moepeak's SCO checkpointing (each tiled layer then runs
    under it: its input is SCO's offloaded boundary) and without checkpointing: stock's loss and
    gradients."""
    stock, tiled = stock_and_tiled(FAMILIES[family], checkpoint=checkpoint)
    checkpointed = []
    for layer in tiled.model.layers:
        if checkpoint:
            real = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = lambda *a, _real=real, **k: checkpointed.append(1) or _real(*a, **k)
    inputs = packed([5, 9, 4, 6], seed=10)
    inputs = {k: inputs[k] for k in ("input_ids", "labels", "position_ids")}
    want, got = step(stock, **inputs), step(tiled, **inputs)
    assert tiled_forwards["n"] >= 2
    assert len(checkpointed) == (2 if checkpoint else 0)
    assert_same(want, got)
