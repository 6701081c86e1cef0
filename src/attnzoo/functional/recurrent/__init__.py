"""Recurrent kernels with a chunked parallel form: the shared scan engine (``_chunked_scan``, its
operators ``attnzoo::matrix_scan``...), retention, GLA (with its ``attnzoo::gla_vector_scores``
operator), the delta rule and DeltaProduct. Imports no other room."""
