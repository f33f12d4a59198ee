"""The README's "Using it in your model" code block runs as written (here: on
CPU in fp32; on a GPU machine in bf16) and trains: it cannot rot unnoticed."""
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _snippet() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Using it in your model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"expected one python block in the section, found {len(blocks)}"
    return blocks[0]


def test_readme_usage_snippet_runs_as_written():
    code = _snippet()
    assert 'torch.cuda.is_available()' in code  # the device is chosen, not hard-coded
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", p.stdout, re.M)]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses), p.stdout
    assert losses[-1] < losses[0], losses  # three steps on one batch: the loss falls
