"""apply_moepeak's automatic placement (moepeak/hf/autoplace.py) on CPU with made-up machine
numbers (autoplace.measure monkeypatched): the plan's keep_last and arena reach SCO, explicit
settings win, a machine too small raises before the step allocates, T growth re-plans, and
without a GPU it does nothing and says so."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moepeak import plan as P  # noqa: E402
from moepeak.hf import apply_moepeak, autoplace, place_model, placement_report  # noqa: E402
from moepeak.sco import SCOConfig  # noqa: E402
from moepeak.sco import sizes as SCO  # noqa: E402
from tests.autoplace_helpers import fake_machine, host_room_between  # noqa: E402

G = P.GiB


def _model():
    torch.manual_seed(0)
    cfg = transformers.OlmoeConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                                   num_experts_per_tok=2, max_position_embeddings=4096)
    return transformers.OlmoeForCausalLM(cfg)


def test_model_shape_counts_the_models_parameters():
    model = _model()
    m = autoplace.model_shape(model)
    assert (m.layers, m.hidden, m.experts, m.top_k, m.intermediate, m.vocab) == (4, 64, 4, 2, 32, 128)
    assert m.params() == sum(p.numel() for p in model.parameters())


def test_the_plans_keep_last_and_arena_reach_sco(monkeypatch):
    model = _model()
    report = apply_moepeak(model)
    tokens = 1 << 20
    host = host_room_between(autoplace, model, tokens, 3, 2)
    fake_machine(monkeypatch, autoplace, 100 * G, host)
    p = place_model(model, tokens)
    expect = P.place(autoplace.model_shape(model), P.Setup(gpus=1, impl="hf", act_bytes=4), tokens,
                     gpu_bytes=100 * G, host_bytes=host)
    assert p.keep_last == expect.keep_last == 3 != SCO.KEEP_LAST
    cfg = report.sco.config
    assert (cfg.keep_last, cfg.arena_bytes) == (3, p.sco_options()["arena_bytes"])
    assert "host RAM is short" in placement_report(model) and "placement:" in str(report)


def test_explicit_settings_win(monkeypatch):
    model = _model()
    report = apply_moepeak(model, sco_config=SCOConfig(keep_last=0), tile_tokens=16)
    fake_machine(monkeypatch, autoplace, 100 * G, 200 * G)
    p = place_model(model, 1 << 20)
    assert p.keep_last == 0 and p.tile_tokens == 16
    assert report.sco.config == SCOConfig(keep_last=0)  # the given config stays as given
    # budgets given instead of measured: no measurement needed (here: no GPU)
    model = _model()
    apply_moepeak(model, gpu_budget_gib=100, host_budget_gib=200)
    monkeypatch.setattr(autoplace, "measure", lambda model: None)
    assert place_model(model, 4096).keep_last == SCO.KEEP_LAST
    with pytest.raises(ValueError, match="gpu_budget_gib must be a number of GiB > 0"):
        apply_moepeak(_model(), gpu_budget_gib=0)


def test_too_small_a_machine_raises_before_the_step(monkeypatch):
    model = _model()
    report = apply_moepeak(model)
    fake_machine(monkeypatch, autoplace, 100 * G, 9 * G)  # 9 GiB less the 8 GiB + 10% margin: nothing left
    before = report.sco.config
    with pytest.raises(P.PlacementError) as e:
        model.train()
        model(input_ids=torch.randint(0, 128, (1, 32)), labels=torch.randint(0, 128, (1, 32)))
    assert e.value.tier == "host" and "GiB short" in str(e.value)
    assert report.sco.config == before


def test_the_first_step_and_longer_ones_re_plan(monkeypatch):
    model = _model()
    report = apply_moepeak(model)
    calls = []

    def measure(model):  # later measures see the state and the arena taken: 1 GiB left
        calls.append(1)
        return 100 * G, (200 if len(calls) == 1 else 1) * G
    monkeypatch.setattr(autoplace, "measure", measure)
    model.train()
    for T, plans in ((32, 1), (32, 1), (16, 1), (64, 2)):
        ids = torch.randint(0, 128, (1, T))
        model(input_ids=ids, labels=ids).loss.backward()
        assert len(calls) == plans and report.placement.tokens == max(32, T)
    assert report.sco.config.keep_last == report.placement.placement.keep_last
    assert report.placement.host_measured == 200 * G
    with torch.no_grad():  # no training forward: no plan
        model.eval()
        model(input_ids=torch.randint(0, 128, (1, 128)))
    assert len(calls) == 2


def test_without_a_gpu_it_does_nothing_and_says_so():
    model = _model()
    report = apply_moepeak(model)
    assert place_model(model, 4096) is None
    assert "not on a GPU (no-op)" in placement_report(model) and "not on a GPU" in str(report)
    assert report.sco.config == SCOConfig()
    off = apply_moepeak(_model(), auto_placement=False)
    assert "auto_placement=False" in str(off)


def test_a_placed_step_equals_stock_transformers_on_packed_rows(monkeypatch):
    """Placement moves boundaries between tiers, never the arithmetic: a placed step (3 blocks
    kept on the GPU) on a packed row (position_ids restarting per document), accumulated over
    two micro-batches, gives stock transformers' loss and gradients (stock with its own activation
    checkpointing, as long-context runs use it: apply_moepeak checkpoints every layer too);
    frozen embeddings stay without a gradient."""
    stock, model = _model(), _model()
    enable = getattr(stock, "activation_checkpointing_enable", None) or stock.gradient_checkpointing_enable
    enable()
    for m in (stock, model):
        m.model.embed_tokens.weight.requires_grad_(False)
    report = apply_moepeak(model)
    tokens = 32
    fake_machine(monkeypatch, autoplace, 100 * G, host_room_between(autoplace, model, tokens, 3, 2))
    g = torch.Generator().manual_seed(1)
    pos = torch.cat([torch.arange(12), torch.arange(20)])[None]
    for m in (stock, model):
        m.train()
    losses = {}
    for name, m in (("stock", stock), ("placed", model)):
        g.manual_seed(1)
        total = 0.0
        for _ in range(2):
            ids = torch.randint(0, 128, (1, tokens), generator=g)
            loss = m(input_ids=ids, labels=ids, position_ids=pos).loss / 2
            loss.backward()
            total += loss.item()
        losses[name] = total
    assert report.sco.config.keep_last == 3
    torch.testing.assert_close(losses["placed"], losses["stock"], rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(stock.named_parameters(), model.named_parameters()):
        if not a.requires_grad:
            assert a.grad is None and b.grad is None, name
            continue
        scale = a.grad.abs().max().item() or 1.0
        assert (a.grad - b.grad).abs().max().item() <= 1e-4 * scale, name
