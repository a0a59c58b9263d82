"""CUDA IPC objects: a same-node consumer opens the producer's GPU memory."""
