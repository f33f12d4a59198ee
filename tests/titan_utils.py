"""torchtitan for the tests: skip a module only where torchtitan is absent or
cannot run on this torch (a torchtitan or triton import error); an import
error inside moepeak still fails. Command lines and a runner for jobs of
torchtitan's own trainer (tests/titan_cpu.py)."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = "moepeak.titan.experts,moepeak.titan.loss,moepeak.titan.sco,moepeak.titan.stream_adamw,moepeak.titan.rope"
"""The four schedules and the shared rotary table, as --override.imports takes them."""
REFERENCE_EXPERTS = "tests.titan_cpu.fp32_experts"
"""Test-only override: the stock experts computed in fp32."""
TWO_RANKS = ["--parallelism.spmd_backend", "partial_dtensor", "--parallelism.expert_parallel_degree", "2"]
"""FSDP2 over 2 ranks with expert parallel degree 2 (spmd_backend: tests/titan_cpu.py's torch 2.13 note)."""


def require_torchtitan():
    """The torchtitan package, or a module-level skip that names the reason."""
    try:
        # moepeak.titan (the package of .compat) provides the torch names torchtitan 0.3 needs
        # on torch 2.11 / 2.13, then imports torchtitan: without torchtitan it raises here
        from moepeak.titan.compat import provide_missing_torch_names
        provide_missing_torch_names()
        import torchtitan
        import torchtitan.distributed.fsdp  # noqa: F401
        import torchtitan.models.qwen3  # noqa: F401  needs triton at import time
    except ImportError as e:
        pytest.skip(f"torchtitan not usable with torch {torch.__version__}: {e}", allow_module_level=True)
    return torchtitan


def require_torchtitan_trainer():
    """require_torchtitan(), and a skip where torchtitan.train itself cannot run on this torch:
    on torch < 2.12 its FSDP + expert-parallel path imports torch >= 2.12 names
    (fsdp._fully_shard._fsdp_common.ShardPlacementResult) and its one-rank CPU job dies in
    backward (SIGSEGV, torch 2.11). The in-process tests (test_titan.py, test_titan_dist.py)
    run on torch 2.11 too, with moepeak.titan.compat's names."""
    titan = require_torchtitan()
    if torch.__version__ < "2.12":
        pytest.skip(f"torchtitan 0.3's trainer needs torch >= 2.12 (here {torch.__version__})",
                    allow_module_level=True)
    return titan


def titan_command(nproc: int, *flags: str, assets: str = "$ASSETS", out: str = "$OUT") -> list[str]:
    """The torchrun command line of one job of tests/titan_cpu.py's job, run from
    the repository root; $ASSETS holds tests.titan_cpu.write_assets' files."""
    return ["torchrun", "--standalone", f"--nproc_per_node={nproc}", "tests/titan_cpu.py",
            "--module", "tests.titan_cpu", "--config", "qwen3_moe_cpu",
            "--hf_assets_path", f"{assets}/tokenizer", "--dataloader.dataset_path", f"{assets}/c4_test",
            "--dump_folder", out, *flags]


def run_jobs(jobs: dict[str, list[str]], workdir: str, timeout: float = 240) -> dict[str, tuple[list[dict], str]]:
    """Run the jobs {name: titan_command(...)} side by side (torchrun as
    `python -m torch.distributed.run`, the same entry point); return per job the
    trainer's logged steps as {"step", "loss", "grad_norm"} records (full
    precision) and its console log. A failed or hung job fails the test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    procs = {}
    try:
        for name, command in jobs.items():
            metrics = os.path.join(workdir, f"{name}.jsonl")
            job_env = dict(env, MOEPEAK_TITAN_METRICS=metrics,
                           HF_DATASETS_CACHE=os.path.join(workdir, f"{name}_hf_datasets_cache"))
            argv = [sys.executable, "-m", "torch.distributed.run"] + command[1:]
            # own session: a hung job is killed with its rank processes
            procs[name] = subprocess.Popen(argv, cwd=ROOT, env=job_env, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
        results = {}
        for name, proc in procs.items():
            try:
                log, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not finish in {timeout} s: {shlex.join(jobs[name])}")
            assert proc.returncode == 0, f"{name} failed ({shlex.join(jobs[name])}):\n{log[-6000:]}"
            with open(os.path.join(workdir, f"{name}.jsonl")) as f:
                results[name] = [json.loads(line) for line in f], log
        return results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def applied_overrides(log: str) -> set[str]:
    """Overrides the trainer logged as applied (it logs one line per replaced node)."""
    return set(re.findall(r"\[Override\] (\S+):", log))
