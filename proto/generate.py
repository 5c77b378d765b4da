"""Regenerate the protobuf/gRPC stubs from ``kvroute.proto``.

    python -m kvroute_proto.generate           # rewrite the stubs next to the .proto
    python -m kvroute_proto.generate --check   # exit 1 if the committed stubs are stale

The folder is imported as ``kvroute_proto``; protoc is run on a temporary tree in which
``kvroute_proto/`` points at this folder, so the generated modules import each other as
``kvroute_proto.kvroute_pb2`` with no text rewriting.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_FILES = ("kvroute.proto",)
GENERATED = ("kvroute_pb2.py", "kvroute_pb2.pyi", "kvroute_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc (from grpcio-tools) and write the stubs into ``out_dir``."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - dev dependency
        raise SystemExit("grpcio-tools is needed: pip install -e '.[dev]'") from exc
    import grpc_tools

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        (src / "kvroute_proto").mkdir(parents=True)
        for name in PROTO_FILES:
            (src / "kvroute_proto" / name).write_bytes((HERE / name).read_bytes())
        gen = Path(tmp) / "gen"
        gen.mkdir()
        include = Path(grpc_tools.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{src}",
            f"-I{include}",
            f"--python_out={gen}",
            f"--pyi_out={gen}",
            f"--grpc_python_out={gen}",
            *[f"kvroute_proto/{name}" for name in PROTO_FILES],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for name in GENERATED:
            (out_dir / name).write_bytes((gen / "kvroute_proto" / name).read_bytes())


def stale_files() -> list[str]:
    """Names of committed stubs that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        return [
            name
            for name in GENERATED
            if not (HERE / name).exists()
            or (HERE / name).read_bytes() != (Path(tmp) / name).read_bytes()
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated stubs: " + ", ".join(stale), file=sys.stderr)
            return 1
        print("generated stubs are up to date")
        return 0
    generate(HERE)
    print("wrote " + ", ".join(GENERATED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
