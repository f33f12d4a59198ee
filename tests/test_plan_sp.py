"""`moepeak plan --impl hf --sp {ulysses,ring}`: Hugging Face sequence parallelism
(apply_moepeak(sequence_group=...)), each term against its statement in moepeak/plan/model.py's
docstring, the pinned numbers of Qwen3-30B-A3B on 8 H200s (the README's 1M-token command), and
the flags' validation."""
import dataclasses
import re

import pytest

from moepeak import plan as P
from moepeak.plan import sequence as M

QWEN = P.PRESETS["Qwen3-30B-A3B"]
H200 = dict(gpus=8, gpu_mem_gib=139.8, impl="hf", tile_tokens=16384)


def _setup(**kw):
    return P.Setup(**{**H200, **kw})


def test_expert_params_of_qwen3_30b_a3b():
    # 48 layers x 128 experts x (gate, up, down) [768, 2048]: 28.99 B of the 30.53 B parameters
    assert M.expert_params(QWEN) == 48 * 128 * 3 * 2048 * 768
    assert M.expert_params(QWEN) / QWEN.params() == pytest.approx(0.9495, abs=1e-4)


def test_sequence_size_sets_the_tokens_per_rank_and_the_expert_group():
    s = _setup(sp="ulysses", sp_size=4)
    assert M.sequence_size(s) == 4 and M.expert_ranks(s) == 4 and M.shard_of(s) == "ddp"
    assert M.tokens_per_rank(s, 1 << 20) == 1 << 18
    assert M.tokens_per_rank(_setup(sp="ulysses"), 1 << 20) == 1 << 17
    assert M.shard_of(_setup(sp="ring")) == "fsdp2"
    assert M.expert_ranks(_setup(sp="ring", sp_size=4, ep_size=8)) == 8
    assert M.sequence_size(_setup()) == 8 and M.shard_of(_setup()) == "fsdp2"   # no --sp: as before


def test_ddp_holds_the_non_expert_weights_whole_and_its_buckets():
    """fixed under ddp: 2b((N - N_e) + N_e / P_ep) params + grads, DDP's buckets b (N - N_e), no
    gathered blocks; under fsdp2: 2bN/P + two gathered blocks, as without --sp."""
    c, b = 1 << 20, 2
    N, Ne = QWEN.params(), M.expert_params(QWEN)
    T = c // 8
    rope = T * (2 * b * QWEN.d() + 8)
    ddp = P.peaks(QWEN, _setup(sp="ulysses"), c, "moepeak")
    assert ddp["fixed"] == pytest.approx(2 * b * ((N - Ne) + Ne / 8) + b * (N - Ne) + rope)
    fsdp = P.peaks(QWEN, _setup(sp="ulysses", shard="fsdp2"), c, "moepeak")
    assert fsdp["fixed"] == pytest.approx(2 * b * N / 8 + 2 * b * QWEN.block_params(True) + rope)
    assert fsdp["fixed"] == pytest.approx(P.peaks(QWEN, _setup(), c, "moepeak")["fixed"])
    # the head phase holds the params and only the head's gradients (replicated under ddp)
    assert ddp["head_fixed"] == pytest.approx(ddp["fixed"] - b * ((N - Ne) + Ne / 8 - QWEN.vocab * 2048 - 2048))


def test_replicated_head_has_no_shard_ring_buffers():
    c, V, H, b = 1 << 20, QWEN.vocab, QWEN.hidden, 2
    ddp = P.peaks(QWEN, _setup(sp="ring", shard="ddp"), c, "moepeak")["vocab"]
    fsdp = P.peaks(QWEN, _setup(sp="ring"), c, "moepeak")["vocab"]
    assert ddp == pytest.approx(P.ring_dtp_vocab_bytes(c // 8, H, V, b))
    assert fsdp - ddp == pytest.approx(2 * (V // 8) * H * b + 4 * (V // 8) * H)


def test_attention_exchange_terms():
    """Ulysses: b(Qq + Qo + r(Kk + Kv)) per local token, r = max(1, S / nkv), one head group in
    the tiled layer; ring: (2b(Kk + Kv) + 4 Qo + 4 nh) / G, G = nkv tiled, 1 untiled."""
    b, d, nh, nkv = 2, 128, 32, 4
    Q, Kv = nh * d, nkv * d
    assert P.sequence_attention_bytes(QWEN, _setup(sp="ulysses"), b, True) == b * (2 * Q + 2 * 2 * Kv)  # S=8: r=2
    assert P.sequence_attention_bytes(QWEN, _setup(sp="ulysses", sp_size=4), b, True) == b * (2 * Q + 2 * Kv)
    assert P.sequence_attention_bytes(QWEN, _setup(sp="ring"), b, True) == (2 * b * 2 * Kv + 4 * Q + 4 * nh) / nkv
    assert P.sequence_attention_bytes(QWEN, _setup(sp="ring"), b, False) == 2 * b * 2 * Kv + 4 * Q + 4 * nh
    assert P.sequence_attention_bytes(QWEN, _setup(), b, True) == 0
    # the tiled block: the full-length tensors with the engine's head groups + the exchange + one tile
    c, T, t = 1 << 20, (1 << 20) // 8, 16384
    base = P.peaks(QWEN, _setup(), c, "moepeak")["block"] - T * P.tiled_full_len_bytes(QWEN, b)
    uly = P.peaks(QWEN, _setup(sp="ulysses"), c, "moepeak")["block"]
    assert uly == pytest.approx(T * (P.tiled_full_len_bytes(QWEN, b, 1) + b * (2 * Q + 4 * Kv)) + base)
    ring = P.peaks(QWEN, _setup(sp="ring"), c, "moepeak")["block"]
    assert ring == pytest.approx(T * (P.tiled_full_len_bytes(QWEN, b) + (4 * b * Kv + 4 * Q + 4 * nh) / nkv) + base)
    assert base == pytest.approx(t * (P.peaks(QWEN, _setup(tile_tokens=None), c, "moepeak")["block"] / T))


def test_host_state_is_replicated_under_ddp():
    """StreamAdamW: 12 B per local parameter, (N - N_e) + N_e / P_ep under ddp, N / P under fsdp2."""
    c, N, Ne = 1 << 20, QWEN.params(), M.expert_params(QWEN)
    ddp = P.host_bytes(QWEN, _setup(sp="ulysses"), c)
    assert ddp["optimizer_state"] == pytest.approx(12 * ((N - Ne) + Ne / 8))
    assert ddp["state_init"] == 2 * QWEN.vocab * QWEN.hidden   # the whole embedding, replicated
    fsdp = P.host_bytes(QWEN, _setup(sp="ulysses", shard="fsdp2"), c)
    assert fsdp["optimizer_state"] == pytest.approx(12 * N / 8)
    d2 = P.host_bytes(QWEN, _setup(sp="ulysses", sp_size=4), c)   # 2 replicas of 4: experts over 4
    assert d2["optimizer_state"] == pytest.approx(12 * ((N - Ne) + Ne / 4))
    assert d2["sco_boundaries"] > ddp["sco_boundaries"]           # 2x the tokens per rank


# Qwen3-30B-A3B, 8 H200s (139.8 GiB), 560 GiB host, 1M tokens, tiles of 16384 (README's command):
# GiB per GPU of the moepeak total, the longest context (GPU-bound; host-bound with the default
# keep_last; placed on GPU + host), RESULTS.md's table.
PINNED = [
    (dict(sp="ulysses"), 36.99, 9617408, 131072, 3194880),
    (dict(sp="ulysses", shard="fsdp2"), 31.42, 10082304, 698368, 3808256),
    (dict(sp="ring"), 25.61, 18733056, 698368, 4539392),
    (dict(sp="ring", shard="ddp"), 31.18, 17869824, 131072, 3807232),
]


@pytest.mark.parametrize("kw, total_gib, gpu_reach, host_reach, placed_reach", PINNED)
def test_qwen3_30b_a3b_on_8_h200s_pinned(kw, total_gib, gpu_reach, host_reach, placed_reach):
    s, c, host = _setup(**kw), 1 << 20, 560 * P.GiB
    assert round(P.peaks(QWEN, s, c, "moepeak")["total"] / P.GiB, 2) == total_gib
    assert P.longest_context(QWEN, s, "moepeak") == gpu_reach
    usable = P.Margins().host_room(host) / P.GiB
    assert P.longest_host_context(QWEN, s, usable, 8) == host_reach
    assert P.longest_placed_context(QWEN, s, gpu_bytes=139.8 * P.GiB, host_bytes=host, ranks_per_host=8) \
        == placed_reach


def test_cli_sp_report(capsys):
    assert P.main(["--preset", "Qwen3-30B-A3B", "--impl", "hf", "--gpus", "8", "--gpu-mem", "139.8",
                   "--context", "1048576", "--tile-tokens", "16384", "--sp", "ulysses", "--sp-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "(262144 tokens per GPU)" in out
    assert "sequence parallel: ulysses over 4 GPU(s) (2 replica(s)), non-expert weights ddp, experts over 4 GPU(s)" \
        in out


@pytest.mark.parametrize("argv, msg", [
    (["--sp", "ulysses"], "--sp models Hugging Face sequence parallelism: it needs --impl hf"),
    (["--impl", "hf", "--sp-size", "4"], "--sp-size needs --sp"),
    (["--impl", "hf", "--shard", "fsdp2"], "--shard needs --sp"),
    (["--impl", "hf", "--sp", "ring", "--sp-size", "3"], "--sp-size must be a positive integer dividing --gpus (8)"),
    (["--impl", "hf", "--sp", "ring", "--ep-size", "0"], "--ep-size must be a positive integer dividing --gpus (8)"),
    (["--impl", "hf", "--sp", "ulysses", "--heads", "40", "--kv-heads", "8", "--head-dim", "128", "--gpus", "16",
      "--sp-size", "16"], "--sp-size (16) must divide the attention heads (40)"),
    (["--impl", "hf", "--sp", "ulysses", "--heads", "48", "--kv-heads", "12", "--head-dim", "128"],
     "--sp-size (8) must divide the kv heads (12) or be a multiple of them"),
    (["--impl", "hf", "--sp", "ulysses", "--experts", "96", "--gpus", "64", "--sp-size", "8", "--ep-size", "64"],
     "--ep-size (64) must divide the experts (96)"),
])
def test_sp_bad_input(argv, msg, capsys):
    """One error line naming the bad flag, before anything is computed."""
    with pytest.raises(SystemExit) as e:
        P.main(["--preset", "Qwen3-30B-A3B"] + argv)
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("moepeak plan: error: ") and msg in line, line
    assert set(re.findall(r"--[a-z-]+", line)) == set(re.findall(r"--[a-z-]+", msg))


def test_setup_fields_checked_by_peaks():
    with pytest.raises(ValueError, match="sp must be one of"):
        P.peaks(QWEN, _setup(sp="megatron"), 4096, "moepeak")
    with pytest.raises(ValueError, match="shard must be one of"):
        P.peaks(QWEN, _setup(sp="ring", shard="zero3"), 4096, "moepeak")
    with pytest.raises(ValueError, match="it needs impl hf"):
        P.peaks(QWEN, dataclasses.replace(_setup(sp="ring"), impl="demo"), 4096, "moepeak")


def test_readme_sp_plan_command_runs_and_says_what_the_readme_says(capsys):
    readme = open(__file__.rsplit("/tests/", 1)[0] + "/README.md").read()
    lines = [ln for ln in readme.splitlines() if ln.startswith("python -m moepeak plan") and "--sp " in ln]
    assert len(lines) == 1
    assert P.main(lines[0].split()[4:]) == 0
    out = capsys.readouterr().out
    assert "total                           307.82       36.99" in out
    assert "longest context placed: 3194880 tokens" in out
