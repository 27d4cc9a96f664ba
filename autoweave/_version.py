"""The package version, at the bottom of the layers so any of them may name it."""

__version__ = "0.1.0"

# The name on the package index (``pip install torch-autoweave``): "autoweave" there is
# an unrelated project that also ships an ``autoweave`` import package. The import
# package keeps its name.
DISTRIBUTION = "torch-autoweave"
