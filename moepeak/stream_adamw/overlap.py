"""StreamAdamW's overlap with backward: post-accumulate-grad hooks that hand
each bucket of final gradients to a worker thread while autograd continues.

The optimizer (moepeak/stream_adamw/optimizer.py) owns one ``BackwardOverlap`` when it
is built with ``overlap_backward=True`` and gives it two callables:

- ``prepare(params) -> job | None``: runs in the thread that fired the hook
  (autograd's). Validates the params, creates/advances their state (the
  ``step`` counter) and, on CUDA, records an event on the current stream
  after which the grads are final and the params no longer read.
- ``execute(job)``: runs on the worker thread (the C kernel releases the
  GIL): the bucket pipeline or the CPU kernel for those params.

A *round* is the set of updates between two ``step()`` calls. Invariants:
- a param is updated at most once per round (``done``); a second final grad
  in the same round (two backward passes without ``step()`` and without
  ``accumulate()``) raises from the hook, so backward raises;
- jobs run in submission order on one worker (the pinned slots of the
  optimizer's bucket plan are reused job after job);
- the worker holds no reference to the optimizer between jobs, and the hooks
  hold only a weak one, so dropping the optimizer removes its hooks and ends
  its worker thread.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref

import torch


class _WorkerState:
    """What the worker thread shares with the optimizer side (no optimizer refs)."""

    def __init__(self):
        self.cv = threading.Condition()
        self.inflight = 0  # jobs submitted and not finished
        self.jobs_done = 0
        self.error = None  # the first exception a job raised (re-raised by wait())
        self.timeline = []  # this round's jobs: [params, submitted, started, finished] (perf_counter s)


def _worker_loop(jobs, state):
    while True:
        item = jobs.get()
        if item is None:
            return
        execute, job, times = item
        times[2] = time.perf_counter()
        try:
            if state.error is None:
                execute(job)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of wait()
            state.error = e
        finally:
            times[3] = time.perf_counter()
            del execute, job, item, times
            with state.cv:
                state.inflight -= 1
                state.jobs_done += 1
                state.cv.notify_all()


def _close(jobs, handles):
    for h in handles:
        h.remove()
    jobs.put(None)


class BackwardOverlap:
    """Hooks, the pending bucket and the worker of one optimizer (see the
    module docstring). ``bucket_bytes``: fp32 bytes of params per job."""

    def __init__(self, owner, params, bucket_bytes, prepare, execute, immediate=None):
        self.bucket_bytes = int(bucket_bytes)
        self._prepare = prepare
        self._execute = execute
        self._immediate = immediate  # p -> True: prepare([p]) at once in the hook (it returns no job)
        self.pending = []  # params whose grads are final, not yet submitted
        self.pending_bytes = 0
        self.done = set()  # params updated (or submitted) in this round
        self.accumulating = 0  # depth of accumulate() contexts
        self.deferred = False  # True: hooks do nothing, step() updates (clip_grad_norm mode)
        self.enabled = True  # StreamAdamW.set_overlap(False): hooks do nothing
        self.params_in_backward = 0  # params submitted from hooks since construction
        self.last_round = []  # the last finished round's jobs: (elements, submitted, started, finished)
        self._jobs = queue.SimpleQueue()
        self._state = _WorkerState()
        self._thread = None
        ref = weakref.ref(self)

        def hook(p):
            me = ref()
            if me is not None:
                me.on_final_grad(p)

        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]
        weakref.finalize(owner, _close, self._jobs, self._handles)

    # ---------------------------------------------------------------- hooks
    def on_final_grad(self, p):
        if self.accumulating or self.deferred or not self.enabled or p.grad is None:
            return
        if p in self.done:
            raise RuntimeError(
                "moepeak.StreamAdamW(overlap_backward=True): a parameter's gradient became final twice without "
                f"step() (shape {tuple(p.shape)}); run all but the last micro-batch's backward inside "
                "`with optimizer.accumulate():`, and call step() after the last one")
        self.done.add(p)
        if self._immediate is not None and self._immediate(p):
            self._prepare([p])  # updated now, on the hook's stream (StreamAdamW's device_state)
            self.params_in_backward += 1
            return
        self.pending.append(p)
        self.pending_bytes += 4 * _local_numel(p)
        if self.pending_bytes >= self.bucket_bytes:
            self.flush()

    def flush(self):
        """Submit the pending params as one job."""
        if not self.pending:
            return
        params, self.pending, self.pending_bytes = self.pending, [], 0
        job = self._prepare(params)
        if job is None:
            return
        self.params_in_backward += len(params)
        times = [sum(_local_numel(p) for p in params), time.perf_counter(), None, None]
        with self._state.cv:
            self._state.inflight += 1
            self._state.timeline.append(times)
        if self._thread is None:
            self._thread = threading.Thread(target=_worker_loop, args=(self._jobs, self._state),
                                             name="moepeak-stream-adamw", daemon=True)
            self._thread.start()
        self._jobs.put((self._execute, job, times))

    def wait(self):
        """Block until every submitted job has finished; re-raise a job's error."""
        st = self._state
        with st.cv:
            while st.inflight:
                st.cv.wait()
        if st.error is not None:
            err, st.error = st.error, None
            raise RuntimeError("moepeak.StreamAdamW: an update overlapped with backward failed") from err

    def end_round(self):
        self.done.clear()
        with self._state.cv:
            self.last_round = [tuple(t) for t in self._state.timeline]
            self._state.timeline = []

    @property
    def jobs_done(self):
        return self._state.jobs_done

    @contextlib.contextmanager
    def accumulate(self):
        self.accumulating += 1
        try:
            yield
        finally:
            self.accumulating -= 1


def _local_numel(p):
    t = p._local_tensor if type(p).__name__ == "DTensor" else p
    return t.numel()


def side_stream(device):
    """A fresh CUDA stream on `device` for the worker's pipelines."""
    return torch.cuda.Stream(device=device)
