"""Ring-DTP's process group (moepeak/ring_dtp/ring.py's rings and ring="gather" use it):
the transport on the group (ring_transport), and the group's one exchange per call
(Geometry): every rank's shard rows, tokens, hidden size and dtype, label range, the
options every rank must pass alike (AGREED), and whether a rank refused its arguments
(refuse_on_group), so that a refusal or a mismatch on one rank raises on every rank and
none is left waiting in an exchange.
"""
from __future__ import annotations

import struct
import zlib
from typing import Optional

import torch

from ..core.abi import DTYPE_CODES
from ..core.process_groups import group_info
from ..core.transport import Transport
from ..core.transport_choice import get_transport, shared_nccl_transport


# What every rank of a group must pass alike: a difference in ring or the chunk sizes would
# make the ranks' exchanges differ (a hang), one in the loss options would mix the ranks'
# conventions (the activations ring applies its own to the others' tokens).
AGREED = ("ring", "ignore_index", "reduction", "label_smoothing", "z_loss", "softcap", "chunk_tokens",
          "chunk_vocab")
_ROW = 7 + len(AGREED)  # refused, V_r, T, H, dtype code, label min, label max, the AGREED codes


def agreed_options(options, ignore_index, reduction, label_smoothing, z_loss, softcap) -> dict:
    """The AGREED arguments of a call by name, as Geometry compares them: the schedule's from
    `options` (a RingDTPOptions; None sizes: 0), the loss definition's as given."""
    return dict(ring=options.ring, ignore_index=ignore_index, reduction=reduction,
                label_smoothing=float(label_smoothing), z_loss=float(z_loss), softcap=float(softcap or 0.0),
                chunk_tokens=options.chunk_tokens or 0, chunk_vocab=options.chunk_vocab or 0)


def _code(v) -> int:
    """An AGREED value as one int64: ints as themselves, floats by their bits, strings by crc32."""
    if isinstance(v, str):
        return zlib.crc32(v.encode())
    if isinstance(v, float):
        return struct.unpack("<q", struct.pack("<d", v))[0]
    return int(v)


def _decode(code: int, like):
    if isinstance(like, float):
        return struct.unpack("<d", struct.pack("<q", code))[0]
    return code if isinstance(like, int) else None


_NO_LABEL = ((1 << 63) - 1, -(1 << 63))  # (min, max) of a rank without labels to check


def _exchange(tr, row, device, labels: Optional[torch.Tensor] = None, ignore_index: int = -100) -> list:
    """Every rank's row (one all_gather of _ROW int64): the group's first exchange of a call.
    With labels, row[5:7] become their (min, max) leaving ignore_index out, made on the
    labels' device (no host sync before the exchange's own)."""
    out = torch.empty((tr.world_size, _ROW), dtype=torch.int64, device=device)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    if labels is not None and labels.numel():
        keep = labels != ignore_index
        mine[5] = torch.where(keep, labels, _NO_LABEL[0]).min()
        mine[6] = torch.where(keep, labels, _NO_LABEL[1]).max()
    tr.all_gather(out, mine)
    return out.tolist()


class Geometry:
    """Sizes of every rank, exchanged once: shard rows, offsets, token counts; the hidden
    size and dtype of the shards, which must agree (and the shards not all be empty); the
    range of each rank's labels (ignore_index left out); the AGREED options;
    and whether a rank refused its arguments (refuse_on_group). Every rank sees the same
    table, so a refusal, a mismatch or an out-of-range label on any rank raises on all of
    them, where a rank raising alone would leave the others waiting in the exchanges.
    (On CUDA the exchange is the call's one host sync; the label range adds none.)"""

    def __init__(self, tr, T: int, w: torch.Tensor, agreed: dict, labels: Optional[torch.Tensor] = None,
                 ignore_index: int = -100):
        if tuple(agreed) != AGREED:
            raise ValueError(f"moepeak: agreed must name {AGREED}, got {tuple(agreed)}")
        Vr, H = w.shape
        head = [0, Vr, T, H, DTYPE_CODES.get(w.dtype, -1)]
        codes = [_code(v) for v in agreed.values()]
        rows = _exchange(tr, head + [_NO_LABEL[0], _NO_LABEL[1]] + codes, w.device, labels, ignore_index)
        refused = [j for j, row in enumerate(rows) if row[0]]
        if refused:
            raise ValueError(f"moepeak: rank(s) {refused} of the group refused their arguments to "
                             f"linear_cross_entropy (the error raised there says why); every rank raises")
        differ = [(n, j) for j, n in enumerate(AGREED) if any(row[7 + j] != rows[0][7 + j] for row in rows)]
        if differ:
            per_rank = {n: ([_decode(row[7 + j], agreed[n]) for row in rows]
                            if _decode(0, agreed[n]) is not None else f"differs (this rank: {agreed[n]!r})")
                        for n, j in differ}
            raise ValueError(f"moepeak: every rank of the group must pass the same {', '.join(AGREED)}; "
                             f"per rank: {per_rank}")
        if any(row[3:5] != rows[0][3:5] for row in rows):
            raise ValueError(f"moepeak: the vocab shards of the group must have one hidden size and dtype; "
                             f"(H, dtype code {DTYPE_CODES}) per rank: {[tuple(row[3:5]) for row in rows]}")
        self.P, self.r = tr.world_size, tr.rank
        self.Vs = [row[1] for row in rows]
        self.Ts = [row[2] for row in rows]
        self.V = V = sum(self.Vs)
        if V < 1:
            raise ValueError("moepeak: the vocab shards of the group are all empty")
        bad = [(j, row[5], row[6]) for j, row in enumerate(rows) if row[5] <= row[6] and (row[5] < 0 or row[6] >= V)]
        if bad:
            raise ValueError(f"moepeak: labels must be in [0, {V}) or ignore_index={ignore_index}; "
                             f"(rank, min, max) of the ranks with others: {bad}")
        self.off = [0]
        for v in self.Vs[:-1]:
            self.off.append(self.off[-1] + v)
        self.Vmax, self.Tmax = max(self.Vs), max(self.Ts)


def refuse_on_group(error: BaseException, group, transport, device) -> None:
    """This rank's arguments failed their checks (`error`): take part in the group's first
    exchange flagged as refused, so that every other rank raises as well instead of waiting
    in it, then raise `error` here. Where no transport can be made for the group, `error`
    is raised at once."""
    try:
        tr = ring_transport(transport, group, device)
    except Exception:  # noqa: BLE001 (this rank's own error is the one to report)
        raise error from None
    _exchange(tr, [1] + [0] * (_ROW - 1), device)
    raise error


def ring_transport(transport, group, device):
    """The ring's transport: "auto" and "torch": torch.distributed on `group`; "nccl":
    moepeak's C NCCL transport, one communicator per (group, device) kept for the
    process; or a Transport instance, which must span the group. (The choice was
    checked by linear_cross_entropy, the only caller.)"""
    if isinstance(transport, Transport):
        info = group_info(group)
        if (transport.world_size, transport.rank) != (info.world_size, info.rank):
            raise ValueError(f"moepeak: the transport instance is rank {transport.rank} of "
                             f"{transport.world_size}, but this process is rank {info.rank} of the "
                             f"group's {info.world_size}")
        return transport
    if transport == "nccl":
        return shared_nccl_transport(group, device)
    return get_transport(group)
