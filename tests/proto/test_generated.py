"""The committed protobuf stubs are exactly what `python -m kvroute_proto.generate` writes."""

from kvroute_proto.generate import stale_files


def test_generated_stubs_are_fresh():
    assert stale_files() == [], "run: python -m kvroute_proto.generate"
