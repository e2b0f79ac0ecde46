"""The API app's routes that generate nothing: /health, /v1/models, /version, /reset_prefix_cache, /tokenize and
/detokenize (api.py adds them to its router)."""
from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from saguaro_dist.engine.loop_thread import EngineError
from saguaro_dist.engine.text import encode_text
from saguaro_dist.serve.errors import APIError
from saguaro_dist.serve.prompts import encode_chat
from saguaro_dist.serve.protocol import DetokenizeRequest, TokenizeRequest
from saguaro_dist.serve.route_support import serving_state


async def health(request: Request) -> JSONResponse:
    """200 while the engine serves; 503 once it cannot (vLLM's rule), so a load balancer or a Kubernetes probe
    stops sending it traffic while Ray Serve replaces the replica (SaguaroServer.check_health)."""
    try:
        serving_state(request).engine.check_health()
    except EngineError as err:
        raise APIError(503, f"the engine cannot serve: {err}") from None
    return JSONResponse({"status": "ok"})


async def reset_prefix_cache(request: Request) -> Response:
    """vLLM's admin route: forget every kept prefix (target and draft); 200 with no body."""
    await asyncio.to_thread(serving_state(request).engine.reset_prefix_cache)  # waits for the engine's loop thread
    return Response(status_code=200)


async def version() -> dict:
    from saguaro_dist import __version__
    return {"version": __version__}


async def models(request: Request) -> dict:
    state = serving_state(request)
    return {"object": "list", "data": state.models.cards(state.max_model_len)}  # the base names, then adapters


async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state = serving_state(request)
    state.check_model(body.model)
    if body.messages is not None:
        messages = [m.with_calls_as_written() for m in body.messages] if state.harmony else body.messages
        tokens = encode_chat(state.tokenizer, messages, body.tools, body.chat_template_kwargs, state.chat_template,
                             end=body.prompt_end(), add_special_tokens=body.special_tokens())
    else:
        tokens = encode_text(state.tokenizer, body.prompt, add_special_tokens=body.special_tokens())
    return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}


async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = serving_state(request)
    state.check_model(body.model)
    if any(t < 0 or t >= len(state.tokenizer) for t in body.tokens):
        raise APIError(400, f"tokens must be ids in [0, {len(state.tokenizer)})", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}
