"""`kvroute generate` against a real router and sim worker on 127.0.0.1: the streamed output
is the non-streamed one, also when the tokens include partial UTF-8 sequences."""

from __future__ import annotations

from router.cli import client
from tests.router.service.router_harness import running_router, sim_worker

PROMPT = "The streamed text must equal the non-streamed one. "
ARGS = ["--max-new-tokens", "48", "--seed", "7"]


async def _run_cli(capsys, argv: list[str]) -> str:
    args = client.build_generate_parser().parse_args(argv)
    assert await client._generate(args) == 0
    return capsys.readouterr().out


async def test_streamed_output_equals_the_non_streamed_one(capsys):
    async with sim_worker("w0") as w, running_router([w.address]) as r:
        await r.wait_synced(1)
        # The sim worker's random byte tokens include partial UTF-8 sequences and specials
        # (chunks of ids without text once printed ids into the text; the worker now sends
        # such ids with the next text, decision 0030)
        options = client.GenerateOptions(max_new_tokens=48, seed=7)
        chunks = [m.chunk async for m in r.client.stream(PROMPT, options) if m.HasField("chunk")]
        assert any(t >= 0x80 for c in chunks for t in c.token_ids)
        expected = "".join(c.text for c in chunks)
        assert expected

        plain = await _run_cli(capsys, ["--router", r.address, *ARGS, PROMPT])
        streamed = await _run_cli(capsys, ["--router", r.address, *ARGS, "--stream", PROMPT])
    assert plain == expected + "\n"
    assert streamed == plain
