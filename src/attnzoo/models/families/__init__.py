"""Model families as builders: each module builds its model from parts (attention modules,
rotary embeddings, feed-forwards) and owns its Hugging Face weight map; the converter in
:mod:`attnzoo.models.hf.convert` dispatches on the config's ``model_type``."""

# The Hugging Face room dispatches to the families; importing it first lets a family module be
# imported on its own (its converter is then initialised before the family it imports).
import attnzoo.models.hf  # noqa: F401
