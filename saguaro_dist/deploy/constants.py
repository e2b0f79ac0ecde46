"""Fixed names, ports and Kubernetes' name rules shared by the manifest builders (and mirrored by the chart)."""
from __future__ import annotations

import re

DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # Kubernetes' rule for a Service's name
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # a Secret's name
# Kubernetes' rule for a key in a Secret's data (IsConfigMapKey): [-._a-zA-Z0-9]+, but not "." or ".." nor "..x"
SECRET_KEY = re.compile(r"\.?[-_a-zA-Z0-9][-._a-zA-Z0-9]*")
# a label value (a nodeSelector's): at most 63 characters, letters or digits at the ends
LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?")
MAX_SUBDOMAIN = 253  # a DNS-1123 subdomain's (and a Secret key's) longest
# HOST:PORT of a Redis: a DNS name or IPv4 address, a port 1-65535 (the values schema has the same pattern)
PORT = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
REDIS_ADDRESS = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*:" + PORT)

APP_IMPORT_PATH = "saguaro_dist.serve.app:build_app"
APP_NAME = "saguaro"
DEPLOYMENT_NAME = "SaguaroServer"  # the app's one Serve deployment (saguaro_dist/serve/app.py; tests check they agree)
CHART_NAME = "saguaro-dist"
APP_VERSION = "0.1.0"
RAY_VERSION = "2.60.0"
SERVE_PORT = 8000
METRICS_PORT = 8080  # Ray's metrics export port on every node
DASHBOARD_PORT = 8265
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"  # set by NVIDIA GPU feature discovery
MODELS_MOUNT = "/models"
RAY_UID = 1000  # the `ray` user of the official Ray images
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"  # Ray's SIGTERM drain window (`ray start --block`)
DRAIN_MARGIN_S = 15  # after the drain window: the raylet and its workers exit before Kubernetes' SIGKILL
# Pod-template annotations carrying the pools' sizes: KubeRay's RayService leaves the workers' replicas out of the
# cluster spec's hash (kuberay#2333), so without them a new draft_workers changed no hashed field, rolled out no new
# cluster, and the new serveConfigV2 asked the old cluster's pods for more draft slots than they have
DRAFT_WORKERS_ANNOTATION = "saguaro-dist/draft-workers"
TP_ANNOTATION = "saguaro-dist/tp"
