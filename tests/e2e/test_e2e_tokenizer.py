"""End to end with a real BPE tokenizer: the router tokenizes text prompts with the fleet's
tokenizer (``kvroute router --model DIR``), so the block hashes of a text prompt are those of
the token ids the workers cache and report in their KV events.

Real processes: two torch workers serving the tiny random Llama with a byte-level BPE trained
here (bench.bpe), and a router, each ``python -m kvroute_cli``. A second text prompt sharing
a long prefix with the first is matched from the first worker's events, and sent there.
"""

from __future__ import annotations

import pytest
from e2e_procs import procs, until

from bench.bpe import write_bpe_model_dir
from edge.tokenizer import load_tokenizer
from router.cli.client import GenerateOptions, RouterClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

BLOCK = 4
OPTS = GenerateOptions(max_new_tokens=2)
PREFIX = (
    "You are a customer support agent for a shipping company. Answer politely and carefully, "
    "explain the refund policy when asked, and summarise the order before you answer. "
    "The customer account holds three orders; the first was shipped in the morning, the "
    "second is in the queue, and the third is waiting for a document. "
)
FIRST = PREFIX + "Question: where is my first order?"
SECOND = PREFIX + "Question: can I get a refund for the second order?"
# long enough (over two of the router's 512-character chunks) for its tail to be left to
# the worker
THIRD = PREFIX + " ".join(
    f"Order {i} holds {i % 7 + 1} parcels sent to warehouse {i % 5}, each of them insured."
    for i in range(40)
)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_bpe_model_dir(tmp_path_factory.mktemp("m") / "bpe-tiny"))


async def test_text_prompts_match_the_workers_events(model_dir):
    tok = load_tokenizer(model_dir)
    first_ids, second_ids = tok.encode(FIRST), tok.encode(SECOND)
    shared = _common_prefix(first_ids, second_ids) // BLOCK * BLOCK
    assert shared >= 10 * BLOCK  # many blocks; and far fewer tokens than UTF-8 bytes
    assert len(second_ids) < len(SECOND.encode()) // 2

    with procs() as p:
        model = ["--model", model_dir, "--kv-slots", "4096"]
        w0 = p.worker("w0", *model, executor="torch")
        w1 = p.worker("w1", *model, executor="torch")
        router = p.router([w0.address, w1.address], "--model", model_dir)
        async with RouterClient(router.address, timeout_s=30) as client:

            async def both_healthy():
                expl = await client.explain("hello")
                return len(expl.workers) == 2 and all(w.healthy for w in expl.workers)

            await until(both_healthy, "the router never took both workers (fingerprints?)")
            # the router counts the prompt in BPE tokens, not bytes
            assert (await client.explain(SECOND)).prompt_tokens == len(second_ids)

            first = await client.generate(FIRST, OPTS)
            holder = first.worker_id
            other = "w1" if holder == "w0" else "w0"
            assert first.prompt_tokens == len(first_ids)

            async def holder_idle():
                # the holder's load report has seen the last request end: a report from
                # before its end still counts it running, which the cost charges
                expl = await client.explain("hello")
                return {w.worker_id: w for w in expl.workers}[holder].num_running == 0

            async def confirmed():
                expl = await client.explain(SECOND)
                by_id = {w.worker_id: w for w in expl.workers}
                return expl if by_id[holder].event_matched_tokens >= shared else None

            expl = await until(confirmed, "the first prompt's KV events never matched the second")
            await until(holder_idle, "the holder never reported the first request's end")
            expl = await client.explain(SECOND)
            by_id = {w.worker_id: w for w in expl.workers}
            # from the worker's events: exactly the shared whole blocks; nothing elsewhere
            assert by_id[holder].event_matched_tokens == shared
            assert by_id[other].event_matched_tokens == 0
            assert by_id[holder].matched_tokens >= shared
            # the router's own prediction is stride-granular (or lapsed): never more
            assert by_id[holder].predicted_matched_tokens <= shared
            assert expl.chosen_worker_id == holder, expl  # the costs, if it ever differs

            second = await client.generate(SECOND, OPTS)
            assert second.worker_id == holder
            assert second.prompt_tokens == len(second_ids)
            assert second.cached_prompt_tokens >= shared  # the worker's radix cache agrees

            # A long prompt: the router tokenizes its head as far as a cache may match and
            # the worker the rest (prompt_text_suffix); the worker serves the whole text's
            # ids, so its count and its cache hit are those of the whole encoding.
            await until(holder_idle, "the holder never reported the second request's end")
            third = await client.generate(THIRD, OPTS)
            third_ids = tok.encode(THIRD)
            assert third.worker_id == holder
            assert third.prompt_tokens == len(third_ids)
            assert (
                third.cached_prompt_tokens >= _common_prefix(first_ids, third_ids) // BLOCK * BLOCK
            )
            await until(holder_idle, "the holder never reported the third request's end")
            again = await client.generate(THIRD, OPTS)  # its own blocks are cached now
            assert again.worker_id == holder
            assert again.cached_prompt_tokens >= (len(third_ids) - 1) // BLOCK * BLOCK
