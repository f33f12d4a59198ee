"""Fuzz: moepeak.sco_checkpoint against torch.utils.checkpoint (non-reentrant),
bitwise, over block stacks (depth, width, heads, dropout with its RNG, a
non-tensor argument, dtype, whether the input needs a gradient, gradient
accumulation over several backward passes, the disk tier with a host budget of
0 to 3 boundaries); and resource hygiene: SCO offloaders created, used and
dropped leave no threads, fds or memory.

Example counts: tests/conftest.py's hypothesis profile (MOEPEAK_FUZZ_EXAMPLES).
The issue-23 group at the end: torch checkpoint's behaviour that sco_checkpoint must match.
"""
import copy
import gc
import os
import tempfile
import threading

import pytest
import torch

import moepeak
from moepeak.sco import SCOConfig, SCOOffloader
from tests.refs import SCOBlock, sco_stack_forward

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402


@st.composite
def stacks(draw):
    nh = draw(st.sampled_from([1, 2, 3]))
    return dict(depth=draw(st.integers(1, 3)), h=nh * draw(st.sampled_from([1, 2, 4])), nh=nh,
                b=draw(st.integers(1, 2)), t=draw(st.sampled_from([1, 2, 3, 7])),
                dropout=draw(st.sampled_from([0.0, 0.25])), attention=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])),
                scale=draw(st.sampled_from([1.0, 0.5])), x_grad=draw(st.booleans()),
                passes=draw(st.integers(1, 2)), max_in_flight=draw(st.integers(1, 3)),
                prefetch=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**16)),
                host_slots=draw(st.sampled_from([None, 0, 1, 3])), spill_slots=draw(st.integers(1, 3)))


def _run(p, blocks, x, use_sco):
    spill = {}
    if p["host_slots"] is not None:  # the disk tier, host RAM for host_slots boundaries
        one = -(-p["b"] * p["t"] * p["h"] * p["dtype"].itemsize // 512) * 512
        spill = dict(spill_dir=tempfile.gettempdir(), host_budget_bytes=p["host_slots"] * one,
                     spill_slots=p["spill_slots"])
    sco = SCOOffloader(SCOConfig(max_in_flight=p["max_in_flight"], prefetch=p["prefetch"], **spill))
    outs = []
    for k in range(p["passes"]):
        torch.manual_seed(p["seed"] + k)  # same dropout masks in both runs
        if use_sco:
            y = x
            for blk in blocks:
                y = moepeak.sco_checkpoint(blk, y, scale=p["scale"], sco_offloader=sco)
        else:
            y = sco_stack_forward(blocks, x, mode="torch", scale=p["scale"])
        y.float().pow(2).mean().backward()
        outs.append(y.detach())
    if use_sco:
        assert sco.stats()["live"] == 0
        sco.free()
    return outs


@given(stacks())
def test_sco_checkpoint_bitwise_vs_torch_checkpoint(p):
    torch.manual_seed(p["seed"])
    ref = torch.nn.ModuleList([SCOBlock(p["h"], nh=p["nh"], dropout=p["dropout"], attention=p["attention"])
                               for _ in range(p["depth"])]).to(p["dtype"])
    ours = copy.deepcopy(ref)
    x0 = torch.randn(p["b"], p["t"], p["h"]).to(p["dtype"])
    xa, xb = x0.clone().requires_grad_(p["x_grad"]), x0.clone().requires_grad_(p["x_grad"])
    want = _run(p, ref, xa, use_sco=False)
    got = _run(p, ours, xb, use_sco=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b), f"output max diff {(a.float() - b.float()).abs().max().item()}"
    for (name, pa), (_, pb) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.equal(pa.grad, pb.grad), f"{name}: max diff {(pa.grad - pb.grad).abs().max().item()}"
    if p["x_grad"]:
        assert torch.equal(xb.grad, xa.grad)


def _resources():
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return threading.active_count(), fds, rss_pages * os.sysconf("SC_PAGE_SIZE")


def test_sco_offloaders_created_and_dropped_leave_no_resources():
    """200 SCO offloaders, each used for a forward + backward and dropped, every other one
    with the disk tier (a spill file and its I/O threads): no thread, fd or resident-memory
    growth (the arena, the spill file and the engines go with the offloader)."""
    x = torch.randn(2, 4, 8)
    count = [0]

    def one_config():
        count[0] += 1
        spill = dict(spill_dir=tempfile.gettempdir(), host_budget_bytes=0) if count[0] % 2 else {}
        sco = SCOOffloader(SCOConfig(**spill))
        y = moepeak.sco_checkpoint(torch.sin, x.clone().requires_grad_(True), sco_offloader=sco)
        y.sum().backward()
        assert sco.stats()["spilled"] == (1 if spill else 0)

    for _ in range(20):  # warm up allocator pools and lazy imports
        one_config()
    threads0, fds0, rss0 = _resources()
    for _ in range(200):
        one_config()
    threads1, fds1, rss1 = _resources()
    assert threads1 <= threads0, f"threads grew {threads0} -> {threads1}"
    assert fds1 <= fds0, f"fds grew {fds0} -> {fds1}"
    assert rss1 - rss0 < 16 << 20, f"resident memory grew by {(rss1 - rss0) / 2**20:.1f} MiB over 200 configs"


# ---------------------------------------------------------------------------
# Issue 23's SCO items: torch's checkpoint behaviour.
# ---------------------------------------------------------------------------

def test_inplace_change_of_saved_argument_is_detected():
    w = torch.randn(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = moepeak.sco_checkpoint(lambda a, m: (a @ m).sin(), x, w.requires_grad_(True), sco_offloader=SCOOffloader())
    with torch.no_grad():
        w.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_retain_graph_second_backward_accumulates():
    blk = SCOBlock(8, nh=2)
    ref = copy.deepcopy(blk)
    x = torch.randn(2, 3, 8)
    for model, use_sco in ((blk, True), (ref, False)):
        y = (moepeak.sco_checkpoint(model, x, sco_offloader=SCOOffloader()) if use_sco
             else sco_stack_forward([model], x, mode="torch"))
        y.sum().backward(retain_graph=True)
        y.sum().backward()
    for (n, a), (_, b) in zip(blk.named_parameters(), ref.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_keyword_only_tensor_arguments():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    y = moepeak.sco_checkpoint(lambda a=None, m=None: (a @ m).sin(), a=x, m=w, sco_offloader=SCOOffloader())
    y.sum().backward()
    xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    (xr @ wr).sin().sum().backward()
    assert torch.equal(w.grad, wr.grad) and torch.equal(x.grad, xr.grad)
