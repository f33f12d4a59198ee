"""Shared by the automatic-placement tests of moepeak.hf, moepeak.titan and the demo: a machine
stood in for by fixed numbers, and host RAM sized between two placements."""
from __future__ import annotations

import dataclasses

from moepeak import plan as P


def fake_machine(monkeypatch, autoplace_module, gpu, host):
    """`autoplace_module.measure` returns (gpu, host) bytes; the list returned records each call."""
    calls = []

    def measure(target):
        calls.append(target)
        return gpu, host
    monkeypatch.setattr(autoplace_module, "measure", measure)
    return calls


def host_room_between(autoplace_module, model, tokens, keep_more, keep_fewer):
    """Host bytes (before the margin) whose room holds the step with keep_more blocks' inputs
    on the GPU but not with keep_fewer (the hf setup's host formula for the model's shape)."""
    m = autoplace_module.model_shape(model)
    s = P.Setup(gpus=1, impl="hf", act_bytes=4)
    lo = P.host_bytes(m, dataclasses.replace(s, sco_keep_last=keep_more), tokens, sized_arena=True)["total"]
    hi = P.host_bytes(m, dataclasses.replace(s, sco_keep_last=keep_fewer), tokens, sized_arena=True)["total"]
    M = P.Margins()
    return ((lo + hi) / 2 + M.host_bytes) / (1 - M.host_fraction)


def tiles_only_gpu(m, s, context, ranks_per_host=1):
    """(GPU bytes, tile): the smallest GPU (within 1 KiB) on which place() fits the step, and the
    tile it picks there; checked that whole blocks do not fit on it."""
    def fits(gpu, tiles=True):
        try:
            return P.place(m, s, context, gpu_bytes=gpu, host_bytes=1e15, ranks_per_host=ranks_per_host, tiles=tiles)
        except P.PlacementError:
            return None
    lo, hi = 2.11 * P.GiB, 400 * P.GiB  # the GPU margin (5% + 2 GiB) leaves ~5 MiB of lo
    assert fits(hi) and not fits(lo)
    while hi - lo > 1024:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    tile = fits(hi).tile_tokens
    assert tile and not fits(hi, tiles=False), "whole blocks fit wherever tiles do"
    return hi, tile
