"""Where Ray puts the target ranks and the draft workers.

Target ranks and draft workers ask for the custom resources named in saguaro_dist.placement when the
cluster advertises them (the KubeRay worker groups do), so each pool lands on its own nodes; on a
cluster without them (a laptop, CI) they take plain CPUs / GPUs, drafts spread over nodes. An actor on CPUs
asks for one CPU per torch thread it runs, an actor on a GPU for the GPU alone (_device_resources).
"""
from __future__ import annotations

from collections import Counter

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from saguaro_dist.config import Config
from saguaro_dist.placement import DRAFT_RESOURCE, RESOURCE_PER_ACTOR, TARGET_RESOURCE


def actor_threads(threads: int | None) -> int:
    """The torch threads a Ray actor runs (Config's target_threads / draft_threads; None: 1, not torch's default
    of every core of the node, which the node's other actors share)."""
    return threads or 1


def _device_resources(device: str, threads: int | None) -> dict:
    """A CPU actor reserves a CPU per torch thread, so Ray packs no other actor onto the cores its matmuls
    spin on. A GPU actor asks for its GPU alone, as vLLM's Ray workers do (num_cpus=0): its host side is one
    thread launching kernels, and GPU nodes often give Ray fewer CPUs than that would add up to (the
    deploy generator sizes GPU pods for the Serve replica's CPU only)."""
    return {"GPU": 1} if device.startswith("cuda") else {"CPU": actor_threads(threads)}


def target_bundle(config: Config, cluster_resources: dict) -> dict:
    """One placement-group bundle per tensor-parallel rank."""
    bundle = _device_resources(config.device, config.target_threads) | dict(config.target_resources)
    if TARGET_RESOURCE in cluster_resources:
        bundle[TARGET_RESOURCE] = RESOURCE_PER_ACTOR
    return bundle


def draft_options(config: Config, cluster_resources: dict) -> dict:
    """Ray actor options for one draft worker."""
    resources = dict(config.draft_resources)
    if DRAFT_RESOURCE in cluster_resources:
        resources[DRAFT_RESOURCE] = RESOURCE_PER_ACTOR
    # a CPU draft pool may serve a GPU target
    device = _device_resources(config.draft_device_resolved, config.draft_threads)
    opts = {"num_cpus": device.get("CPU", 0), "num_gpus": device.get("GPU", 0), "resources": resources}
    if not resources:
        opts["scheduling_strategy"] = "SPREAD"  # no labels to go by: at least keep drafts apart
    return opts


def engine_needs(config: Config, cluster_resources: dict) -> dict:
    """Resources the engine's actors ask for in all: tensor_parallel_size target bundles and, unless AR,
    num_draft_workers draft workers (Ray's names: CPU, GPU, custom ones)."""
    need = Counter({name: amount * config.tensor_parallel_size
                    for name, amount in target_bundle(config, cluster_resources).items()})
    if config.uses_draft:
        opts = draft_options(config, cluster_resources)
        draft = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"], **opts["resources"]}
        need.update({name: amount * config.num_draft_workers for name, amount in draft.items()})
    return {name: amount for name, amount in need.items() if amount}


def local_cpus_needed(config: Config) -> int:
    """Logical CPUs an embedded Ray (cluster="local") needs for the engine's actors, and one to spare (the
    driver's tasks, a Serve replica beside the engine): fewer, and a rank or draft waited for ever."""
    return int(engine_needs(config, {}).get("CPU", 0)) + 1


def shortfall(need: dict, free: dict) -> dict:
    """What `need` asks beyond `free`, per resource (empty: it fits, as far as totals go)."""
    return {name: amount - free.get(name, 0) for name, amount in need.items() if amount > free.get(name, 0)}


def target_placement(config: Config, cluster_resources: dict, timeout_s: float = 120.0):
    """A STRICT_PACK placement group of tensor_parallel_size bundles (one node, as NCCL/gloo TP wants)."""
    pg = placement_group([target_bundle(config, cluster_resources)] * config.tensor_parallel_size,
                         strategy="STRICT_PACK", name="")
    try:  # not pg.wait(timeout_s): it takes whole seconds, and cut 0.9 s to 0 (False at once, for a group that fits)
        ray.get(pg.ready(), timeout=timeout_s)
    except BaseException as err:  # a Ctrl-C too: the caller never learns of this group, so it cannot remove it
        ray.util.remove_placement_group(pg)
        if isinstance(err, ray.exceptions.GetTimeoutError):
            raise RuntimeError(f"no node can host {config.tensor_parallel_size} target ranks with "
                               f"{target_bundle(config, cluster_resources)} each (waited {timeout_s:.1f} s). "
                               f"Free now: {ray.available_resources()}") from None
        raise
    return pg


def rank_strategy(pg, rank: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)
