"""vLLM's runtime LoRA routes, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vllm/entrypoints/serve/lora/
api_router.py): present only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true at start-up (else a 404, as the routes are
absent), answering 200 with vLLM's plain-text "Success: ..." line. A load reaches the replica that takes the request:
the app refuses the variable with more than one replica (serve/app.py build_app), and each load and unload asks
Serve again (ServedModels: a config file's replica override applies after the builder ran)."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from saguaro_dist.serve.route_support import serving_state

LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # reload a name already loaded (from its new path, or its files again)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None  # vLLM's field, unused there too: the name says which


async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = serving_state(request)  # a load_inplace reload frees the id it replaces in the engine
    message = await state.models.load(body.lora_name, body.lora_path, body.load_inplace,
                                       getattr(state.engine, "remove_lora", None))
    return PlainTextResponse(message)


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = serving_state(request)  # the engine frees the adapter's slot too (vLLM's remove_lora)
    return PlainTextResponse(await state.models.unload(body.lora_name, getattr(state.engine, "remove_lora", None)))


def add_lora_routes(router) -> None:
    router.add_api_route(LORA_ROUTES[0], load_lora_adapter, methods=["POST"], name="_load_lora_adapter")
    router.add_api_route(LORA_ROUTES[1], unload_lora_adapter, methods=["POST"], name="_unload_lora_adapter")
