"""The softmax backends ``az.attention`` dispatches to, each with its ``CAPABILITIES``, and the
compiled operators beside their eager kernels (``tiled_ops`` beside ``tiled/``,
``reference_ops`` beside ``reference``); ``decode`` (split-KV one-token decode) and ``halfmath``
(half-precision matmul policy). Imports ``core`` only."""
