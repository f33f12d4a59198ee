"""The `moepeak` command (also `python -m moepeak`).

    moepeak demo [flags]   train a small MoE LM with the four schedules (moepeak.demo)
    moepeak plan [flags]   predict the four peaks per GPU for a model (moepeak.plan)
"""
from __future__ import annotations

import sys

USAGE = """usage: moepeak {demo,plan} [flags]

  demo   train a small MoE LM with all four moepeak schedules and measure the
         four memory peaks against plain PyTorch (moepeak demo --help)
  plan   predict the four peaks per GPU for a model, context and GPU count,
         name the binding one and the longest context that fits (moepeak plan --help)
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as demo_main
        return demo_main(rest)
    if cmd == "plan":
        from .plan import main as plan_main
        return plan_main(rest)
    print(f"moepeak: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2
