"""The hot path: the patches on torch (the install registry), the routes they call, the dispatchers behind compiled modules."""
