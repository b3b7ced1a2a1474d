"""probebus's version: the one place it is written.

    from probe._version import __version__     # also `probe.__version__`, `probebus --version`

pyproject.toml reads it from here (`[tool.setuptools.dynamic]`), so the installed package's
metadata (`importlib.metadata.version("probebus")`) says the same; session infos and
recordings carry it (`probebus_version`, `probebus.version`).
"""

__version__ = "0.2.0"
