"""argparse help formatters every ``kvroute`` subcommand uses, so ``--help`` reads the same
everywhere: each option's default is shown once, after its help text.

argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: X)`` to every option, also to
one whose help already names its default (printing it twice) and to ones whose default means
"unset" (``(default: None)``, ``(default: False)``). :class:`HelpFormatter` appends it only when
the help does not already say ``default`` and the default is a value.
"""

from __future__ import annotations

import argparse
import math
import re

_MENTIONS_DEFAULT = re.compile(r"\bdefault\b[ :]", re.IGNORECASE)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default once, and only when it is a value (not None/False/[])."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings  # positionals: their value is required
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or default == []
            or default == ""
            or _MENTIONS_DEFAULT.search(text)
            or "%(default)" in text
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """:class:`HelpFormatter` that keeps the description's and epilog's line breaks."""


def port_number(value: str) -> int:
    """argparse type of a port option: 0..65535 (0: a free one), else a one-line usage error."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {value!r}") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0: a free port), got {port}")
    return port


def positive_float(value: str) -> float:
    """argparse type: a finite number > 0, else a one-line usage error."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {value!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return x


def add_http_front_args(group: argparse._ArgumentGroup, serves: str, model_default: str) -> None:
    """``--http-port``, ``--http-host`` and ``--served-model-name``: the OpenAI-compatible HTTP
    front that ``kvroute router`` and ``kvroute worker`` can both serve next to gRPC.
    ``serves`` says what the port serves; ``model_default`` the served name's default."""
    group.add_argument(
        "--http-port",
        type=int,
        default=None,
        help=f"also serve HTTP here: {serves} (0 = pick a free port; default: no HTTP)",
    )
    group.add_argument("--http-host", default="127.0.0.1", help="address the HTTP front binds")
    group.add_argument(
        "--served-model-name",
        default=None,
        help=f"the model name the HTTP API serves (default: {model_default})",
    )
