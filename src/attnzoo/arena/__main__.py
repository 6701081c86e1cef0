"""``python -m attnzoo.arena`` (also under ``torchrun --nproc_per_node=N -m attnzoo.arena``)."""

import sys

from attnzoo._interrupt import interrupted_exit_code

try:  # Ctrl-C while the arena modules load: one line (run_arena handles it from then on; the
    # attnzoo package does while it imports torch, before this file runs)
    from attnzoo.arena import main
except KeyboardInterrupt:
    print("arena: interrupted; nothing written", file=sys.stderr)
    raise SystemExit(interrupted_exit_code()) from None

raise SystemExit(main())
