"""The package version, at the bottom of the layers so any of them may name it."""

__version__ = "0.1.0"
