"""probebus: the command-line front end and shipped assets (models) of the probe/exporters/decoder packages."""


def __getattr__(name: str) -> str:
    if name == "__version__":  # written once, in probe/_version.py; read when asked (importing probe imports torch)
        from probe._version import __version__

        return __version__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
