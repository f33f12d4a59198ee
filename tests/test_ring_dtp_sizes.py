"""moepeak.ring_dtp.sizes' byte formulas, the ones `moepeak plan` is to read: auto_peak_bytes
follows the schedule the op's auto picks, with each schedule's buffers, and its fp32 block is
the one the fused schedule allocates (4 bytes per logit, dZ made in place).
"""
import pytest
import torch

from moepeak.ring_dtp import MODES, sizes as S
from moepeak.ring_dtp import blocks as B
from moepeak.ring_dtp import sched


def test_auto_peak_bytes_worked_example():
    assert S.auto_peak_bytes(32768, 4096, 151936, 2) == (2048 * 151936 * 2 + 2 * 32768 * 4096 + 32 * 32768
                                                         + 4 * 32768 + 4 * 151936 + 6 * 4096 + 2 * 2048)
    assert round(S.auto_peak_bytes(32768, 4096, 151936, 2) / 2 ** 20, 1) == 851.2


@pytest.mark.parametrize("H,V", [(4096, 151936), (1024, 65536), (2048, 256000), (64, 1000)])
def test_auto_peak_bytes_follow_the_ops_choice(H, V):
    for T in (1, 2048, 32768, 40960, 40961, 131072, 300000):
        mode = sched.pick_mode(MODES["auto"], True, 1, T, H, V, torch.bfloat16)
        got = S.auto_peak_bytes(T, H, V, 2)
        ct = S.fused_chunk_tokens(V, 2, lowp_logits=True)
        if mode == MODES["fused_lowp"]:
            assert got == min(ct, T) * V * 2 + 2 * T * H + 32 * T + S.fused_extra_bytes(T, H, V, 2, ct), (T, mode)
        elif mode == MODES["vocab_outer"]:
            assert got == S.BLOCKED_WORKSPACE_BYTES + 6 * T * H + 32 * T, (T, mode)
        else:
            assert mode == MODES["vocab_outer_lowp"], (T, mode)
            cv = min(V, S.lowp_dx_block_cols(V, H))
            assert got == S.BLOCKED_WORKSPACE_BYTES + 4 * cv * H + 2 * T * H + 32 * T + 4 * T, (T, mode)
        # fp32: always fused, one fp32 block
        ct32 = S.fused_chunk_tokens(V, 0)
        assert S.auto_peak_bytes(T, H, V, 4) == min(ct32, T) * V * 4 + 4 * T * H + 32 * T


class _NewStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """The byte sizes of the new storages the aten ops return while active."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(a, torch.Tensor)}
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in ins:
                self.sizes.append(o.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("T", [7, 40])
def test_fp32_fused_block_is_four_bytes_per_logit(T):
    """The fp32 schedule auto runs (fused, gradients in forward) holds one [min(ct, T), V] fp32
    block: its largest buffer is 4 bytes per logit, as auto_peak_bytes counts (not 8)."""
    H, V = 16, 3000
    x, w = torch.randn(T, H), torch.randn(V, H)
    y = torch.randint(0, V, (T,))
    ct = 32  # T = 40: two chunks, the block is [32, V]
    with _NewStorages() as seen:
        sched.fused(x, w, None, y, -100, 0.0, 0.0, 0.0, torch.ones(1), ct, lowp_logits=False, dw_finish=True,
                    center_chunks=8, fused_colsum=True)
    sizes = list(seen.sizes)
    sizes.remove(V * H * 4)                             # dW (the parameter's gradient: not counted)
    assert max(sizes) == min(ct, T) * V * 4             # the block; nothing else of its size
    assert sorted(sizes)[-2] < min(ct, T) * V * 4
    assert B.lowp_bytes(torch.float32) == 0 and S.fused_chunk_tokens(V, 0) >= 64
