"""Process groups for moepeak's ops: one way to name a group inside a custom op,
and one way to resolve a group's rank, size and global ranks.

A `torch.library.custom_op` takes only tensors, numbers and strings, so an op
that runs on a process group receives the group as a string key:

    key = register_group(group)      # "" for group=None (one rank)
    group = lookup_group(key)        # inside the op's body

Invariants:
  * One key per live group object; registering the same group again returns
    the same key, so a traced graph sees a stable constant.
  * The registry holds the group weakly: when the last user reference to a
    group is dropped (after `destroy_process_group`, say) its entry is evicted.
    Looking up an evicted key raises a clear error instead of reaching a dead
    communicator.
  * Keys are never reused within a process (a counter, not `id()`), so a key
    from a dead group can never name a new one.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Optional, Tuple

import torch.distributed as dist

_LOCK = threading.Lock()
_COUNTER = itertools.count(1)
_KEY_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # group -> key
_GROUP_OF: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # key -> group


def register_group(group: Optional["dist.ProcessGroup"]) -> str:
    """The key naming `group` inside an op ("" for None: a single rank)."""
    if group is None:
        return ""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"moepeak: group must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(group).__name__}")
    with _LOCK:
        key = _KEY_OF.get(group)
        if key is None:
            key = f"pg{next(_COUNTER)}"
            _KEY_OF[group] = key
            _GROUP_OF[key] = group
        return key


def lookup_group(key: str) -> Optional["dist.ProcessGroup"]:
    """The group registered under `key` (None for ""); raises if it is gone."""
    if not key:
        return None
    with _LOCK:
        group = _GROUP_OF.get(key)
    if group is None:
        raise ValueError(f"moepeak: process group {key!r} is not registered or no longer exists "
                         "(groups are registered by the op's public function; was the group destroyed?)")
    return group


def registered_group_count() -> int:
    """How many live groups the registry holds (for tests of eviction)."""
    with _LOCK:
        return len(_GROUP_OF)


@dataclass(frozen=True)
class GroupInfo:
    """A group resolved once: `rank` and `world_size` within the group, and the
    global rank of each group rank (what point-to-point calls address)."""
    group: "dist.ProcessGroup"
    rank: int
    world_size: int
    global_ranks: Tuple[int, ...]


def group_info(group: Optional["dist.ProcessGroup"] = None) -> GroupInfo:
    """Resolve `group` (None: the default group) to its rank, size and global
    ranks. Raises if torch.distributed is not initialized or this process is not
    a member of the group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("moepeak: a process group was asked for but torch.distributed is not "
                           "initialized (call torch.distributed.init_process_group first)")
    g = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(g)
    if rank < 0:
        raise ValueError("moepeak: this process is not a member of the given group")
    world = dist.get_world_size(g)
    if g is dist.group.WORLD:
        global_ranks = tuple(range(world))
    else:
        global_ranks = tuple(dist.get_global_rank(g, r) for r in range(world))
    return GroupInfo(g, rank, world, global_ranks)
