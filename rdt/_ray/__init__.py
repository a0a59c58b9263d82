"""The Ray seam: every private Ray API rdt uses, and lookups of where this process stands in Ray."""
