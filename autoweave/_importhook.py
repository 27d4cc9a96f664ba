"""Post-import hooks: the one finder lives in the top-level start-up module (see there)."""

from _autoweave_start import register, registered, unregister_all

__all__ = ["register", "registered", "unregister_all"]
