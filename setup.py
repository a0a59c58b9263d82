"""Only the optional C extension lives here; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # Streaming (non-temporal) bulk copies for same-node reads. Optional: without a C compiler rdt installs
        # and copies with torch instead (rdt_transports/_memcopy.py).
        Extension("rdt_transports._streamcopy", ["rdt_transports/_streamcopy.c"], optional=True,
                  extra_compile_args=["-O2"]),
    ],
)
