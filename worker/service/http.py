"""The worker's HTTP front: the shared OpenAI routes over ``WorkerGeneration``, plus what
SGLang's and vLLM's routers call on their workers, so ``sglang-router`` and ``vllm-router``
can front a kvroute fleet::

    GET  /model_info  /server_info          what sglang-router reads at registration
    POST /generate                          SGLang's native API (text or input_ids)
    POST /tokenize                          vLLM: {"prompt"} or {"messages"} -> token ids
    POST /v1/completions/render             vLLM: the token ids a request would be served on
    POST /v1/chat/completions/render
    POST /flush_cache                       drop the radix cache (only when idle, as SGLang)

``/model_info`` reports the model directory (or the served name) and a ``tokenizer_path``
only when that is a local directory: a router given a hub id would try to download it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from edge import http_front as hf
from edge import openai_api as oa
from edge.frontdoor import BadRequest, Internal, ServiceError
from kvroute_proto import kvroute_pb2 as pb
from worker.service.engine_runner import EngineRunner
from worker.service.generation import WorkerGeneration

# SGLang's finish_reason objects
_SGLANG_FINISH = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_MAX_CONTEXT: "length",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_UNSPECIFIED: "stop",
}


class WorkerHttpRoutes:
    """The compat routes of one worker (bound to its generation path and runner)."""

    def __init__(
        self,
        generation: WorkerGeneration,
        runner: EngineRunner,
        *,
        model_path: str | None,
        executor: str,
    ) -> None:
        self.generation = generation
        self.runner = runner
        self.model_path = model_path
        self.executor = executor

    def routes(self) -> list[web.AbstractRouteDef]:
        return [
            web.get("/model_info", self.model_info),
            web.get("/server_info", self.server_info),
            web.post("/generate", self.generate),
            web.post("/tokenize", self.tokenize),
            web.post("/v1/completions/render", self.render_completion),
            web.post("/v1/chat/completions/render", self.render_chat),
            web.post("/flush_cache", self.flush_cache),
        ]

    # ---- info ----------------------------------------------------------------------------

    def _model_info(self) -> dict[str, Any]:
        # Only a local directory as model_path/tokenizer_path: sglang-router loads the
        # tokenizer from model_path and tries the HuggingFace hub for anything else.
        info: dict[str, Any] = {
            "served_model_name": self.generation.model_name,
            "is_generation": True,
        }
        if self.model_path and Path(self.model_path).is_dir():
            local = str(Path(self.model_path).resolve())
            info["model_path"] = info["tokenizer_path"] = local
        return info

    async def model_info(self, request: web.Request) -> web.Response:
        return hf.json_response(self._model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        i = self.generation.info
        return hf.json_response(
            {
                **self._model_info(),
                "worker_id": i.worker_id,
                "executor": self.executor,
                "context_length": i.max_context_tokens,
                "max_model_len": i.max_context_tokens,
                "max_total_num_tokens": i.kv_capacity_tokens,
                "page_size": i.page_size,
                "block_size": i.block_size,
                "vocab_size": i.vocab_size,
                "tp_size": 1,
                "dp_size": 1,
            }
        )

    # ---- tokenization (vLLM's router tokenizes through its workers) ----------------------

    def _encode(self, text: str) -> list[int]:
        tok = self.generation.tokenizer
        if tok is None:
            raise BadRequest("this worker has no tokenizer; send token ids")
        return list(tok.encode(text))

    def _prompt_ids(self, body: dict[str, Any], kind: oa.Kind) -> list[int]:
        if kind == "chat":
            messages = oa.parse_messages(body.get("messages"))
            rendered = oa.chat_prompt(messages, self.generation.tokenizer)
            return self._encode(rendered) if isinstance(rendered, str) else rendered
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise BadRequest("prompt: must be a string or a list of token ids", param="prompt")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await hf.read_json(request)
        ids = self._prompt_ids(body, "chat" if "messages" in body else "completion")
        return hf.json_response(
            {
                "tokens": ids,
                "count": len(ids),
                "max_model_len": self.generation.info.max_context_tokens,
            }
        )

    async def render_completion(self, request: web.Request) -> web.Response:
        # vLLM answers a list of token-in GenerateRequests, one per prompt
        body = await hf.read_json(request)
        oa.check_model(body, self.generation.model_name)
        return hf.json_response([self._rendered(body, self._prompt_ids(body, "completion"))])

    async def render_chat(self, request: web.Request) -> web.Response:
        body = await hf.read_json(request)
        oa.check_model(body, self.generation.model_name)
        return hf.json_response(self._rendered(body, self._prompt_ids(body, "chat")))

    def _rendered(self, body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        return {
            "request_id": uuid.uuid4().hex,
            "model": self.generation.model_name,
            "token_ids": ids,
            "prompt_token_ids": ids,
            "sampling_params": {"max_tokens": max_tokens},
        }

    # ---- cache ---------------------------------------------------------------------------

    async def flush_cache(self, request: web.Request) -> web.Response:
        flushed = await self.runner.flush_cache()
        if not flushed:
            return hf.json_response(
                oa.plain_error_body(
                    "cache not flushed: requests are in flight (flush only when idle)",
                    "invalid_request_error",
                    code="busy",
                ),
                status=400,
            )
        return web.Response(text="Cache flushed.\n")

    # ---- SGLang's /generate --------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native generate: ``text`` or ``input_ids``, ``sampling_params``,
        ``stream``. Streamed events carry the text and ids so far (SGLang's default)."""
        body = await hf.read_json(request)
        rid = hf.request_id_of(request)
        if isinstance(body.get("rid"), str) and hf.REQUEST_ID_HEADER not in request.headers:
            rid = oa.check_request_id(body["rid"])
        api = oa.parse_completion(
            _as_completion(body),
            model_name=self.generation.model_name,
            request_id=rid,
            tokenizer=self.generation.tokenizer,
        )
        if api.n != 1:
            raise BadRequest("n: /generate serves one sequence per request", param="n")
        out = oa.ApiOutput(api)
        ids: list[int] = []
        messages_it = self.generation.generate(api.request, hf.call_info(request))
        async with hf.closing(messages_it) as messages:
            if not api.stream:
                async for msg in messages:
                    if out.push(msg) is not None:  # a chunk (its text may be held back)
                        ids.extend(msg.chunk.token_ids)
                if out.finished is None:
                    raise Internal("the stream ended without a Finished message")
                headers = {hf.REQUEST_ID_HEADER: rid, hf.WORKER_ID_HEADER: out.finished.worker_id}
                return hf.json_response(_sglang_body(out, ids, rid), headers=headers)
            first = await anext(messages, None)
            resp = await hf.start_sse(request, {hf.REQUEST_ID_HEADER: rid})
            try:
                msg = first
                while msg is not None:
                    if out.push(msg) is not None:
                        ids.extend(msg.chunk.token_ids)
                    await resp.write(oa.sse_event(_sglang_body(out, ids, rid)))
                    msg = await anext(messages, None)
            except ServiceError as exc:
                await resp.write(oa.sse_event(oa.error_body(exc)))
            await resp.write_eof(oa.SSE_DONE)
            return resp


def _as_completion(body: dict[str, Any]) -> dict[str, Any]:
    """An SGLang generate body as the completion fields it means."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("set exactly one of text or input_ids", param="text")
    if isinstance(text, list):
        raise BadRequest("text: batches are not supported; send one request per prompt")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params: must be an object", param="sampling_params")
    fields: dict[str, Any] = {"prompt": text if text is not None else input_ids}
    for ours, theirs in (
        ("max_tokens", "max_new_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("ignore_eos", "ignore_eos"),
        ("stop", "stop"),
        ("stop_token_ids", "stop_token_ids"),
        ("seed", "sampling_seed"),
        ("n", "n"),
    ):
        if sp.get(theirs) is not None:
            fields[ours] = sp[theirs]
    fields["stream"] = body.get("stream", False)
    return fields


def _sglang_body(out: oa.ApiOutput, ids: list[int], rid: str) -> dict[str, Any]:
    f = out.finished
    usage = out.usage()
    finish: dict[str, Any] | None = None
    if f is not None:
        finish = {"type": _SGLANG_FINISH[f.reason]}
        if f.reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_MAX_CONTEXT):
            finish["length"] = usage["completion_tokens"]
        elif f.reason == pb.FINISH_REASON_STOP and ids:
            finish["matched"] = ids[-1]
    return {
        "text": out.text,
        "output_ids": list(ids),
        "meta_info": {
            "id": rid,
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"] if f else len(ids),
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "finish_reason": finish,
            "worker_id": f.worker_id if f else None,
        },
    }


def build_worker_app(
    generation: WorkerGeneration,
    runner: EngineRunner,
    health_check: Callable[[], str | None],
    *,
    model_path: str | None,
    executor: str,
    max_body_bytes: int = hf.DEFAULT_MAX_BODY_BYTES,
    middlewares: Iterable[Any] = (),
) -> web.Application:
    """The worker's HTTP app: the OpenAI routes and the SGLang/vLLM compat routes
    (``middlewares``: e.g. the router-token check, edge.auth)."""
    routes = WorkerHttpRoutes(generation, runner, model_path=model_path, executor=executor)
    return hf.build_app(
        generation,
        health_check,
        max_body_bytes=max_body_bytes,
        extra_routes=routes.routes(),
        middlewares=middlewares,
    )
