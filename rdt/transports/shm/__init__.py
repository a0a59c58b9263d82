"""Same-node objects: shared storages, direct reads of the producer's memory, segments."""
