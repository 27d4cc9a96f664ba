"""The hot path: the patches on torch and the routes behind them, the dispatchers behind compiled modules."""
