"""The bucket plans of StreamAdamW's pipeline: the layout of a fixed list of CUDA params in
buckets of fp32-master elements, and its C pipeline with the pinned slot rings
(moepeak._C.adamw_plan_create). Sizes: moepeak.stream_adamw.sizes.

A plan is made by the optimizer at its first CUDA step (and again only when the layout of
its params changes); the op moepeak::stream_adamw names it by an int id, since a torch op
takes no Python objects: LIVE_PLANS maps ids to the plans alive (weakly: a plan dies with
its optimizer, and its pinned slots with it)."""
from __future__ import annotations

import array
import itertools
import weakref

import torch

from .. import _C
from ..core.abi import ADAMW_SEGMENT_ROW, BYTES_OF_CODE
from .sizes import bucket_elements, segment_bytes

# id -> plan, for the op; each optimizer takes a fresh id from PLAN_IDS
LIVE_PLANS: "weakref.WeakValueDictionary[int, BucketPlan]" = weakref.WeakValueDictionary()
PLAN_IDS = itertools.count(1)


class BucketPlan:
    """Bucket layout of a fixed list of CUDA params and its C pipeline.

    key: (numels, grad dtype codes, param dtype codes), one entry per param.
    segs: [nseg, 5] int64, rows of abi.ADAMW_SEGMENT_ROW (a piece of one param and its byte
    offsets in the pinned grad / param slots); bucket_seg: [nb + 1]. Worked example, bucket_mb = 64
    (16 Mi fp32 elements per bucket), bf16 params of 40 Mi + 3 x 2 Mi
    elements: buckets = [16Mi of p0], [16Mi of p0], [8Mi of p0 + 3 x 2Mi],
    so nb = 3; gslot_bytes = pslot_bytes = 32 MiB; pinned = 3 x 32 + 2 x 32
    = 160 MiB whatever the model size. host=True: the same schedule on CPU
    tensors, memcpy for the copies, nothing pinned (tests).
    """

    def __init__(self, key, device, bucket_mb, grad_slots, param_slots, host=False):
        numels, gdts, ldts = key
        segs, bucket_seg, gmax, pmax = self._layout(numels, [BYTES_OF_CODE[c] for c in gdts],
                                                    [BYTES_OF_CODE[c] for c in ldts], bucket_elements(bucket_mb))
        self.key = key
        self.nparam = len(numels)
        self.nbuckets = len(bucket_seg) - 1
        self.pinned_bytes = 0 if host else grad_slots * gmax + param_slots * pmax
        args = (array.array("q", segs), array.array("q", bucket_seg), len(numels), gmax, pmax, grad_slots,
                param_slots, host)
        if host:
            self.capsule = _C.adamw_plan_create(*args)
        else:
            with torch.cuda.device(device):
                self.capsule = _C.adamw_plan_create(*args)

    @staticmethod
    def _layout(numels, grad_bytes, param_bytes, per_bucket):
        """Params in order, split at bucket boundaries, small ones packed: (segs, bucket_seg,
        largest grad slot bytes, largest param slot bytes)."""
        segs, bucket_seg = [], [0]
        cur = goff = poff = gmax = pmax = 0
        for i, n in enumerate(numels):
            off = 0
            while off < n:
                take = min(n - off, per_bucket - cur)
                segs += ADAMW_SEGMENT_ROW.row(param=i, first=off, numel=take, grad_slot_offset=goff,
                                              param_slot_offset=poff)
                goff += segment_bytes(take, grad_bytes[i])
                poff += segment_bytes(take, param_bytes[i])
                gmax, pmax = max(gmax, goff), max(pmax, poff)
                cur += take
                off += take
                if cur == per_bucket:
                    bucket_seg.append(len(segs) // ADAMW_SEGMENT_ROW.width)
                    cur = goff = poff = 0
        if cur > 0:
            bucket_seg.append(len(segs) // ADAMW_SEGMENT_ROW.width)
        return segs, bucket_seg, gmax, pmax


def plan_for(plan_id, key, device, bucket_mb, grad_slots, param_slots, host) -> BucketPlan:
    """The live plan plan_id if it has this key, else a new one (not registered: a call
    without a live plan pays for its slots itself)."""
    plan = LIVE_PLANS.get(plan_id) if plan_id > 0 else None
    if plan is not None and plan.key == key:
        return plan
    return BucketPlan(key, device, bucket_mb, grad_slots, param_slots, host)


def register(plan_id: int, plan: BucketPlan) -> BucketPlan:
    LIVE_PLANS[plan_id] = plan
    return plan

