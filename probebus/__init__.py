"""probebus: the command-line front end and shipped assets (models) of the probe/exporters/decoder packages."""

__version__ = "0.1.0"
