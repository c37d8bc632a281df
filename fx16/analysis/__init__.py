"""Analyses: passes that change no node and publish findings in ``node.meta["fx16.*"]``."""

__all__: list[str] = []
