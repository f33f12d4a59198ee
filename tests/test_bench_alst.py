"""bench_hf.py's ALST arms (benchmarks/alst_arm.py) on CPU: DeepSpeed's TiledMLP over a
transformers MoE block and its TiledFusedLogitsLoss equal the untiled computations in fp32,
ArcticTraining's checkpoint-offload patch leaves gradients as they are, the first-step check
rule, the tiny arm end to end (DeepSpeed ZeRO-3 on gloo), the OLMoE model option and the
wheel list. The ALST tests need deepspeed and arctic_training (benchmarks/wheels.txt: not a
project dependency) and skip without them."""
import csv
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import alst_arm  # noqa: E402
import bench_hf  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps


def _ulps_close(got, want, ulps=8):
    """|got - want| <= ulps fp32 ulps of want's largest magnitude (the house rule for an
    fp32 computation whose summation order changed)."""
    tol = ulps * EPS32 * want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= tol, f"max |diff| {err:.3e} > {ulps} fp32 ulps of |want|max ({tol:.3e})"


def _ulysses():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.sequence_parallel import ulysses_sp
    return ulysses_sp


def _require_arctic_training():
    """Installed, not imported: its package __init__ needs the trainer stack (alst_arm loads
    the one file it uses)."""
    import importlib.util

    if importlib.util.find_spec("arctic_training") is None:
        pytest.skip("arctic_training is not installed (benchmarks/wheels.txt)")


def _tiny(family):
    return bench_hf.build_model(bench_hf.MODELS[family][3], 128, torch.float32, "cpu", family)


@pytest.mark.parametrize("family", sorted(bench_hf.MODELS))
def test_tiled_moe_block_equals_untiled_fp32(family):
    ulysses_sp = _ulysses()
    model = _tiny(family)
    block = model.model.layers[0].mlp
    torch.manual_seed(3)
    x = torch.randn(1, 40, model.config.hidden_size)
    g = torch.randn_like(x)
    router_calls = []
    block.gate.register_forward_hook(lambda *_: router_calls.append(1))

    def run():
        xx = x.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        y = block(xx)
        (y * g).sum().backward()
        return y.detach(), xx.grad, {n: p.grad.clone() for n, p in block.named_parameters()}

    y0, dx0, dp0 = run()
    assert len(router_calls) == 1
    assert alst_arm.tile_moe_blocks(model, ulysses_sp.TiledMLP, tokens_per_tile=16) == 2
    y1, dx1, dp1 = run()
    assert len(router_calls) == 1 + 3 + 3  # 40 tokens in tiles of 16, 16, 8: forward, then backward's recompute
    _ulps_close(y1, y0)
    _ulps_close(dx1, dx0)
    assert dp1.keys() == dp0.keys() and len(dp0) == 3  # router, gate_up, down
    for name in dp0:
        _ulps_close(dp1[name], dp0[name])


def test_tile_moe_blocks_refuses_a_model_without_moe_blocks():
    ulysses_sp = _ulysses()
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has no decoder layer whose mlp has a router"):
        alst_arm.tile_moe_blocks(transformers.Qwen3ForCausalLM(cfg), ulysses_sp.TiledMLP)
    with pytest.raises(ValueError, match="tokens_per_tile must be >= 1"):
        alst_arm.tile_moe_blocks(_tiny("qwen3_moe"), ulysses_sp.TiledMLP, tokens_per_tile=0)
    with pytest.raises(ValueError, match="tiles must be >= 1, got 0"):
        alst_arm.tiled_logits_loss(_tiny("qwen3_moe"), torch.zeros(1, 4, 64), torch.zeros(1, 4, dtype=torch.long),
                                   ulysses_sp.TiledFusedLogitsLoss, tiles=0)


def test_tiled_logits_loss_equals_the_models_loss_fp32():
    """5 tiles of 10 targets; tile 1 has only ignored targets (its 0/0 mean must not reach
    the sum), tile 3 a few, so the tiles' counts differ and the weighting matters."""
    ulysses_sp = _ulysses()
    model = _tiny("qwen3_moe")
    torch.manual_seed(4)
    hidden = torch.randn(1, 50, model.config.hidden_size)
    labels = torch.randint(0, model.config.vocab_size, (1, 50))
    labels[0, 11:21] = -100  # targets 10..19 (labels shifted left by one)
    labels[0, 33:36] = -100

    def run(tiled):
        h = hidden.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        if tiled:
            loss = alst_arm.tiled_logits_loss(model, h, labels, ulysses_sp.TiledFusedLogitsLoss, tiles=5)
        else:
            loss = model.loss_function(logits=model.lm_head(h), labels=labels, vocab_size=model.config.vocab_size)
        loss.backward()
        return loss.detach(), h.grad, model.lm_head.weight.grad.clone()

    want, got = run(False), run(True)
    assert torch.isfinite(got[0])
    _ulps_close(got[0], want[0])
    _ulps_close(got[1], want[1])
    _ulps_close(got[2], want[2])


def test_dividing_the_tiled_sum_afterwards_leaves_lm_head_at_the_sums_scale():
    """Why tiled_logits_loss weights each tile inside: ArcticTraining's form (count x mean per
    tile, "sum", the result divided by the count) scales the hidden states' gradient but
    leaves lm_head's, made inside TiledFusedLogitsLoss's forward, count times too large."""
    ulysses_sp = _ulysses()
    model = _tiny("qwen3_moe")
    torch.manual_seed(6)
    hidden = torch.randn(1, 40, model.config.hidden_size, requires_grad=True)
    labels = torch.randint(0, model.config.vocab_size, (1, 40))
    targets = alst_arm.shift_labels_of(labels)
    count = int((targets != -100).sum())

    def count_times_mean(lm, x, y):
        return lm.loss_function(logits=lm.lm_head(x), labels=None, vocab_size=lm.config.vocab_size,
                                shift_labels=y) * (y != -100).sum()

    loss = ulysses_sp.TiledFusedLogitsLoss.apply(count_times_mean, model, hidden, targets, None, 4,
                                                 [model.lm_head.weight], "sum") / count
    loss.backward()
    arctic_dw = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    model.loss_function(logits=model.lm_head(hidden.detach()), labels=labels,
                        vocab_size=model.config.vocab_size).backward()
    _ulps_close(arctic_dw / count, model.lm_head.weight.grad)


def test_logits_tiles_follow_arctic_trainings_one_gib_rule():
    assert alst_arm.logits_tiles(8192, 151936) == 5  # 4.64 GiB of fp32 logits
    assert alst_arm.logits_tiles(1, 10) == 1
    assert torch.equal(alst_arm.shift_labels_of(torch.tensor([[5, 6, 7]])), torch.tensor([[6, 7, -100]]))


def test_checkpoint_offload_patch_keeps_gradients(monkeypatch):
    """arctic_training's CheckpointFunction (the layer input kept on the host) under
    transformers' reentrant checkpointing: the same gradients as without checkpointing
    (on CPU the host copy is a copy; recompute repeats the same fp32 ops)."""
    _require_arctic_training()
    import torch.utils.checkpoint as ckpt

    patch = alst_arm.load_checkpoint_offload()
    monkeypatch.setattr(ckpt, "CheckpointFunction", ckpt.CheckpointFunction)  # restored after the test
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(5))

    def grads(checkpointed):
        model = _tiny("qwen3_moe")
        if checkpointed:
            patch.monkey_patch_checkpoint_function_with_cpu_offload()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    calls = []
    offloading_forward = patch.CheckpointFunctionWithCPUOffload.forward

    def counted_forward(ctx, *args):
        calls.append(1)
        return offloading_forward(ctx, *args)

    want = grads(False)
    monkeypatch.setattr(patch.CheckpointFunctionWithCPUOffload, "forward", staticmethod(counted_forward))
    got = grads(True)
    assert ckpt.CheckpointFunction is patch.CheckpointFunctionWithCPUOffload
    assert len(calls) == 2  # one per decoder layer
    for name in want:
        _ulps_close(got[name], want[name])


def test_check_first_step_rule():
    refs = dict(fp32=6.0, autocast=6.001, bf16=5.9995)  # bf16 noise 1e-3: ALST within 2e-3 of bf16 params
    assert alst_arm.check_first_step(6.0014, refs)[0]
    within, note = alst_arm.check_first_step(5.9974, refs)
    assert not within and "|ALST - stock bf16 params| 2.10e-03 > 2 x 1.00e-03 (bf16 noise)" in note, note
    liger = dict(refs, liger=6.003)  # Liger's kernels move the stock loss: ALST with them is compared to that
    assert alst_arm.check_first_step(6.0045, liger, same="liger")[0]
    assert not alst_arm.check_first_step(6.0045, liger)[0]
    assert not alst_arm.check_first_step(float("nan"), refs)[0]
    with pytest.raises(ValueError, match=r"refs lacks \['bf16'\]"):
        alst_arm.check_first_step(6.0, dict(fp32=6.0, autocast=6.0))
    with pytest.raises(ValueError, match=r"refs lacks \['liger'\]"):
        alst_arm.check_first_step(6.0, refs, same="liger")
    with pytest.raises(ValueError, match="same must be one of"):
        alst_arm.check_first_step(6.0, refs, same="fp32")


def test_alst_refuses_when_the_offloaded_state_exceeds_host_ram(monkeypatch, capsys):
    pytest.importorskip("deepspeed")
    _require_arctic_training()
    monkeypatch.setattr(bench_hf, "host_available", lambda: 2**20)  # 1 MiB < 2.4 MiB of state
    args = bench_hf.argparse.Namespace(model="qwen3_moe", check_T=64, alst_offload_param="cpu", T=[64], tiny=True)
    base = dict(arm="alst")
    assert bench_hf.setup_alst(args, "alst", bench_hf.TINY, "cpu", base) == (None, None)
    row = bench_hf.json.loads(capsys.readouterr().out.split("ROW ", 1)[1])
    params = 140160  # the tiny Qwen3-MoE
    assert (row["status"], row["T"], row["params"]) == ("oom", 64, params)
    assert row["note"] == (f"host: ZeRO-3 offloaded state {18 * params / 2**30:.1f} GiB of 0.0 GiB available: "
                           "refused before building anything")
    assert alst_arm.host_state_bytes(10, offload_param=False) == 160


def test_stock_losses_refuses_a_bf16_model():
    with pytest.raises(ValueError, match="the model must be fp32"):
        alst_arm.stock_losses(_tiny("qwen3_moe").to(torch.bfloat16), torch.zeros(1, 4, dtype=torch.long))


def _bench(args, tmp_path, timeout=600):
    out = tmp_path / "hf.csv"
    res = subprocess.run([sys.executable, "benchmarks/bench_hf.py", "--tiny", "--csv", str(out), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(out) as f:
        return list(csv.DictReader(f))


def test_bench_hf_tiny_alst_arm(tmp_path):
    """The whole arm on CPU (ZeRO-3 on gloo; torch AdamW on the offloaded state instead of
    DeepSpeedCPUAdam, whose JIT build takes minutes here): the check row matches stock
    transformers, then a step at each T."""
    pytest.importorskip("deepspeed")
    _require_arctic_training()
    rows = _bench(["--arms", "alst", "--T", "64", "--alst-optimizer", "torch"], tmp_path)
    assert [(r["arm"], r["T"], r["status"]) for r in rows] == [("alst", "64", "match"), ("alst", "64", "ok")], rows
    check, step = rows
    assert "bf16 autocast" in check["note"] and "TiledMLP over 2 MoE blocks (16 tokens a tile)" in check["note"]
    assert "TiledFusedLogitsLoss (3 tiles)" in check["note"] and "expandable_segments:True" in check["note"]
    assert float(step["step_s"]) > 0 and torch.isfinite(torch.tensor(float(step["loss"])))
    assert "first step" in step["note"] and int(step["params"]) == int(check["params"]) > 0


def test_bench_hf_olmoe_option(tmp_path):
    rows = _bench(["--model", "olmoe", "--arms", "hf,liger,alst_liger", "--T", "64"], tmp_path)
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["hf"]["status"] == "ok" and "(the process's first)" in by_arm["hf"]["note"]
    olmoe = bench_hf.build_model(bench_hf.OLMOE_TINY, 64, torch.float32, "meta", "olmoe")
    assert type(olmoe).__name__ == "OlmoeForCausalLM"
    assert int(by_arm["hf"]["params"]) == sum(p.numel() for p in olmoe.parameters())
    for arm in ("liger", "alst_liger"):
        assert (by_arm[arm]["status"], by_arm[arm]["note"]) == ("skipped", "liger_kernel has no patch for olmoe")


def test_olmoe_full_shape_is_olmoe_1b_7b():
    model = bench_hf.build_model(bench_hf.OLMOE_FULL, 4096, torch.float32, "meta", "olmoe")
    assert sum(p.numel() for p in model.parameters()) == 6_919_161_856  # OLMoE-1B-7B's parameter count
    with pytest.raises(ValueError, match="family must be one of"):
        bench_hf.build_model(bench_hf.TINY, 64, torch.float32, "meta", "mixtral")


def test_wheel_list_is_pinned_and_commented():
    names = {}
    with open(os.path.join(ROOT, "benchmarks", "wheels.txt")) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            spec, sep, comment = line.partition("#")
            assert sep and comment.strip(), f"wheels.txt: no comment on {line!r}"
            name, eq, version = spec.strip().partition("==")
            assert eq and name and version and " " not in spec.strip(), f"wheels.txt: not name==version: {line!r}"
            names[name] = version
    assert {"deepspeed": alst_arm.DEEPSPEED_VERSION, "arctic-training": "0.8.0", "liger-kernel": "0.8.5",
            "torchtitan": "0.3.0"}.items() <= names.items()
    res = subprocess.run(["bash", "-n", os.path.join(ROOT, "benchmarks", "fetch_wheels.sh")], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr
