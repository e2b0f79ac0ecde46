"""vLLM's HTTP-frontend flags of `saguaro serve`: CORS, --root-path, --disable-fastapi-docs, TLS and the HTTP
servers' logging. Real HTTP to the app under plain uvicorn over a tiny real engine; the flags' errors through
the real command line; and one `saguaro serve` subprocess per ingress serving HTTPS with a self-signed
certificate made here."""
from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from http_helpers import serve_on_loopback
from saguaro_dist import LLM
from saguaro_dist.cli import main
from saguaro_dist.cli.frontend_flags import serve_logging_config
from saguaro_dist.serve.api import ServerOptions, create_app
from saguaro_dist.serve.args import config_from_args
from saguaro_dist.serve.frontend import FrontendOptions, frontend_options
from test_serve_fixtures import free_port, make_tokenizer, write_llama

pytest_plugins = ["test_serve_fixtures"]
KEY = "frontend-key"
PREFLIGHT = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_llama(tmp_path_factory.mktemp("frontend"), make_tokenizer(), hidden=32, layers=1, seed=5)
    with LLM(model=path, mode="ar", max_model_len=128, max_batch_size=1) as engine:
        yield engine


def _served(llm, **frontend):
    """The app as a replica builds it, with an API key, on a real loopback port; yields its root URL."""
    app = create_app(llm, ServerOptions("m", api_key=KEY, frontend=FrontendOptions(**frontend)))
    return serve_on_loopback(app)


def _root(url: str) -> str:
    return url.removesuffix("/v1")


def test_a_cors_preflight_is_answered_for_any_origin_by_default_without_the_api_key(llm):
    """vLLM's defaults (origins, methods, headers ["*"]): a browser's preflight carries no key, so it must
    be answered before the key check; the real request then carries the allow-origin header."""
    with _served(llm) as url:
        pre = httpx.options(f"{url}/chat/completions", headers=PREFLIGHT)
        got = httpx.get(f"{url}/models", headers={"Origin": "https://ui.example", "Authorization": f"Bearer {KEY}"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert got.status_code == 200 and got.headers["access-control-allow-origin"] == "*"


def test_cors_allows_only_the_listed_origins_methods_and_credentials(llm):
    with _served(llm, allowed_origins=("https://ui.example",), allowed_methods=("GET", "POST"),
                 allowed_headers=("authorization", "content-type"), allow_credentials=True) as url:
        ok = httpx.options(f"{url}/completions", headers=PREFLIGHT)
        other = httpx.options(f"{url}/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        put = httpx.options(f"{url}/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "PUT"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert put.status_code == 400


def test_root_path_serves_under_the_prefix_whether_the_proxy_strips_it_or_not(llm):
    auth = {"Authorization": f"Bearer {KEY}"}
    with _served(llm, root_path="/llm") as url:
        root = _root(url)
        kept = httpx.get(f"{root}/llm/v1/models", headers=auth)
        stripped = httpx.get(f"{root}/v1/models", headers=auth)
        health = httpx.get(f"{root}/llm/health")  # still open without the key under the prefix
        schema = httpx.get(f"{root}/llm/openapi.json", headers=auth)
    assert kept.status_code == 200 and kept.json()["data"][0]["id"] == "m"
    assert stripped.status_code == 200
    assert health.status_code == 200
    assert schema.status_code == 200 and schema.json()["servers"] == [{"url": "/llm"}]


def test_the_openapi_docs_are_served_by_default_and_gone_with_disable_fastapi_docs(llm):
    auth = {"Authorization": f"Bearer {KEY}"}
    with _served(llm) as url:
        shown = {path: httpx.get(_root(url) + path, headers=auth).status_code
                 for path in ("/docs", "/redoc", "/openapi.json")}
    with _served(llm, disable_fastapi_docs=True) as url:
        hidden = {path: httpx.get(_root(url) + path, headers=auth).status_code
                  for path in ("/docs", "/redoc", "/openapi.json")}
    assert shown == dict.fromkeys(shown, 200)
    assert hidden == dict.fromkeys(hidden, 404)


def test_a_manifest_may_give_the_frontend_options_as_strings():
    """`serve run saguaro_dist.serve.app:build_app allowed_origins='["https://a"]' allow_credentials=true`."""
    args = {"model": "/m", "mode": "ar", "allowed_origins": '["https://a.example"]', "allow_credentials": "true",
            "root_path": "/llm", "disable_fastapi_docs": "yes"}
    config_from_args(args)  # frontend args are app args, not unknown ones
    assert frontend_options(args) == FrontendOptions(allowed_origins=("https://a.example",), allow_credentials=True,
                                                     root_path="/llm", disable_fastapi_docs=True)
    for bad, message in (({"allowed_origins": "https://a"}, "JSON list"), ({"allow_credentials": "maybe"}, "true or false"),
                         ({"root_path": "llm/"}, "start with '/'"), ({"allowed_headers": "[1]"}, "non-empty strings")):
        with pytest.raises(ValueError, match=message):
            frontend_options(bad)


def test_the_logging_flags_become_serves_logging_config():
    import argparse
    assert serve_logging_config(argparse.Namespace(uvicorn_log_level=None, disable_uvicorn_access_log=None)) is None
    assert serve_logging_config(argparse.Namespace(uvicorn_log_level="warning", disable_uvicorn_access_log=None)) == {
        "log_level": "WARNING"}
    assert serve_logging_config(argparse.Namespace(uvicorn_log_level="trace", disable_uvicorn_access_log=True)) == {
        "log_level": "DEBUG", "enable_access_log": False}
    from ray.serve.schema import LoggingConfig
    LoggingConfig(**serve_logging_config(argparse.Namespace(uvicorn_log_level="critical",
                                                            disable_uvicorn_access_log=True)))  # Serve takes it


def write_self_signed(folder) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1 (cryptography, else the openssl CLI, else skip)."""
    key, cert = folder / "key.pem", folder / "cert.pem"
    try:
        _with_cryptography(key, cert)
    except ImportError:
        if subprocess.run(["which", "openssl"], capture_output=True).returncode:
            pytest.skip("neither the cryptography package nor the openssl CLI is here to make a certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
    return str(key), str(cert)


def _with_cryptography(key_path, cert_path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


@pytest.mark.parametrize("flags, message", [
    (["--ssl-keyfile", "KEY"], "HTTPS needs both"),
    (["--ssl-keyfile", "KEY", "--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-certfile '/nonexistent/cert.pem': no such file"),
    (["--ssl-keyfile", "OTHER_KEY", "--ssl-certfile", "CERT"], "cannot load the certificate and key"),
    (["--root-path", "llm"], "root_path must start with '/'"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),  # vLLM's rule
])
def test_bad_frontend_flags_exit_2_before_ray_starts(flags, message, serving_pair, tmp_path, capsys):
    key, cert = write_self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    other_key, _ = write_self_signed(tmp_path / "other")  # a key that is not the certificate's
    flags = [{"KEY": key, "CERT": cert, "OTHER_KEY": other_key}.get(f, f) for f in flags]
    assert main(["serve", serving_pair[0], "--port", str(free_port()), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_cors_list_that_is_not_json_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--allowed-origins", "https://ui.example"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--allowed-origins must be a JSON list of strings" in err


@pytest.mark.slow
@pytest.mark.parametrize("ingress", ["direct", "proxy"])
def test_serve_answers_https_under_a_root_path_with_cors_on_either_ingress(ingress, serving_pair, tmp_path):
    """The real thing: `saguaro serve` with a self-signed certificate answers HTTPS (never plain HTTP) on
    --port, under --root-path, with CORS for the listed origin and no docs routes."""
    key, cert = write_self_signed(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from saguaro_dist.cli import main; sys.exit(main())", "serve",
           serving_pair[0], "--max-model-len", "128", "--port", str(port), "--num-cpus", "2", "--ingress", ingress,
           "--api-key", KEY, "--ssl-keyfile", key, "--ssl-certfile", cert, "--root-path", "/llm",
           "--allowed-origins", '["https://ui.example"]', "--disable-fastapi-docs",
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""})
    base = f"https://127.0.0.1:{port}"
    try:
        _wait_healthy(f"{base}/llm/health", cert, proc)
        with httpx.Client(verify=_trusting(cert), timeout=60) as client:
            models = client.get(f"{base}/llm/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            pre = client.options(f"{base}/llm/v1/completions", headers=PREFLIGHT)
            docs = client.get(f"{base}/llm/docs", headers={"Authorization": f"Bearer {KEY}"})
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/llm/health", timeout=5)  # no plain HTTP on the port
    finally:
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=90)[0]
    assert models.status_code == 200 and models.json()["data"], models.text
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ui.example"
    assert docs.status_code == 404
    assert f"at https://127.0.0.1:{port}/v1 ({ingress} ingress;" in output, output[-3000:]
    assert proc.returncode == 0 and "Traceback" not in output, output[-3000:]


def _trusting(cert: str):
    import ssl
    return ssl.create_default_context(cafile=cert)


def _wait_healthy(url: str, cert: str, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"saguaro serve exited early:\n{proc.communicate()[0][-3000:]}")
        try:
            if httpx.get(url, timeout=2, verify=_trusting(cert)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError("saguaro serve did not become healthy over HTTPS in time")


def test_an_encrypted_key_is_refused_without_asking_for_its_pass_phrase(tmp_path):
    """The check loaded the key with no password callback: OpenSSL asked for the pass phrase on the terminal,
    and a typed one passed a key Serve's proxies (given no pass phrase) cannot open."""
    from saguaro_dist.cli.frontend_flags import _check_key_pair
    if subprocess.run(["which", "openssl"], capture_output=True).returncode:
        pytest.skip("the openssl CLI makes the encrypted key")
    key, cert = tmp_path / "enc.key", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-passout", "pass:secret"], check=True, capture_output=True)
    with pytest.raises(ValueError, match="is encrypted"):
        _check_key_pair(str(key), str(cert))
