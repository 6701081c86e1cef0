"""``python -m attnzoo ...`` (also ``torchrun --nproc_per_node=N -m attnzoo arena ...``)."""

from attnzoo.cli import main

raise SystemExit(main())
