"""The installed package's version (a leaf module: no torch, nothing of the package)."""

import importlib.metadata


def package_version() -> str:
    """The version of the installed ``nvfp4-recipe`` distribution, or "unknown (not installed)"
    when it runs from a source tree that is not installed."""
    try:
        return importlib.metadata.version("nvfp4-recipe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"
