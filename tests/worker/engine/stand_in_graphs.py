"""A stand-in for CUDA graphs on the CPU, shared by the static decode and prefill tests."""

from __future__ import annotations


class StandInCapturer:
    """What a CUDA graph does, on the CPU: ``capture`` runs the forward (the warm-up) and
    keeps its output tensor; each replay recomputes the forward from the buffers as they
    are then and writes the result into that same tensor."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, forward):
        self.captures += 1
        out = forward()
        outer = self

        class Replay:
            def replay(self) -> None:
                outer.replays += 1
                out.copy_(forward())

        return Replay(), out
