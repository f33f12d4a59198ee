"""Spawn gloo ranks on this machine for multi-rank tests.

run_ranks(world_size, fn, *args) starts `world_size` processes, initialises a
process group in each (gloo; backend="nccl": rank r on cuda:r), calls fn(rank, world_size, *args), and raises if
any rank fails or the whole run exceeds `timeout` seconds (a hang is a test
failure, never a stuck CI). fn must be a module-level function (picklable).

run_torchrun(script, args, nproc, timeout) runs a script of this checkout under
`python -m torch.distributed.run` with this checkout first on PYTHONPATH.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, errq, backend="gloo"):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A rank that got here passed. It leaves without the interpreter's teardown: under a loaded
    # machine torch's gloo teardown at exit intermittently aborts ("terminate called without an
    # active exception", exit code -6) after a passing run, which is not what these tests check.
    os._exit(0)


def run_ranks(world_size: int, fn, *args, timeout: float = 180.0, backend: str = "gloo") -> None:
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, errq, backend), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [i for i, p in enumerate(procs) if p.is_alive()]
        errors = []
        while not errq.empty():
            errors.append(errq.get())
        if errors:
            rank, tb = errors[0]
            raise AssertionError(f"rank {rank} of {world_size} failed:\n{tb}")
        if alive:
            raise TimeoutError(f"ranks {alive} of {world_size} did not finish within {timeout}s (hang?)")
        bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks exited with codes {bad}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_torchrun(script, args, nproc: int = 2, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node=nproc ROOT/script *args` from the
    checkout's root, this checkout first on PYTHONPATH; output captured as text."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
