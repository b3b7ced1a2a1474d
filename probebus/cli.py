"""probebus command line (placeholder until subcommands land)."""


def main() -> None:
    raise SystemExit("probebus: not yet")
