"""The decision: reading the module tree and the user's code, a plan out. No module is changed here."""
