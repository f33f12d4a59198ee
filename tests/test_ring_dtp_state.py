"""Ring-DTP's process-wide state, each piece for a stated reason (its class docstring):
which fp32-output GEMM forms torch offers (gemm.GemmForms) and the deferred CUDA label
flags (labels.PendingLabelChecks); both thread-safe. Fallbacks are said once through the
"moepeak" logger.
"""
import logging
import subprocess
import sys
import threading
import time

import pytest
import torch

from moepeak.ring_dtp import gemm as G
from moepeak.ring_dtp.labels import PendingLabelChecks


# ---- GEMM forms ------------------------------------------------------------------------------
def test_gemm_forms_probe_once_per_key_across_threads(caplog):
    """Each (form, device, dtype) is probed once, also when threads ask at once; a missing
    form is logged once, naming the form and its fallback."""
    calls = []

    def probe(form, device, dtype):
        calls.append((form, dtype))
        time.sleep(0.05)  # the other threads ask while the first probe runs
        return form != "addmm_out"

    forms = G.GemmForms(probe)
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="moepeak"):
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(forms.has("addmm_out", cpu, torch.bfloat16)))
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == [False] * 8
        assert forms.has("mm", cpu, torch.bfloat16) and forms.has("mm", cpu, torch.float16)
        assert not forms.has("addmm_out", cpu, torch.bfloat16)
    assert calls == [("addmm_out", torch.bfloat16), ("mm", torch.bfloat16), ("mm", torch.float16)]
    warned = [r for r in caplog.records if r.name == "moepeak"]
    assert len(warned) == 1 and "'addmm_out'" in warned[0].getMessage()
    assert G.FORMS["addmm_out"] in warned[0].getMessage()


def test_gemm_forms_out_of_memory_is_raised_not_remembered():
    """An out-of-memory error while probing says nothing about the form: it is raised, and the
    next call probes again."""
    outcomes = [torch.OutOfMemoryError("probe"), True]

    def probe(form, device, dtype):
        out = outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out

    forms = G.GemmForms(probe)
    with pytest.raises(torch.OutOfMemoryError):
        forms.has("mm", torch.device("cpu"), torch.bfloat16)
    assert forms.has("mm", torch.device("cpu"), torch.bfloat16)
    assert outcomes == []


def test_probe_form_on_this_torch():
    """The real probe: CPU has no out_dtype GEMMs (aten::mm.dtype is CUDA's), so every form is
    missing there; an unknown form is refused by name."""
    for form in G.FORMS:
        assert G.probe_form(form, torch.device("cpu"), torch.bfloat16) is False
    with pytest.raises(ValueError, match="form must be one of"):
        G.probe_form("bmm", torch.device("cpu"), torch.bfloat16)


@pytest.mark.cuda
def test_probe_form_cuda():
    """torch >= 2.8 offers every form for bf16 on CUDA (what the schedules' numbers assume)."""
    for form in G.FORMS:
        assert G.probe_form(form, torch.device("cuda"), torch.bfloat16), form


# ---- deferred label flags --------------------------------------------------------------------
class _Event:
    """A CUDA event stand-in: complete once `done` is set."""

    def __init__(self, done=True):
        self.done = done

    def synchronize(self):
        self.done = True

    def query(self):
        return self.done


def _flag(bad):
    return torch.tensor([int(bad)], dtype=torch.int32)


def test_pending_label_checks_read_completed_flags_only():
    p = PendingLabelChecks()
    assert not p
    running = _Event(done=False)
    p.add(running, _flag(True), 11)
    p.add(_Event(), _flag(False), 12)
    p.check()                              # the completed good flag is read and dropped
    assert p
    running.done = True
    with pytest.raises(ValueError, match=r"labels must be in \[0, 11\)"):
        p.check()
    assert not p
    p.add(_Event(done=False), _flag(True), 13)
    with pytest.raises(ValueError, match=r"\[0, 13\)"):
        p.check(wait=True)                 # wait: every flag, running ones included


def test_pending_label_checks_record_while_waiting():
    """A flag recorded on another thread while check(wait=True) waits is neither blocked nor
    lost: the wait runs outside the lock (forward records on the caller's thread, a CUDA
    backward reads on autograd's device thread)."""
    p = PendingLabelChecks()
    recorded = threading.Event()

    class Slow(_Event):
        def synchronize(self):
            threading.Thread(target=lambda: (p.add(_Event(), _flag(True), 21), recorded.set())).start()
            assert recorded.wait(timeout=10), "add() was blocked by the waiting check()"
            self.done = True

    p.add(Slow(done=False), _flag(False), 20)
    p.check(wait=True)                     # reads the first flag; the new one stays
    assert p
    with pytest.raises(ValueError, match=r"\[0, 21\)"):
        p.check()


# ---- fallbacks said once -----------------------------------------------------------------------
def test_replaced_mode_logged_once():
    """mode="fused" with reduction="none" runs vocab_outer (the fused modes need one upstream
    gradient in forward): said once per process through the "moepeak" logger."""
    code = ("import torch, moepeak\n"
            "x, w, y = torch.randn(5, 4), torch.randn(9, 4), torch.randint(0, 9, (5,))\n"
            "for _ in range(3):\n"
            "    moepeak.linear_cross_entropy(x, w, y, mode='fused', reduction='none')\n"
            "moepeak.linear_cross_entropy(x, w, y, mode='fused')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("runs 'vocab_outer'") == 1, r.stderr
