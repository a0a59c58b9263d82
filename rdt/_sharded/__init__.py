"""Sharded weight sync: each producer rank publishes its local shards with their global layout (``put_shards``),
the driver gathers the ranks' publications into a :class:`Manifest`, and each consumer pulls only the regions its
target tensors want, straight from the ranks that hold them (``WeightLoader``). See docs/weight-sync.md."""
