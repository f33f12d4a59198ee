"""The README's code blocks run as written (here: on CPU in fp32; on a GPU machine in bf16)
and train: "Using it in your model" and "With Hugging Face transformers" each train on one
fixed batch, whose loss must fall. They cannot rot unnoticed."""
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _snippet(heading: str) -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"expected one python block in the section, found {len(blocks)}"
    return blocks[0]


def _losses_of(code: str):
    """Run `code` in a fresh interpreter on this checkout; the losses it prints, one a step."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", p.stdout, re.M)]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), p.stdout
    return losses


def test_readme_usage_snippet_runs_as_written():
    code = _snippet("Using it in your model")
    assert 'torch.cuda.is_available()' in code  # the device is chosen, not hard-coded
    losses = _losses_of(code)
    assert losses[-1] < losses[0], losses  # three steps on one batch: the loss falls


def test_readme_hugging_face_snippet_trains():
    pytest.importorskip("transformers")
    losses = _losses_of(_snippet("With Hugging Face transformers"))
    assert losses[2] < losses[1] < losses[0], losses  # one batch, three steps: the loss falls each step
