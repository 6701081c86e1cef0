"""Feature-map (kernelised) attention: linear attention, Performer's random features,
Infini-attention's compressive memory (its local part calls ``softmax.attention``; ``linear``
runs on ``recurrent``'s token loop)."""
