"""The public API's implementation: tensor_method and put, get, and the admin calls (groups, stats, configure)."""
