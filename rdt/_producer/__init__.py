"""The producer role: keep a returned value's tensors here and hand out metadata for them."""
