"""Score-matrix attention built on the backends: the dispatcher ``attention`` (``az.attention``),
sinks, sigmoid attention, packed variable-length sequences and native sparse attention. Imports
``core`` and ``backends``."""
