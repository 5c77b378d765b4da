"""The ``kvroute`` command: one entry point, one subcommand per job.

Each subcommand lives with the package it drives and is imported only when used, so
``kvroute router`` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("router.cli.fleet", "main", "start N local workers and a router (the quick start)"),
    "worker": ("worker.cli", "main", "run one serving worker (gRPC)"),
    "bridge": (
        "worker.bridge.service.cli",
        "main",
        "serve a vLLM or SGLang engine as a kvroute worker (its KV events, its HTTP API)",
    ),
    "router": ("router.cli.router", "main", "run the cache-aware router (gRPC)"),
    "model": ("worker.model_dir", "main", "write a small model directory for --model (init DIR)"),
    "generate": ("router.cli.client", "main", "send one prompt to a router and print the output"),
    "explain": ("router.cli.client", "explain_main", "show each worker's match, load and cost"),
    "keys": ("router.service.auth", "keys_main", "hash an API key for kvroute router --api-keys"),
    "status": ("router.cli.status", "main", "live view of a router's fleet (health, load, cache)"),
    "loadtest": ("router.cli.loadtest", "main", "closed-loop load: throughput, latency, errors"),
    "replay": ("fleetsim.replay.cli", "main", "replay a trace against routing policies"),
    "workload": ("fleetsim.workload", "main", "generate a synthetic workload trace"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: kvroute COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run 'kvroute COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"kvroute: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
