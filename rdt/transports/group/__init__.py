"""Objects over a collective group (Gloo, NCCL, UCX), with Gloo's fan-out relay."""
