"""The control channel between rdt processes: wire format, server, client, and peer probing."""
