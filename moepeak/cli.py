"""The `moepeak` command (also `python -m moepeak`).

    moepeak demo [flags]   train a small MoE LM with the four schedules (moepeak.demo)
    moepeak plan [flags]   predict the four peaks per GPU for a model (moepeak.plan)
"""
from __future__ import annotations

import os
import sys

USAGE = """usage: moepeak {demo,plan} [flags]

  demo   train a small MoE LM with all four moepeak schedules, overlay plain
         PyTorch's loss on the same weights and batches, and measure the four
         memory peaks against plain PyTorch (moepeak demo --help)
  plan   predict the four peaks per GPU for a model, context and GPU count,
         name the binding one and the longest context that fits (moepeak plan --help)
"""


def _dispatch(argv) -> int:
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


def main(argv=None):
    """Run one subcommand; returns its exit status (for sys.exit). A reader that closes the pipe
    early (`moepeak plan ... | head`) ends the command quietly, as for other Unix
    tools: exit status 141 (128 + SIGPIPE), no traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            code = _dispatch(argv)
        except SystemExit as e:  # argparse's --help and usage errors: flush below as well
            code = e.code
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush
        # cannot raise a second time and print "Exception ignored ... BrokenPipeError"
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
