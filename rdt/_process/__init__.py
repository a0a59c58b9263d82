"""This process's rdt state: the context that holds everything, its settings and its stats."""
