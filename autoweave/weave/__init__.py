"""Applying a plan: the only code that changes the user's modules (in place, state_dict keys unchanged)."""
