"""Baton's version: the installed package's."""

from importlib import metadata

try:
    __version__ = metadata.version("baton")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
