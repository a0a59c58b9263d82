"""The object model: metadata, specs, flattening, the object table and ready events."""
