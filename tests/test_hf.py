"""moepeak.hf.apply_moepeak on tiny random-init transformers models (CPU).

The reference is the same model unpatched: transformers' eager experts, torch's
checkpoint (gradient_checkpointing_enable), the full-logits loss,
torch.optim.AdamW. fp32 is compared tightly; bf16 against an fp64 run of the
reference with docs/design.md's rule (moepeak's error at most 2x transformers' own at
bf16). Integer routing (top_k_index of every experts call) must be identical."""
import copy
from csv import DictReader
import json
import os
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moepeak  # noqa: E402
from moepeak.hf import MoepeakReport, apply_moepeak  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, T, B = 97, 12, 2
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)


def qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                      num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
    return transformers.Qwen3MoeForCausalLM(cfg)


def mixtral():
    cfg = transformers.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                     output_router_logits=True, router_aux_loss_coef=0.02)
    return transformers.MixtralForCausalLM(cfg)


def deepseek_v3():
    cfg = transformers.DeepseekV3Config(
        **{k: v for k, v in COMMON.items() if k != "head_dim"}, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, rope_scaling=None)
    return transformers.DeepseekV3ForCausalLM(cfg)


def gpt_oss():
    cfg = transformers.GptOssConfig(**COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                    output_router_logits=True, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"])
    return transformers.GptOssForCausalLM(cfg)


FAMILIES = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss}
OPTS = dict(chunk_rows=32, norm_chunk_tokens=7)  # T*K = 48 picks: two chunks per call; B*T = 24 norm rows:
# four chunks, the last partial


def assert_final_norm_report(report):
    lean = [p for p in report.patched if p.startswith("final norm:")]
    assert lean and "moepeak.norms.rms_norm" in lean[0] and "chunks of 7 tokens" in lean[0], str(report)
    layers = [p for p in report.patched if p.startswith("layer norms:")]  # with checkpoint (SCO)
    assert layers and "in 2 decoder layers run moepeak.norms.rms_norm" in layers[0], str(report)


def build(family, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    # transformers initialises the router weights to zero (all routes tie); random ones make routing real
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".gate.weight" in name or ".router.weight" in name:
                p.normal_(0, 1.0)
    return model.to(dtype)


def reference(model):
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    ref.gradient_checkpointing_enable()
    return ref


def batches(seed=1, steps=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, V, (B, T), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100  # some ignored positions
        out.append((ids, labels))
    return out


def record_routing(model):
    """top_k_index of every experts call (forward and checkpoint recompute)."""
    seen = []
    for m in model.modules():
        if hasattr(m, "has_gate") and hasattr(m, "gate_up_proj"):
            m.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone()))
    return seen


def train(model, opt, data):
    model.train()
    losses = []
    for ids, labels in data:
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach())
    return torch.stack(losses), {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close(name, got, want, rtol, atol):
    err = (got.double() - want.double()).abs()
    assert torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol), \
        f"{name}: max diff {err.max().item():.3g} mean {err.mean().item():.3g}"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("optim", ["adamw", "stream"])
def test_three_steps_fp32_equal_unpatched(family, optim):
    model = build(family)
    ref = reference(model)
    report = apply_moepeak(model, **OPTS)
    assert isinstance(report, MoepeakReport)
    assert report.experts_on_moepeak and not report.experts_fallback, str(report)
    assert_final_norm_report(report)
    assert "forward" in vars(model.model.norm)
    if optim == "adamw":
        opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    else:
        opt = moepeak.StreamAdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    routes, ref_routes = record_routing(model), record_routing(ref)
    data = batches()
    losses, params = train(model, opt, data)
    ref_losses, ref_params = train(ref, ref_opt, data)
    assert len(routes) == len(ref_routes) > 0
    for a, b in zip(routes, ref_routes):
        assert torch.equal(a, b), "integer routing differs"
    assert_close("loss", losses, ref_losses, 1e-5, 1e-6)
    for n, p in params.items():
        assert_close(n, p, ref_params[n], 1e-4, 2e-5)


def _errors(params, truth):
    d = torch.cat([(params[n].double() - truth[n]).abs().flatten() for n in truth])
    return d.max().item(), d.mean().item()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_three_steps_bf16_within_twice_torch_error(family):
    model = build(family, torch.bfloat16)
    ref = reference(model)
    truth = reference(model).double()
    report = apply_moepeak(model, **OPTS)
    assert report.experts_on_moepeak and not report.experts_fallback, str(report)
    assert_final_norm_report(report)
    data = batches()
    losses, params = train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), data)
    ref_losses, ref_params = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data)
    true_losses, true_params = train(truth, torch.optim.AdamW(truth.parameters(), lr=1e-3), data)
    ours, theirs = _errors(params, true_params), _errors(ref_params, true_params)
    assert ours[0] <= 2 * theirs[0] + 1e-6 and ours[1] <= 2 * theirs[1] + 1e-7, \
        f"params vs fp64: moepeak max/mean {ours}, transformers bf16 {theirs}"
    ours_l = (losses.double() - true_losses).abs().max().item()
    theirs_l = (ref_losses.double() - true_losses).abs().max().item()
    assert ours_l <= 2 * theirs_l + 1e-3, f"loss vs fp64: moepeak {ours_l:.3g}, transformers bf16 {theirs_l:.3g}"


def test_state_dict_and_save_pretrained_round_trip(tmp_path):
    model = build("qwen3_moe")
    before = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    apply_moepeak(model, **OPTS)
    after = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    assert list(before) == list(after) and before == after
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches(steps=1))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "moepeak" not in json.dumps(config)
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    assert getattr(loaded, "_moepeak_hf", None) is None
    saved, back = model.state_dict(), loaded.state_dict()
    assert list(saved) == list(back)
    for k in saved:
        assert torch.equal(saved[k], back[k]), k


def test_inference_and_eval_unchanged():
    model = build("mixtral")
    ref = reference(model)
    apply_moepeak(model, **OPTS)
    ids, labels = batches(steps=1)[0]
    model.eval(), ref.eval()
    with torch.no_grad():
        got, want = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert got.logits is not None and got.logits.shape == (B, T, V)
    assert_close("eval loss", got.loss, want.loss, 1e-5, 1e-6)
    assert_close("eval logits", got.logits, want.logits, 1e-4, 1e-5)
    model.train()
    out = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].ndim == 0  # (loss, aux_loss, ...): no logits


def test_loss_num_items_and_shift_labels_match_transformers():
    model = build("qwen3_moe")
    ref = reference(model)
    apply_moepeak(model, experts=False, checkpoint=False)
    ids, labels = batches(steps=1)[0]
    n = torch.tensor(17)
    for kw in (dict(labels=labels, num_items_in_batch=n),
               dict(labels=labels, shift_labels=torch.roll(labels, -1, 1)),
               dict(labels=labels, output_router_logits=False)):
        got = model(input_ids=ids, **kw).loss
        want = ref(input_ids=ids, **kw).loss
        assert_close(f"loss {sorted(kw)}", got, want, 1e-5, 1e-6)


@pytest.mark.parametrize("case", ["one_token", "all_ignored", "all_ignored_num_items_tensor_0",
                                  "all_ignored_num_items_int_0"])
@pytest.mark.parametrize("ce_mode", ["vocab_outer", "fused"])
def test_no_target_token_is_transformers_nan(case, ce_mode):
    """No label left after the shift (T = 1, or every label -100): transformers' loss is NaN
    (0 / 0; with num_items_in_batch = 0 the sum / 0) and its gradients are the router aux
    loss's alone (the cross-entropy's are zeros, whatever flows into it). moepeak's equal."""
    model = build("qwen3_moe")
    ref = reference(model)
    apply_moepeak(model, ce_mode=ce_mode, **OPTS)
    ids, labels = batches(steps=1)[0]
    kw = {}
    if case == "one_token":
        ids, labels = ids[:, :1], ids[:, :1]
    else:
        labels = torch.full_like(ids, -100)
    if case.endswith("tensor_0"):
        kw["num_items_in_batch"] = torch.tensor(0)
    elif case.endswith("int_0"):
        kw["num_items_in_batch"] = 0
    model.train(), ref.train()
    got, want = model(input_ids=ids, labels=labels, **kw), ref(input_ids=ids, labels=labels, **kw)
    assert want.loss.isnan() and got.loss.isnan(), (got.loss, want.loss)
    got.loss.backward()
    want.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert any(g.abs().sum() > 0 for n, g in grads.items() if ".gate." in n)  # the aux loss reached the routers
    for n, p in model.named_parameters():
        want_g = grads.get(n, torch.zeros_like(p))
        assert_close(f"grad {n}", p.grad if p.grad is not None else torch.zeros_like(p), want_g, 1e-5, 1e-7)


@pytest.mark.parametrize("keep_last", [0, 2])
def test_sco_keep_last_keeps_the_last_layers_inputs(keep_last):
    model = build("qwen3_moe")
    cfg = moepeak.SCOConfig(keep_last=keep_last)
    report = apply_moepeak(model, experts=False, loss=False, sco_config=cfg)
    assert report.sco_config is cfg and report.sco.config is cfg
    layers = [m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]
    kept = [report.sco.keeps(m._gradient_checkpointing_func.keywords["sco_block_from_end"]) for m in layers]
    assert kept == [False] * (len(layers) - keep_last) + [True] * keep_last
    ids, labels = batches(steps=1)[0]
    model(input_ids=ids, labels=labels).loss.backward()
    st = report.sco.stats()
    assert st["kept"] == keep_last and st["offloads"] == len(layers) - keep_last
    # the automatic placement moves the line between steps (SCOOffloader.reconfigure)
    other = len(layers) - keep_last
    report.sco.reconfigure(keep_last=other)
    model(input_ids=ids, labels=labels).loss.backward()
    st2 = report.sco.stats()
    assert st2["kept"] - st["kept"] == other and st2["offloads"] - st["offloads"] == len(layers) - other


def test_gradient_checkpointing_enable_installs_sco():
    model = build("qwen3_moe")
    report = apply_moepeak(model, experts=False, loss=False)
    layers = [m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]

    def funcs():
        return [getattr(m._gradient_checkpointing_func, "func", None) for m in layers]

    assert all(m.gradient_checkpointing for m in layers)
    assert funcs() == [moepeak.sco_checkpoint] * len(layers)
    assert report.sco.keeps(layers[-1]._gradient_checkpointing_func.keywords["sco_block_from_end"])
    model.gradient_checkpointing_disable()
    assert not any(m.gradient_checkpointing for m in layers)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=True)
    assert funcs() == [moepeak.sco_checkpoint] * len(layers)
    out = model(input_ids=batches(steps=1)[0][0], labels=batches(steps=1)[0][1])
    out.loss.backward()
    assert report.sco.stats()["offloads"] >= len(layers) - 1


def test_each_part_can_be_turned_off():
    model = build("qwen3_moe")
    report = apply_moepeak(model, experts=False, loss=False, checkpoint=False, attention_backend=None)
    assert report.patched == [] and len(report.left_alone) == 4
    assert model.config._experts_implementation == "grouped_mm"
    assert "forward" not in vars(model) and not model.is_gradient_checkpointing
    eager_norm = build("qwen3_moe")
    report = apply_moepeak(eager_norm, experts=False, checkpoint=False, lean_norm=False)
    assert "final norm: turned off (lean_norm=False)" in report.left_alone
    assert "forward" not in vars(eager_norm.model.norm) and "forward" in vars(eager_norm)
    eager_layers = build("qwen3_moe")
    report = apply_moepeak(eager_layers, experts=False, loss=False, lean_norm=False)
    assert not any(p.startswith("layer norms:") for p in report.patched), str(report)
    assert not any("forward" in vars(m) for m in eager_layers.modules() if "RMSNorm" in type(m).__name__)


def test_a_final_norm_not_in_lean_norms_is_left_alone():
    model = build("qwen3_moe")
    norm = model.model.norm
    model.model.norm = type("MyRMSNorm", (type(norm),), {})(norm.weight.shape[0], eps=norm.variance_epsilon)
    report = apply_moepeak(model, experts=False, checkpoint=False)
    assert any(p.startswith("final norm: MyRMSNorm is not in moepeak.hf.LEAN_NORMS") for p in report.left_alone), \
        str(report)
    assert "forward" not in vars(model.model.norm)


def test_apply_twice_is_a_clear_error():
    model = build("qwen3_moe")
    apply_moepeak(model)
    with pytest.raises(RuntimeError, match="already applied"):
        apply_moepeak(model)


def test_bad_input():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        apply_moepeak(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="unknown option"):
        apply_moepeak(build("qwen3_moe"), chunk_row=8)
    with pytest.raises(TypeError, match="sco_config"):
        apply_moepeak(build("qwen3_moe"), sco_config="yes")
    with pytest.raises(ValueError, match="norm_chunk_tokens must be a positive integer"):
        apply_moepeak(build("qwen3_moe"), norm_chunk_tokens=0)


def test_unsupported_activation_falls_back_with_reason():
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                      num_experts_per_tok=2, hidden_act="gelu")
    model = transformers.Qwen3MoeForCausalLM(cfg)
    ref = reference(model)
    report = apply_moepeak(model, loss=False, checkpoint=False)
    assert not report.experts_on_moepeak and "gate='GELUActivation'" in str(report), str(report)
    ids, labels = batches(steps=1)[0]
    model.train(), ref.train()
    assert_close("loss", model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss,
                 1e-5, 1e-6)


def test_unsupported_family_loss_left_alone():
    cfg = transformers.Qwen3Config(**COMMON, intermediate_size=48)
    report = apply_moepeak(transformers.Qwen3ForCausalLM(cfg))
    text = str(report)
    assert "no module uses transformers' experts registry" in text and "LOSS_FAMILIES" in text, text


def test_trainer_three_steps_with_stream_adamw(tmp_path):
    pytest.importorskip("accelerate")  # transformers' Trainer needs it
    data = [{"input_ids": ids[i], "labels": labels[i]} for ids, labels in batches(steps=1) for i in range(B)]

    def run(model, optimizer):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=B,
                                              logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                              gradient_checkpointing=True, disable_tqdm=True, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None))
        assert trainer.model_accepts_loss_kwargs
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    model = build("qwen3_moe")
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    apply_moepeak(model, **OPTS)
    got = run(model, moepeak.StreamAdamW(model.parameters(), lr=1e-3))
    layer = model.model.layers[0]
    assert layer._gradient_checkpointing_func.func is moepeak.sco_checkpoint  # the Trainer's enable kept SCO
    want = run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True))
    assert len(got) == len(want) == 3
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)


def _readme_example():
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## With Hugging Face transformers", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "README's transformers section has no python example"
    return blocks[0]


def test_readme_example_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_readme_example())
    res = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stdout + res.stderr


def test_bench_hf_tiny_runs(tmp_path):
    csv = tmp_path / "hf.csv"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_hf.py"), "--tiny",
                          "--arms", "hf,hf_offload,moepeak",
                          "--csv", str(csv)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stdout + res.stderr
    assert csv.read_text().startswith("timestamp,gpu,torch,moepeak,commit,")
    with open(csv) as f:
        rows = list(DictReader(f))
    ok = {r["arm"] for r in rows if r["status"] == "ok" and float(r["step_s"]) > 0 and r["loss"]}
    if torch.cuda.is_available():
        assert {"hf", "hf_offload", "moepeak"} <= ok, rows
    else:  # save_on_cpu pins host memory
        assert {"hf", "moepeak"} <= ok, rows
        assert [r["status"] for r in rows if r["arm"] == "hf_offload"] == ["skipped"], rows


def test_bench_hf_layers_and_manual_keep_last(tmp_path):
    """--layers builds the family's shape with that many decoder layers (issue 40's 1M step on 4
    of OLMoE's 16); --sco-keep-last runs the moepeak arm with SCOConfig(keep_last=...) by hand,
    the manual setting the default placement is compared with; --attention auto the opt-in
    attention backend and head groups; bad values name the flag."""
    csv = tmp_path / "hf.csv"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_hf.py"), "--tiny", "--model", "olmoe",
           "--arms", "moepeak_tiled", "--T", "64", "--layers", "1", "--sco-keep-last", "1", "--attention", "auto",
           "--tile-tokens", "16", "--csv", str(csv)]
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(csv) as f:
        (row,) = list(DictReader(f))
    assert row["status"] == "ok" and row["note"].startswith("1 layers; manual keep_last 1; attention auto; "), row
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_hf

    one_layer = dict(bench_hf.OLMOE_TINY, num_hidden_layers=1)
    model = bench_hf.build_model(one_layer, 64, torch.float32, "meta", "olmoe")
    assert int(row["params"]) == sum(p.numel() for p in model.parameters())
    for flag, value, says in (("--layers", "0", "at least 1 decoder layer"), ("--sco-keep-last", "-1", ">= 0")):
        res = subprocess.run(cmd[:2] + ["--tiny", flag, value, "--csv", str(csv)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env=env)
        assert res.returncode == 2 and flag in res.stderr and says in res.stderr, res.stderr
