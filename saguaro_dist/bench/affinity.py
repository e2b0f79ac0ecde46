"""CPU pinning of the benched systems: a setting's cores made real where the OS can pin (Linux).

Torch thread counts alone let the processes float: *paper*'s "target on 1 core, SSD's draft on the
other" held only on average. Here the bench process (target, and every baseline) and SSD's draft child
are pinned with os.sched_setaffinity. It sets one thread, and a new thread inherits its starter's, so a
process is pinned thread by thread (/proc/<pid>/task)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)
DRAFT_PROCESS_SYSTEMS = ("ssd", "ssd-split", "ssd-process", "ssd-trees", "ssd-draft", "ssd-k")  # on the CPU


@dataclass(frozen=True)
class Pinning:
    """The CPUs a system's processes run on; () where not pinned (`text` says why)."""
    target_cpus: tuple[int, ...]
    draft_cpus: tuple[int, ...]
    host_cpus: tuple[int, ...]   # the bench's own before pinning: restored after the system ran
    text: str


def host_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on; () where the OS cannot pin (no sched_setaffinity: macOS, Windows)."""
    if not hasattr(os, "sched_setaffinity"):
        return ()
    return tuple(sorted(os.sched_getaffinity(0)))


def cpu_list(cpus: tuple[int, ...]) -> str:
    """cpu0, cpu0-1, cpu0,2 (the kernel's Cpus_allowed_list, prefixed)."""
    if len(cpus) > 1 and cpus == tuple(range(cpus[0], cpus[-1] + 1)):
        return f"cpu{cpus[0]}-{cpus[-1]}"
    return "cpu" + ",".join(map(str, cpus))


def plan_pinning(system: str, setting: str, cores: int, has_draft: bool, cpus: tuple[int, ...]) -> Pinning:
    """*paper*: the target's process on the first CPU, a draft child process on the second (a one-process
    system uses its one core; ssd-thread's draft thread shares its process's two). *equal*: every process
    of the system on the first `cores` CPUs. Pure: `cpus` is host_cpus()."""
    def unpinned(why: str) -> Pinning:
        return Pinning((), (), cpus, f"not pinned ({why})")
    if system.startswith("ssd-ray"):
        return unpinned("Ray's actor processes are not the bench's children")
    if not cpus:
        return unpinned("this OS cannot set CPU affinity")
    if len(cpus) < cores:
        return unpinned(f"{len(cpus)} CPU(s) available to the bench, {cores} needed")
    use = cpus[:cores]
    if setting == "paper" and system in DRAFT_PROCESS_SYSTEMS:
        return Pinning(use[:1], use[1:2], cpus, f"target {cpu_list(use[:1])}, draft process {cpu_list(use[1:2])}")
    who = "target + draft" if has_draft else "target"
    return Pinning(use, use if has_draft else (), cpus, f"{who} {cpu_list(use)}")


def pin_process(pid: int, cpus: tuple[int, ...]) -> None:
    """Every thread of `pid` on `cpus` (threads it starts later inherit their starter's)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:  # no /proc: the one thread the call reaches
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def draft_children() -> set[int]:
    """The pids of this process's draft child processes (engine/draft_process_parent.py starts them)."""
    from saguaro_dist.engine.draft_process_parent import CHILD_MODULE
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
            if ppid == me:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if CHILD_MODULE.encode() in f.read().split(b"\0"):
                        found.add(int(entry))
        except (OSError, IndexError, ValueError):  # it ended meanwhile
            continue
    return found


def pin_system(pinning: Pinning, children: set[int]) -> tuple[tuple[int, ...], str]:
    """Pin the bench process and the system's draft child processes: the bench process's CPUs and what runs
    where. A system left unpinned runs on the bench's own CPUs (host_cpus; () where the OS cannot pin), not on
    the cores of a system opened before it (--interleave and serving open all at once): the Ray that ssd-ray
    starts inherited those, and its target and draft actors shared one core under "not pinned"."""
    if not pinning.target_cpus:
        on_host_cpus(pinning)
        return pinning.host_cpus, pinning.text
    target = pinning.target_cpus if children else tuple(sorted({*pinning.target_cpus, *pinning.draft_cpus}))
    pin_process(os.getpid(), target)  # no child (a draft thread, as on a GPU): the draft shares the process
    for pid in children:
        pin_process(pid, pinning.draft_cpus)
    done = f"bench process {cpu_list(target)}" + "".join(f", draft pid {p} {cpu_list(pinning.draft_cpus)}"
                                                         for p in sorted(children))
    log.info("bench: pinned %s", done)
    return target, done


def unpin(pinning: Pinning) -> None:
    """The bench process back on the CPUs it had before the system pinned it."""
    if pinning.target_cpus:
        on_host_cpus(pinning)


def on_host_cpus(pinning: Pinning) -> None:
    """The bench process on its own CPUs (host_cpus), whatever system pinned it last; nothing where the OS
    cannot pin. Before a system starts its processes: they inherit the CPUs of the thread that starts them."""
    if pinning.host_cpus:
        pin_process(os.getpid(), pinning.host_cpus)
