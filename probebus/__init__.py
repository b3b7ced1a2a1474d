"""probebus: the command-line front end and shipped assets (models) of the probe/exporters/decoder packages."""

__version__ = "0.2.0"
