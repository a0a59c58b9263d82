"""The consumer role: turn an object's metadata back into its value, by the best path available."""
