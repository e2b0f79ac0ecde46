"""Flags that the rest of a command line leaves unused are errors, never silently dropped: a draft with a
mode that runs none, SSD's knobs with SD, engine flags beside --url (the server runs its own engine)."""
from __future__ import annotations

import argparse
import logging
from urllib.parse import urlsplit

from saguaro_dist.config import DRAFT_MODES, MODE_FIELDS, Mode

log = logging.getLogger(__name__)

# flag dest -> the modes that use it (the engine flags' and `saguaro deploy k8s`'s; the rest apply to every mode):
# Config's fields (config.py MODE_FIELDS), and the draft pool's flags that are no Config field
MODE_FLAGS = {**MODE_FIELDS, **dict.fromkeys(("draft_workers", "draft_max_workers", "draft_cpu", "draft_memory"),
                                             DRAFT_MODES)}
FLAG_NAMES = {"model_tag": "MODEL", "log_stats_interval_s": "--disable-log-stats", "engine_seed": "--seed"}  # dests not named after their flag


def flag_name(dest: str, value=None) -> str:
    """The flag a dest was given by (`--no-X` for a BooleanOptionalAction's False)."""
    return FLAG_NAMES.get(dest) or "--" + ("no-" if value is False else "") + dest.replace("_", "-")


def given(ns: argparse.Namespace, dests, unset=(None,)) -> dict:
    """dest -> value of the flags among `dests` the command line gave: their defaults are `unset` (None; add
    False for store_true flags), so a default never counts; an empty string is no value (`--draft ""`: none)."""
    values = {d: getattr(ns, d, None) for d in dests}
    return {d: v for d, v in values.items() if v != "" and not any(v is u for u in unset)}  # `is`: 0 == False


def check_mode_flags(ns: argparse.Namespace, mode: Mode, implied: bool) -> None:
    """Refuse the flags `mode` leaves unused. implied: no --mode was given (a model alone runs ar). A --k
    beside an explicit --mode ar is let pass with a warning: scripts compare ar with the other modes at one K."""
    unused = {d: v for d, v in given(ns, MODE_FLAGS).items() if mode not in MODE_FLAGS[d]}
    if mode is Mode.AR and not implied and unused.pop("k", None) is not None:
        log.warning("--k is unused by --mode ar (it speculates nothing)")
    if unused:
        raise ValueError(_unused_message(unused, mode, implied))


def _unused_message(unused: dict, mode: Mode, implied: bool) -> str:
    uses = [f"{flag_name(d, v)} applies only to --mode {' / '.join(m.value for m in Mode if m in MODE_FLAGS[d])}"
            for d, v in unused.items()]
    why = " (a model without --draft runs autoregressively)" if implied else ""
    return f"{'; '.join(uses)}; the mode is {mode.value}{why}: drop it, or choose a mode that uses it"


def refuse_with_url(ns: argparse.Namespace, dests, why: str) -> None:
    """With --url the server does the work: flags that configure this process's own engine would go unused."""
    unused = given(ns, dests) if ns.url else {}
    if unused:
        raise ValueError(f"{', '.join(flag_name(d, v) for d, v in unused.items())}: unused with --url ({why})")


def refuse_without(ns: argparse.Namespace, dests, needed: str) -> None:
    """Flags that apply only beside `needed` (a dest; its flag names it in the message)."""
    unused = {} if getattr(ns, needed) else given(ns, dests)
    if unused:
        raise ValueError(f"{', '.join(flag_name(d, v) for d, v in unused.items())} only applies with {flag_name(needed)}")


def check_url(url: str | None) -> None:
    """--url names a server: without its scheme every request failed (one line at a time, in run-batch); a
    port past 65535 or an unclosed "[::1" ended run-batch and generate in a stack trace (OverflowError, InvalidURL).
    The scheme in any case (RFC 3986; httpx lowercases it): HTTP://host was refused."""
    if url is not None and not (url.lower().startswith(("http://", "https://")) and _host_and_port(url)):
        raise ValueError(f"--url must be a server's address, http://host:port or https://..., got {url!r}")


def _host_and_port(url: str) -> bool:
    """Whether the URL names a host, and a port (if any) in 1..65535."""
    try:
        parts = urlsplit(url)
        return bool(parts.hostname) and (parts.port is None or 0 < parts.port)  # .port: ValueError past 65535
    except ValueError:
        return False
