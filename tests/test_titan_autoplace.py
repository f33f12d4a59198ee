"""moepeak.titan.sco's automatic placement (moepeak/titan/autoplace.py) on CPU with made-up
machine numbers (autoplace.measure monkeypatched, as tests/test_plan_autoplace.py does for
moepeak.hf): the plan's keep_last and arena reach SCO, tiles reach the blocks, explicit Config
fields win, a machine too small raises before the step allocates, T growth re-plans, and
without a GPU (or without StreamAdamW) it does nothing and says so on the 'moepeak' logger."""
from __future__ import annotations

import logging

import pytest
import torch

try:
    from tests.titan_utils import require_torchtitan
except ImportError:  # rootdir not on sys.path
    from titan_utils import require_torchtitan

require_torchtitan()

from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402

import moepeak.titan as mt  # noqa: E402
from moepeak import plan as P  # noqa: E402
from moepeak.plan.placement import TILE_TOKENS_CHOICES  # noqa: E402
from moepeak.sco import SCOConfig  # noqa: E402
from moepeak.sco import sizes as SCO  # noqa: E402
from moepeak.titan import autoplace  # noqa: E402
from tests.autoplace_helpers import fake_machine, host_room_between, tiles_only_gpu  # noqa: E402

G = P.GiB
V = 2048


class Job:
    """The small qwen3 MoE job of tests/test_titan.py with the sco override (its kwargs) and,
    unless stock_optimizer, stream_adamw; the SCO component kept as self.sco."""

    def __init__(self, stock_optimizer=False, device="cpu", **sco):
        cfg = mt.qwen3_moe_config(2, 8, 2, 64)
        cfg.optimizer.implementation = "fused"
        imports = [("moepeak.titan.sco", sco)] + ([] if stock_optimizer else ["moepeak.titan.stream_adamw"])
        apply_overrides(OverrideConfig(imports=imports), cfg)
        torch.manual_seed(0)
        with torch.device("meta"):
            model = cfg.model_spec.model.build()
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=None if device == "cpu" else torch.device(device))
        model.train()
        self.sco = cfg.activation_checkpoint.build()
        self.sco.apply(model)
        self.model = model
        self.optimizer = cfg.optimizer.build(model_parts=[model])

        self.device = device

    def step(self, tokens: int):
        ids = torch.randint(0, V, (1, tokens), device=self.device)
        self.model(ids).float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def test_model_shape_reads_the_torchtitan_model():
    job = Job()
    m = autoplace.model_shape(job.model)
    assert (m.layers, m.hidden, m.experts, m.top_k, m.intermediate, m.vocab) == (2, 256, 8, 2, 64, V)
    assert (m.heads, m.kv_heads, m.head_dim) == (16, 8, 128)
    assert m.params() == sum(p.numel() for p in job.model.parameters())


def test_the_plans_keep_last_and_arena_reach_sco(monkeypatch, caplog):
    job = Job()
    tokens = 1 << 20
    host = host_room_between(autoplace, job.model, tokens, 2, 1)
    fake_machine(monkeypatch, autoplace, 100 * G, host)
    with caplog.at_level(logging.INFO, logger="moepeak"):
        p = job.sco.placement.plan(tokens)
    expect = P.place(autoplace.model_shape(job.model), P.Setup(gpus=1, impl="hf", act_bytes=4), tokens,
                     gpu_bytes=100 * G, host_bytes=host)
    assert p.keep_last == expect.keep_last == 2 != SCO.KEEP_LAST
    cfg = job.sco.sco.config
    assert (cfg.keep_last, cfg.arena_bytes) == (2, expect.sco_options()["arena_bytes"])
    said = [r.getMessage() for r in caplog.records if "automatic placement" in r.getMessage()]
    assert len(said) == 1 and "host RAM is short" in said[0] and "keep_last:" in said[0], said


def test_whole_blocks_that_do_not_fit_are_tiled(monkeypatch):
    job = Job()
    tokens = 1 << 20
    m, s = autoplace.model_shape(job.model), P.Setup(gpus=1, impl="hf", act_bytes=4)
    gpus = [g * G for g in range(2, 200)]
    tiled = [g for g in gpus if _fits(m, s, tokens, g)
             and P.place(m, s, tokens, gpu_bytes=g, host_bytes=1e15).tile_tokens]
    assert tiled, "no GPU size where only tiles fit"
    fake_machine(monkeypatch, autoplace, tiled[0], 1e15)
    p = job.sco.placement.plan(tokens)
    assert p.tile_tokens in TILE_TOKENS_CHOICES
    assert [b._moepeak_tile_tokens for b in job.model.layers.values()] == [p.tile_tokens] * 2
    assert job.sco.tile_tokens == p.tile_tokens


def _fits(m, s, tokens, gpu):
    try:
        P.place(m, s, tokens, gpu_bytes=gpu, host_bytes=1e15)
        return True
    except P.PlacementError:
        return False


def test_explicit_fields_win(monkeypatch):
    fake_machine(monkeypatch, autoplace, 100 * G, 200 * G)
    job = Job(keep_last=0, tile_tokens=16)
    p = job.sco.placement.plan(1 << 20)
    assert p.keep_last == 0 and p.tile_tokens == 16
    assert job.sco.sco.config == SCOConfig(keep_last=0, arena_bytes=p.sco_options()["arena_bytes"])
    job = Job(arena_bytes=1 << 20)
    p = job.sco.placement.plan(1 << 20)
    assert job.sco.sco.config == SCOConfig(keep_last=p.keep_last, arena_bytes=1 << 20)
    given = Job(keep_last=0, arena_bytes=1 << 20, tile_tokens=16)  # nothing left to place
    assert given.sco.placement is None and not given.model._forward_pre_hooks
    off = Job(auto_placement=False)
    assert off.sco.placement is None and not off.model._forward_pre_hooks
    assert off.sco.sco.config == SCOConfig()
    with pytest.raises(ValueError, match="auto_placement must be a bool"):
        Job(auto_placement="yes")


def test_too_small_a_machine_raises_before_the_step(monkeypatch):
    job = Job()
    fake_machine(monkeypatch, autoplace, 100 * G, 9 * G)  # 9 GiB less the 8 GiB + 10% margin: nothing left
    before = job.sco.sco.config
    with pytest.raises(P.PlacementError) as e:
        job.step(64)
    assert e.value.tier == "host" and "GiB short" in str(e.value)
    assert job.sco.sco.config == before and job.sco.sco.stats()["offloads"] == 0


def test_the_first_step_and_longer_ones_re_plan(monkeypatch):
    job = Job()
    calls = fake_machine(monkeypatch, autoplace, 100 * G, 200 * G)
    for T, plans in ((32, 1), (32, 1), (16, 1), (64, 2)):
        job.step(T)
        assert len(calls) == plans and job.sco.placement.tokens == max(32, T)
    assert job.sco.sco.config.keep_last == job.sco.placement.placement.keep_last
    with torch.no_grad():  # no training forward: no plan
        job.model(torch.randint(0, V, (1, 128)))
    assert len(calls) == 2


def test_off_without_a_gpu_and_says_so_once(caplog):
    job = Job()
    with caplog.at_level(logging.INFO, logger="moepeak"):
        job.step(32)
        job.step(64)
    said = [r.getMessage() for r in caplog.records if "automatic placement" in r.getMessage()]
    assert said == ["moepeak.titan.sco: automatic placement off: the model is not on a GPU (no-op)"]
    assert job.sco.sco.config == SCOConfig()


def test_a_stock_optimizer_is_planned_with_its_state_on_the_gpu(monkeypatch):
    """torch's AdamW (not stream_adamw) keeps its state on the GPU: the plan counts all of it there
    (8 B per fp32 parameter: the moments) and none in host RAM, and says so; a GPU that cannot
    hold it beside the step refuses."""
    stock = Job(stock_optimizer=True)
    fake_machine(monkeypatch, autoplace, 100 * G, 200 * G)
    tokens = 4096
    p = stock.sco.placement.plan(tokens)
    N = sum(q.numel() for q in stock.model.parameters())
    m = autoplace.model_shape(stock.model)
    expect = P.place(m, P.Setup(gpus=1, impl="hf", act_bytes=4, device_state_gib=P.ALL_STATE_ON_GPU), tokens,
                     gpu_bytes=100 * G, host_bytes=200 * G)
    assert p.device_state_bytes == expect.device_state_bytes == 8 * N
    assert p.tiers["optimizer_state"] == {"gpu": 8 * N, "host": 0}
    assert p.reasons["optimizer_state"].startswith("on the GPU, all of it")
    assert "not moepeak.titan.stream_adamw: its state is counted on the GPU" in stock.sco.placement.note
    assert stock.sco.sco.config.keep_last == p.keep_last
    # a GPU one byte short of the step with the state on it: the step with StreamAdamW fits there
    gpu = (p.used["gpu"] - 1 + P.Margins().gpu_bytes) / (1 - P.Margins().gpu_fraction)
    assert P.place(m, P.Setup(gpus=1, impl="hf", act_bytes=4), tokens, gpu_bytes=gpu, host_bytes=200 * G)
    fake_machine(monkeypatch, autoplace, gpu, 200 * G)
    with pytest.raises(P.PlacementError) as e:
        Job(stock_optimizer=True).sco.placement.plan(tokens)
    assert e.value.tier == "gpu"


@pytest.mark.cuda
def test_cuda_step_is_placed_and_logged(caplog):
    """On a GPU the first step measures the machine, places it and logs the decision once."""
    job = Job(device="cuda")
    with caplog.at_level(logging.INFO, logger="moepeak"):
        job.step(4096)
        job.step(4096)
    p = job.sco.placement.placement
    assert p is not None and job.sco.sco.config.keep_last == p.keep_last
    assert job.sco.sco.config.arena_bytes == p.sco_options()["arena_bytes"]
    said = [r.getMessage() for r in caplog.records if "automatic placement" in r.getMessage()]
    assert len(said) == 1 and "4096 tokens on" in said[0] and "keep_last:" in said[0], said
    print(said[0])


def test_each_rank_places_its_share_and_never_picks_tiles(monkeypatch):
    """Under several ranks (job_ranks stood in for: 2 ranks, both on this host) a rank plans its
    own tokens with the parameters over the world and half the host; where only tiles fit and
    the Config gives no tile_tokens, TilesNeeded names it, before anything is applied."""
    monkeypatch.setattr(autoplace, "job_ranks", lambda tiles_agree: P.Ranks(2, 2, False, tiles_agree))
    job = Job()
    fake_machine(monkeypatch, autoplace, 100 * G, 200 * G)
    tokens = 4096
    p = job.sco.placement.plan(tokens)
    m = autoplace.model_shape(job.model)
    s = P.Setup(gpus=2, impl="hf", act_bytes=4)
    expect = P.place(m, s, 2 * tokens, gpu_bytes=100 * G, host_bytes=200 * G, ranks_per_host=2)
    assert (p.tokens, p.keep_last, p.used) == (tokens, expect.keep_last, expect.used)
    assert job.sco.sco.config.keep_last == p.keep_last and "one rank of 2" in job.sco.placement.note
    hi, tile = tiles_only_gpu(m, s, 2 << 16, ranks_per_host=2)
    fake_machine(monkeypatch, autoplace, hi, 1e15)
    fresh = Job()
    before = fresh.sco.sco.config
    with pytest.raises(P.TilesNeeded, match=rf"give tile_tokens={tile} in moepeak.titan.sco's Config"):
        fresh.sco.placement.plan(1 << 16)
    assert fresh.sco.sco.config == before and fresh.sco.tile_tokens is None


@pytest.mark.cuda
def test_cuda_step_with_a_stock_optimizer_is_placed():
    """On a GPU a job with torch's AdamW is placed with its state counted on the GPU."""
    job = Job(stock_optimizer=True, device="cuda")
    job.step(4096)
    p = job.sco.placement.placement
    assert p is not None and p.tiers["optimizer_state"]["host"] == 0
    assert job.sco.sco.config.keep_last == p.keep_last
    assert "its state is counted on the GPU" in job.sco.placement.note
    print(job.sco.placement.note)
