"""The container images (deploy/Dockerfile.cpu, deploy/Dockerfile.cuda). No Docker engine here: they
are parsed with BuildKit's own parser (the `dockerfile` package) and checked for what a build needs."""
from __future__ import annotations

import fnmatch
import http.server
import importlib
import threading
from pathlib import Path

import pytest

from saguaro_dist.deploy import k8s

dockerfile = pytest.importorskip("dockerfile", reason="Dockerfile parser: pip install dockerfile==3.4.0 (test extra)")

ROOT = Path(__file__).resolve().parents[1]
IMAGES = {"cpu": "-py311-cpu", "cuda": "-py311-gpu"}  # the official Ray image tag suffixes
INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}


def commands(kind: str) -> list:
    return dockerfile.parse_file(str(ROOT / "deploy" / f"Dockerfile.{kind}"))


def first(cmds: list, name: str):
    return next(c for c in cmds if c.cmd == name)


def last(cmds: list, name: str):
    return [c for c in cmds if c.cmd == name][-1]


def build_args(cmds: list) -> dict:
    return dict(c.value[0].split("=", 1) for c in cmds if c.cmd == "ARG" and "=" in c.value[0])


def context_includes(kind: str, source: str) -> bool:
    """Whether the Dockerfile's own .dockerignore (BuildKit reads <Dockerfile>.dockerignore) keeps source."""
    keep = True
    for line in (ROOT / "deploy" / f"Dockerfile.{kind}.dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        pattern, negate = (line[1:], True) if line.startswith("!") else (line, False)
        if fnmatch.fnmatch(source, pattern) or fnmatch.fnmatch(source.split("/")[0], pattern):
            keep = negate
    return keep


@pytest.mark.parametrize("kind", IMAGES)
def test_parses_with_known_instructions(kind):
    cmds = commands(kind)
    assert cmds and {c.cmd for c in cmds} <= INSTRUCTIONS
    assert [c.cmd for c in cmds if c.cmd not in ("ARG",)][0] == "FROM"


@pytest.mark.parametrize("kind", IMAGES)
def test_based_on_the_pinned_ray_image_for_python_311(kind):
    cmds = commands(kind)
    base = first(cmds, "FROM").value[0]
    assert base == "rayproject/ray:${RAY_VERSION}" + IMAGES[kind]
    assert build_args(cmds)["RAY_VERSION"] == k8s.RAY_VERSION  # the rayVersion the manifests declare


@pytest.mark.parametrize("kind", IMAGES)
def test_every_copied_file_exists_and_is_in_the_build_context(kind):
    copies = [c for c in commands(kind) if c.cmd in ("COPY", "ADD")]
    assert copies
    for copy in copies:
        assert not any(flag.startswith("--from") for flag in copy.flags)
        for source in copy.value[:-1]:
            assert (ROOT / source).exists(), f"Dockerfile.{kind} copies {source}, which is not in the repo"
            assert context_includes(kind, source), f"Dockerfile.{kind}.dockerignore leaves out {source}"


@pytest.mark.parametrize("kind", IMAGES)
def test_runs_as_a_non_root_user(kind):
    user = last(commands(kind), "USER").value[0]
    assert user not in ("root", "0") and not user.startswith("0:")
    assert int(user) == k8s.RAY_UID  # the uid the manifests' securityContext names


@pytest.fixture
def health_server():
    """A stand-in for Serve's proxy on a free port: 200 on /-/healthz, 503 elsewhere."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/-/healthz" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("kind", IMAGES)
def test_healthcheck_runs_an_importable_module(kind, health_server, monkeypatch):
    check = last(commands(kind), "HEALTHCHECK").value
    assert check[:3] == ("CMD", "python", "-m")
    module = importlib.import_module(check[3])
    monkeypatch.setenv("SAGUARO_HEALTHCHECK_URL", f"{health_server}/-/healthz")
    assert module.main() == 0
    monkeypatch.setenv("SAGUARO_HEALTHCHECK_URL", f"{health_server}/-/routes")
    assert module.main() == 1
    monkeypatch.setenv("SAGUARO_HEALTHCHECK_URL", "http://127.0.0.1:9/-/healthz")  # nothing listens
    assert module.main() == 1


@pytest.mark.parametrize("kind", IMAGES)
def test_default_command_serves_the_app(kind):
    cmd = last(commands(kind), "CMD")
    assert cmd.json and k8s.APP_IMPORT_PATH in " ".join(cmd.value)
    ports = {int(p) for c in commands(kind) if c.cmd == "EXPOSE" for p in c.value}
    assert {k8s.SERVE_PORT, k8s.METRICS_PORT} <= ports


@pytest.mark.parametrize("kind", IMAGES)
def test_the_weights_cache_is_made_for_the_user_before_it_runs(kind):
    """HF_HOME=/models/hf-cache, and nothing made /models: a plain `docker run` failed each Hub download with a
    PermissionError (uid 1000 cannot create it under /). Made and chowned as root, before USER 1000."""
    cmds = commands(kind)
    env = last(cmds, "ENV").value
    hf_home = dict(zip(env[::2], env[1::2]))["HF_HOME"]
    user, made = None, None
    for c in cmds:
        if c.cmd == "USER":
            user = c.value[0]
        elif c.cmd == "RUN" and f"mkdir -p {hf_home}" in c.value[0]:
            made = (user, [step.split() for step in c.value[0].split("&&")])
    assert made is not None, f"Dockerfile.{kind} never makes {hf_home}"
    run_as, steps = made
    assert run_as == "root"
    owned = [s[-1] for s in steps if s[:2] == ["chown", "-R"] and s[2].split(":")[0] == str(k8s.RAY_UID)]
    assert any(hf_home == top or hf_home.startswith(top.rstrip("/") + "/") for top in owned)
    assert last(cmds, "USER").value[0] == str(k8s.RAY_UID) and cmds.index(last(cmds, "USER")) > cmds.index(
        next(c for c in cmds if c.cmd == "RUN" and f"mkdir -p {hf_home}" in c.value[0]))
