"""Every ``kvroute`` subcommand's ``--help``: every option has help text, defaults are shown,
and no default is printed twice.

The test runs ``kvroute COMMAND --help`` through the real entry point and captures the parser
that prints (and, for commands with subcommands, each subparser).
"""

from __future__ import annotations

import argparse
import re

import pytest

import kvroute_cli

# a default shown in the help: "(default: X)", "(default X)", "default: X", "(default X, ...)"
_SHOWS_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)
# "default: X" / "default X": a place where a default value is named
_NAMES_DEFAULT = re.compile(r"\bdefault\b[: ]", re.IGNORECASE)


def _parsers_of(command: str, monkeypatch) -> list[argparse.ArgumentParser]:
    seen: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.print_help

    def record(self, file=None):
        seen.append(self)
        real(self, file)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", record)
    with pytest.raises(SystemExit) as exc:
        kvroute_cli.main([command, "--help"])
    assert exc.value.code == 0
    assert seen, f"kvroute {command} --help printed no parser's help"
    out, stack = [], list(seen)
    while stack:  # subcommands, e.g. `kvroute workload support-agent`
        parser = stack.pop()
        out.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
    return out


def _option_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The rendered help text of one option (as --help prints it, whitespace collapsed)."""
    formatter = parser._get_formatter()
    return " ".join(formatter._expand_help(action).split()) if action.help else ""


@pytest.mark.parametrize("command", sorted(kvroute_cli.COMMANDS))
def test_every_option_has_help_and_shows_its_default_once(command, monkeypatch, capsys):
    for parser in _parsers_of(command, monkeypatch):
        capsys.readouterr()
        problems = []
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            name = "/".join(action.option_strings) or action.dest
            text = _option_help(parser, action)
            if not text.strip():
                problems.append(f"{name}: no help text")
                continue
            if len(_NAMES_DEFAULT.findall(text)) > 1 or "(default: None)" in text:
                problems.append(f"{name}: default shown twice or as None: {text!r}")
            has_value_default = action.option_strings and action.default not in (
                None,
                False,
                [],
                "",
                argparse.SUPPRESS,
            )
            if has_value_default and not _SHOWS_DEFAULT.search(text):
                problems.append(f"{name}: default {action.default!r} not shown: {text!r}")
        assert problems == [], f"{parser.prog}:\n  " + "\n  ".join(problems)


def test_the_rendered_help_shows_the_generate_defaults(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        kvroute_cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "router HOST:PORT (default: 127.0.0.1:50051)" in text
    assert "(default: 32)" in text  # --max-new-tokens


def test_router_help_first_screen_names_what_a_first_start_needs(monkeypatch, capsys):
    """`kvroute router --help`: the first 40 lines name the worker source (and that one is
    required), the ports, the model and the policy."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        kvroute_cli.main(["router", "--help"])
    first = "\n".join(capsys.readouterr().out.splitlines()[:40])
    for flag in (
        "--worker HOST:PORT",
        "--redis-url",
        "--port",
        "--http-port",
        "--model",
        "--policy",
    ):
        assert flag in first, flag
    assert "REQUIRED" in first


# what a worker's first start needs (what `kvroute up` passes it, and README's worker line)
_WORKER_FIRST_START = (
    "--port",
    "--http-port",
    "--executor",
    "--model",
    "--device",
    "--kv-slots",
    "--kv-memory-fraction",
    "--redis-url",
    "--advertise-address",
)


def test_worker_help_first_screen_names_a_first_start(monkeypatch, capsys):
    """``kvroute worker --help``'s first 40 lines (80 columns) name the options a first start
    needs; every other option sits in a titled group, none in the untitled "options"."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        kvroute_cli.main(["worker", "--help"])
    lines = capsys.readouterr().out.splitlines()
    first_screen = "\n".join(lines[:40])
    missing = [f for f in _WORKER_FIRST_START if not re.search(rf"^  {f}\b", first_screen, re.M)]
    assert missing == [], f"not on the first screen of kvroute worker --help: {missing}"

    from worker.cli import build_parser

    parser = build_parser()
    untitled = [
        a.option_strings
        for a in parser._optionals._group_actions
        if not isinstance(a, argparse._HelpAction)
    ]
    assert untitled == [], f"options outside a titled group: {untitled}"
    titles = [g.title for g in parser._action_groups if g._group_actions]
    assert titles[:2] == ["options", "first start"], titles
