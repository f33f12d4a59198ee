"""moepeak.titan.compat: the torch names torchtitan 0.3 needs, added only where missing."""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as fsdp

try:  # the module lives in moepeak.titan, whose import needs torchtitan (after adding these names)
    from moepeak.titan.compat import provide_missing_torch_names
except ImportError as e:
    pytest.skip(f"moepeak.titan is not importable here: {e}", allow_module_level=True)


def test_adds_only_what_is_missing_and_is_idempotent(monkeypatch):
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    monkeypatch.delattr(dist, "set_timeout", raising=False)
    assert provide_missing_torch_names() == ["torch.distributed.fsdp.DataParallelMeshDims",
                                             "torch.distributed.set_timeout"]
    mesh_dims, set_timeout = fsdp.DataParallelMeshDims, dist.set_timeout
    assert provide_missing_torch_names() == []  # present now: nothing replaced
    assert fsdp.DataParallelMeshDims is mesh_dims and dist.set_timeout is set_timeout
    assert mesh_dims(shard="dp_shard").shard == "dp_shard"


def test_keeps_a_torch_that_has_them(monkeypatch):
    sentinel_cls, sentinel_fn = type("DataParallelMeshDims", (), {}), (lambda timeout, group=None: None)
    monkeypatch.setattr(fsdp, "DataParallelMeshDims", sentinel_cls, raising=False)
    monkeypatch.setattr(dist, "set_timeout", sentinel_fn, raising=False)
    assert provide_missing_torch_names() == []
    assert fsdp.DataParallelMeshDims is sentinel_cls and dist.set_timeout is sentinel_fn


def test_set_timeout_reaches_the_process_group(monkeypatch, tmp_path):
    monkeypatch.delattr(dist, "set_timeout", raising=False)
    provide_missing_torch_names()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        dist.set_timeout(datetime.timedelta(seconds=7))
        t = torch.ones(1)
        dist.all_reduce(t)  # the group still works after the change
        assert t.item() == 1.0
    finally:
        dist.destroy_process_group()
