"""moepeak.plan.placement on synthetic machines: where each tensor class goes (GPU, host RAM,
disk), that each decision follows from the tier that is short, that what it places fits
every tier after its margin, and the error (with the numbers) when nothing fits."""
import dataclasses

import pytest

from moepeak import plan as P
from moepeak.plan import cli as plan_cli
from moepeak.sco import sizes as SCO

G = P.GiB
OLMOE = P.PRESETS["OLMoE-1B-7B"]
HF = P.Setup(gpus=1, impl="hf")
H200, HOST_125 = 139.8 * G, 125 * G  # issue 40's machine: one H200, 125 GiB of host RAM


def _fits(p: P.Placement):
    """What a placement uses fits each tier's room, and its classes add up to it."""
    for tier in P.placement.TIERS:
        if p.room[tier] is not None:
            assert p.used[tier] <= p.room[tier] + 1, (tier, p.used[tier], p.room[tier])
    assert p.keep_last + p.host_boundaries + p.disk_boundaries == OLMOE.layers
    assert p.used["host"] == pytest.approx(P.host_bytes(OLMOE, p.setup, p.context, disk_boundaries=p.disk_boundaries,
                                                        sized_arena=True)["total"])
    assert p.used["gpu"] == pytest.approx(P.peaks(OLMOE, p.setup, p.context, "moepeak")["total"])


def test_olmoe_shape_is_issue_40s():
    assert round(OLMOE.params() / 1e9, 2) == 6.92


def test_a_roomy_machine_keeps_the_defaults():
    p = P.place(OLMOE, HF, 131072, gpu_bytes=H200, host_bytes=HOST_125)
    _fits(p)
    assert (p.keep_last, p.host_boundaries, p.disk_boundaries) == (SCO.KEEP_LAST, OLMOE.layers - SCO.KEEP_LAST, 0)
    assert p.device_state_bytes == 0 and p.tile_tokens is None
    assert p.sco_options() == {"keep_last": SCO.KEEP_LAST,
                               "arena_bytes": p.host_boundaries * SCO.slot_bytes(p.boundary_bytes)}
    assert "default of the code running the layers" in p.reasons["keep_last"]


def test_gpu_rich_host_poor_keeps_boundaries_on_the_gpu():
    """Host RAM short, the GPU roomy: the last blocks keep their inputs (and then the leading
    elements their state) on the GPU; nothing goes to disk."""
    p = P.place(OLMOE, HF, 262144, gpu_bytes=H200, host_bytes=80 * G)
    _fits(p)
    assert p.keep_last == OLMOE.layers and p.disk_boundaries == 0
    assert p.device_state_bytes > 0 and "host RAM is short" in p.reasons["optimizer_state"]
    assert "host RAM is short" in p.reasons["keep_last"]
    # the same step on the roomy host keeps the default
    assert P.place(OLMOE, HF, 262144, gpu_bytes=H200, host_bytes=HOST_125).keep_last == SCO.KEEP_LAST


def test_both_poor_with_a_disk_spill_the_earliest_boundaries():
    p = P.place(OLMOE, HF, 1 << 20, gpu_bytes=80 * G, host_bytes=110 * G, disk_bytes=1000 * G)
    _fits(p)
    assert p.disk_boundaries > 0 and p.tile_tokens == 8192
    assert "go to disk" in p.reasons["disk"]
    opts = p.sco_options()
    assert opts["host_budget_bytes"] == opts["arena_bytes"] == p.host_boundaries * SCO.slot_bytes(p.boundary_bytes)
    # SCO's own tier split under that budget is the placement's: the earliest blocks on disk
    assert SCO.tiers(OLMOE.layers, p.keep_last, p.boundary_bytes, opts["host_budget_bytes"]) == \
        {"gpu": p.keep_last, "host": p.host_boundaries, "disk": p.disk_boundaries}
    assert p.tiers["boundaries"]["disk"] == p.disk_boundaries * SCO.spill_extent(p.boundary_bytes)
    # without the disk: the error names host RAM and its numbers
    with pytest.raises(P.PlacementError) as e:
        P.place(OLMOE, HF, 1 << 20, gpu_bytes=80 * G, host_bytes=110 * G)
    assert e.value.tier == "host" and e.value.need > e.value.room
    assert "no disk tier" in str(e.value) and "GiB short" in str(e.value)


def test_state_first_when_the_state_is_what_the_host_cannot_hold():
    """100 GiB of host cannot hold the 77 GiB of fp32 state beside the staging and a margin:
    the GPU's room goes to a device tail before more kept boundaries."""
    p = P.place(OLMOE, HF, 1 << 20, gpu_bytes=100 * G, host_bytes=100 * G, disk_bytes=1000 * G)
    _fits(p)
    assert p.device_state_bytes > 20 * G and p.disk_boundaries > 0


def test_nothing_fits_raises_with_the_numbers_before_anything():
    with pytest.raises(P.PlacementError) as e:
        P.place(OLMOE, HF, 1 << 20, gpu_bytes=40 * G, host_bytes=HOST_125, disk_bytes=1000 * G)
    msg = str(e.value)
    assert e.value.tier == "gpu" and "nothing fits at 1048576 tokens" in msg
    assert f"{e.value.need / G:.2f} GiB" in msg and f"{e.value.room / G:.2f} GiB after its margin" in msg
    with pytest.raises(P.PlacementError, match="parameters alone exceed the GPU"):
        P.place(P.PRESETS["DeepSeek-V3"], P.Setup(gpus=8), 131072, gpu_bytes=141 * G, host_bytes=2000 * G)
    with pytest.raises(P.PlacementError) as e:  # the disk too small for the spill
        P.place(OLMOE, HF, 1 << 20, gpu_bytes=80 * G, host_bytes=110 * G, disk_bytes=5 * G)
    assert e.value.tier in ("disk", "host")


def test_explicit_settings_are_kept():
    given = dataclasses.replace(HF, sco_keep_last=4, tile_tokens=4096, device_state_gib=2.0)
    p = P.place(OLMOE, given, 262144, gpu_bytes=H200, host_bytes=80 * G)
    assert (p.keep_last, p.tile_tokens) == (4, 4096) and p.reasons["keep_last"] == "4, as given"
    assert p.device_state_bytes >= 2 * G
    with pytest.raises(P.PlacementError, match="keep_last=16 \\(given\\)"):
        P.place(OLMOE, dataclasses.replace(HF, sco_keep_last=16), 1 << 20, gpu_bytes=80 * G, host_bytes=HOST_125)


def test_a_longer_sequence_re_plans():
    """T growth: the same machine places 256k with the defaults and 512k with more boundaries on
    the GPU (the host's 125 GiB less its margin no longer holds 15 boundaries of 2 GiB beside
    the state)."""
    short = P.place(OLMOE, HF, 262144, gpu_bytes=H200, host_bytes=HOST_125)
    long = P.place(OLMOE, HF, 524288, gpu_bytes=H200, host_bytes=HOST_125)
    _fits(short)
    _fits(long)
    assert short.keep_last == SCO.KEEP_LAST and long.keep_last > short.keep_last
    assert long.boundary_bytes == 2 * short.boundary_bytes == 2 * G


def test_issue_40s_512k_run_is_refused_by_the_host_plan_alone():
    """The OLMoE run that died at 512k: with every boundary but the last in host RAM (no
    placement), the host plan now refuses it on 125 GiB (the state's creation copy counted,
    the margin kept), where the old plan said 107.5 GiB fits."""
    h = P.host_bytes(OLMOE, HF, 524288)
    assert h["total"] > P.Margins().host_room(HOST_125)
    assert P.longest_host_context(OLMOE, HF, P.Margins().host_room(HOST_125) / G, 1) < 524288


def test_bf16_state_lengthens_the_host_bound_reach():
    """StreamAdamW(state_dtype=bf16): 8 instead of 12 B of host state per bf16 param: on a 125
    GiB host the OLMoE step's host-bound reach (every boundary but the last in host RAM)
    grows from 462,848 to 913,408 tokens (1.97x)."""
    room = P.Margins().host_room(HOST_125) / G
    fp32 = P.longest_host_context(OLMOE, HF, room, 1)
    bf16 = P.longest_host_context(OLMOE, dataclasses.replace(HF, state_dtype_bytes=2), room, 1)
    assert (fp32, bf16) == (462848, 913408)
    assert bf16 >= 1.5 * fp32


def test_qwen3_30b_on_8_gpus_and_560_gib_reach_by_tier():
    """benchmarks/RESULTS.md's table: Qwen3-30B-A3B, 8 H200s (141 GiB), one 560 GiB host."""
    m, s = P.PRESETS["Qwen3-30B-A3B"], P.Setup(gpus=8, impl="hf")
    bf16 = dataclasses.replace(s, state_dtype_bytes=2)
    room = P.Margins().host_room(560 * G) / G
    assert P.longest_host_context(m, s, room, 8) == 698368
    assert P.longest_host_context(m, bf16, room, 8) == 1048576
    kw = dict(gpu_bytes=141 * G, host_bytes=560 * G, ranks_per_host=8)
    placed, placed_bf16 = P.longest_placed_context(m, s, **kw), P.longest_placed_context(m, bf16, **kw)
    disk = P.longest_placed_context(m, bf16, disk_bytes=3500 * G, **kw)
    assert (placed, placed_bf16, disk) == (4706304, 5186560, 18941952)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="gpu_bytes must be a number of bytes > 0"):
        P.place(OLMOE, HF, 1024, gpu_bytes=0, host_bytes=HOST_125)
    with pytest.raises(ValueError, match="ranks_per_host must be an int >= 1"):
        P.place(OLMOE, HF, 1024, gpu_bytes=H200, host_bytes=HOST_125, ranks_per_host=0)
    with pytest.raises(ValueError, match="Margins.host_fraction"):
        P.Margins(host_fraction=1.5)
    with pytest.raises(TypeError, match="margins must be"):
        P.place(OLMOE, HF, 1024, gpu_bytes=H200, host_bytes=HOST_125, margins=0.1)


def test_cli_prints_the_placement(capsys):
    argv = ["plan", "--preset", "OLMoE-1B-7B", "--impl", "hf", "--gpus", "1", "--gpu-mem", "139.8",
            "--context", "524288", "--host-mem", "125"]
    from moepeak import cli
    assert cli.main(argv + ["--placement"]) == 0
    out = capsys.readouterr().out
    assert "placement of one step at 524288 tokens" in out and "keep_last: 3: host RAM is short" in out
    assert cli.main(argv + ["--disk-free", "1000", "--context", "2097152"]) == 0
    out = capsys.readouterr().out
    assert "on disk" in out and "disk 1000.0 GiB (--disk-free 1000)" in out


def test_machine_read_off_this_machine(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree: 1000 kB\nMemAvailable:   104857600 kB\n")
    ram = P.read_host_ram(str(meminfo))
    assert (ram.available, ram.total) == (104857600 * 1024, 131072000 * 1024)
    assert P.read_host_ram(str(tmp_path / "absent")) is None
    assert P.disk_free_bytes(str(tmp_path)) > 0
    with pytest.raises(ValueError, match="is not a directory"):
        P.disk_free_bytes(str(meminfo))
    a = plan_cli.build_parser().parse_args(["--preset", "OLMoE-1B-7B", "--host-mem", "125", "--gpus", "1"])
    m = plan_cli.machine_of(a, 1)
    assert (m.host_bytes, m.host_from, m.disk_bytes) == (125 * G, "--host-mem 125", None)
