"""Model families as builders: each module builds its model from parts (attention modules,
rotary embeddings, feed-forwards) and owns its Hugging Face weight map; the converter in
:mod:`attnzoo.models.hf.convert` dispatches on the config's ``model_type``."""
