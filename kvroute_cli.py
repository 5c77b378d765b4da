"""The ``kvroute`` command: one entry point, one subcommand per job."""

import sys


def main(argv: list[str] | None = None) -> int:
    raise SystemExit("kvroute: no subcommands yet")


if __name__ == "__main__":
    sys.exit(main())
