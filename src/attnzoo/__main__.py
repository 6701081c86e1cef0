"""``python -m attnzoo ...`` (also ``torchrun --nproc_per_node=N -m attnzoo arena ...``)."""

import sys

from attnzoo._interrupt import interrupted_exit_code

try:  # Ctrl-C while the command modules load: one line (main handles it from then on; the
    # attnzoo package does while it imports torch, before this file runs)
    from attnzoo.cli import main
except KeyboardInterrupt:
    print("attnzoo: interrupted; nothing written", file=sys.stderr)
    raise SystemExit(interrupted_exit_code()) from None

raise SystemExit(main())
