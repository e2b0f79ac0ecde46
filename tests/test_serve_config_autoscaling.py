"""Autoscaling set in a Serve config's own `deployments:` section (`serve deploy`, `serve run config.yaml`,
KubeRay's serveConfigV2): Serve applies it after build_app, its autoscaling_config replacing the app's whole, so
Serve's default target of 2 requests per replica applies unless the file names one, and no app code can raise it.
Each replica then says so in its log, naming the setting that keeps its batch from filling (measured through
Serve's config deploy in session 89; that run, three apps in a fresh Ray, outgrew Serve's 60 s deploy wait on a
loaded CI box, so the check here is of the settings Serve hands the replica)."""
from __future__ import annotations

from saguaro_dist.serve.app import build_deployment, unfillable_batch

pytest_plugins = ["test_serve_fixtures"]


def test_settings_below_a_full_batch_are_found(serving_pair):
    args = {"model": serving_pair[0], "mode": "ar", "max_batch_size": 16}

    def found(**options):
        return unfillable_batch(build_deployment(args, **options)._bound_deployment._deployment_config, 16)
    assert found() == [] and found(autoscaling_config={"max_replicas": 2}) == []  # ours: a full batch
    assert found(autoscaling_config={"max_replicas": 2, "target_ongoing_requests": 4}) == [
        "autoscaling_config.target_ongoing_requests 4"]
    assert found(max_ongoing_requests=8) == ["max_ongoing_requests 8"]
