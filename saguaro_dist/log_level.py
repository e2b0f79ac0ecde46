"""`saguaro --log-level` in processes the CLI did not start itself (Serve replicas, the engine's Ray actors): the
level travels as $SAGUARO_LOGGING_LEVEL (vLLM's VLLM_LOGGING_LEVEL), which a child actor inherits from its parent's
runtime_env; a manifest sets it with `saguaro deploy k8s --env SAGUARO_LOGGING_LEVEL=DEBUG` (the chart: extraEnv)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

LOG_LEVEL_ENV = "SAGUARO_LOGGING_LEVEL"
PACKAGE_LOGGER = "saguaro_dist"


def env_log_level() -> int | None:
    """The level $SAGUARO_LOGGING_LEVEL names; None where unset or no level (that one warned of)."""
    given = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
    level = logging.getLevelName(given) if given else None
    if given and not isinstance(level, int):
        log.warning("$%s=%r is no logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL): ignored", LOG_LEVEL_ENV, given)
        return None
    return level


def follow_env_log_level() -> None:
    """An actor's saguaro_dist loggers at $SAGUARO_LOGGING_LEVEL, where set (a Ray worker's own level else)."""
    level = env_log_level()
    if level is not None:
        logging.getLogger(PACKAGE_LOGGER).setLevel(level)
