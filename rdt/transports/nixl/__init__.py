"""NIXL objects: one-sided READs of the producer's registered buffers."""
