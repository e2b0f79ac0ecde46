"""The draft pool is fixed: the engine starts num_draft_workers draft workers once (distributed/deployment.py
start_drafts) and one target pod's ranks, and never asks Ray for more. An autoscaler adds a node only for
resources that work asks for and no node has, so one would never add a draft pod: K8sSettings and `saguaro
deploy k8s` refuse autoscaling as the Helm chart does (templates/_helpers.tpl, saguaro.checkAutoscaling)."""
from __future__ import annotations

from collections.abc import Callable


def fixed_pool_reason(draft_workers: int, workers_name: str) -> str:
    """The chart's explanation, with the draft pool's option spelled as the caller knows it."""
    return (f"the engine runs a fixed pool: {workers_name} ({draft_workers}) draft workers, started once, and one "
            f"target pod; it never asks Ray for more, so Ray's autoscaler would add no pod. Set {workers_name} to "
            f'the draft pool you want (docs/deploy.md, "Scale the draft pool")')


def check_fixed_draft_pool(autoscaling: bool, draft_max_workers: int | None, idle_timeout_s: int | None,
                           draft_workers: int, name: Callable[[str], str] = str) -> None:
    """Refuse what asks for a pool that grows; draft_max_workers may only repeat draft_workers. name: a field's
    name in the message (the CLI's flag_name for its flags)."""
    why = fixed_pool_reason(draft_workers, name("draft_workers"))
    if autoscaling:
        raise ValueError(f"{name('autoscaling')} is not supported: {why}")
    if draft_max_workers is not None and draft_max_workers != draft_workers:
        raise ValueError(f"{name('draft_max_workers')} {draft_max_workers} is not supported: {why}")
    if idle_timeout_s is not None:  # it timed the autoscaler's removal of idle extra draft pods: there are none
        raise ValueError(f"{name('idle_timeout_s')} is not supported (no pod is ever added, so none idles): {why}")
