"""Entry point of the `inferbus` command (``python -m inferbus_cli``)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from inferbus_cli.parser import build_parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the chosen subcommand; returns the exit code."""
    args = build_parser().parse_args(argv)
    # The command line as given (`up -d` starts its background supervisor with it).
    args.argv = list(sys.argv[1:] if argv is None else argv)
    module_name, _, function = args.handler.partition(":")
    module = importlib.import_module(f"inferbus_cli.commands.{module_name}")
    try:
        return int(getattr(module, function)(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # e.g. `inferbus models list | head`: the reader left; nothing to report.
        return 0


if __name__ == "__main__":
    sys.exit(main())
