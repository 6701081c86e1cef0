"""``python -m attnzoo.arena`` (also under ``torchrun --nproc_per_node=N -m attnzoo.arena``)."""

from attnzoo.arena import main

raise SystemExit(main())
