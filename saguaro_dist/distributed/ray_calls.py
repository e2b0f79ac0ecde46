"""Ray calls that never start a Ray. Ray's public get / wait / kill / get_runtime_context start a fresh local Ray
of Ray's defaults when none is up (its auto-init). An engine's own threads race a ray.shutdown() made on the
user's thread: a poll that came back just before it, then fetched, started an empty Ray where the engine's objects
have no owner ("owner unknown"), and the process died later waiting for that Ray's GCS (a CI failure). The
undecorated calls raise RaySystemError instead, which the engine reads as "Ray was shut down under it"; `call`
makes an actor call the same way."""
from __future__ import annotations

import ray


def _undecorated(api):
    return getattr(api, "__wrapped__", api)  # Ray wraps its auto-init APIs with functools.wraps


get = _undecorated(ray.get)
wait = _undecorated(ray.wait)
kill = _undecorated(ray.kill)
_runtime_context = _undecorated(ray.get_runtime_context)


def call(method, *args, **kwargs):
    """method.remote(*args, **kwargs) of an actor handle, never starting a Ray: ActorMethod._remote carries the
    auto-init too, so a call racing a ray.shutdown() started a fresh Ray where the actor is not. Once Ray is
    down it raises RaySystemError (the undecorated call alone fails an AttributeError on the gone core worker)."""
    submit = getattr(getattr(type(method), "_remote", None), "__wrapped__", None)
    if submit is None:  # a Ray whose actor calls carry no auto-init wrapper: nothing to step past
        return method.remote(*args, **kwargs)
    if not ray.is_initialized():
        raise ray.exceptions.RaySystemError("Ray is shut down: no actor call")
    try:
        return submit(method, args=args, kwargs=kwargs)
    except Exception as err:
        if ray.is_initialized():
            raise
        raise ray.exceptions.RaySystemError("Ray was shut down under an actor call") from err


def current_ray() -> tuple[str, str] | None:
    """(GCS address, job id) of the Ray this process is connected to, None once none is (never starts one). The
    address tells a fresh Ray from the one shut down: each Ray's first driver job has the same id."""
    if not ray.is_initialized():
        return None
    try:
        context = _runtime_context()
        return context.gcs_address, context.get_job_id()
    except Exception:  # noqa: BLE001 - shut down between the look and the call
        return None
