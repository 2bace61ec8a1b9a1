"""Helpers that only the built-in plug-ins share (the cost-aware selector base, router probes). A third-party plug-in imports specfit.interfaces instead."""
