"""The code's version: what `helixtok --version`, the package and the manifests it writes say."""

__version__ = "0.4.0"
