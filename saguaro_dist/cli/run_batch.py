"""`saguaro run-batch -i requests.jsonl -o results.jsonl`: offline batch inference in OpenAI's batch file
format (vLLM's run_batch), on an engine of its own (serve/batch.py)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Iterator

from saguaro_dist.cli.flag_checks import check_url, refuse_with_url, refuse_without
from saguaro_dist.cli.serve import CHAT_TEMPLATE_HELP, ENGINE_FLAGS, add_engine_args, engine_args, generation_defaults
from saguaro_dist.cli.stdout import stdout_to_devnull
from saguaro_dist.serve.args import API_KEY_ENV, served_model_names
from saguaro_dist.serve.batch import app_client, run_batch, server_client
from saguaro_dist.serve.reasoning import ReasoningParser
from saguaro_dist.serve.tool_parsers import ToolCallParser

LOCAL_APP_FLAGS = ("served_model_name", "tool_call_parser", "reasoning_parser", "chat_template")  # the app run here
# The in-process app takes lines of any size, as vLLM's run_batch: serve's 1 MiB cap guards a server from its
# clients, and a long prompt (non-ASCII text goes escaped, 6 bytes a character) was a 413 no flag here could lift.
NO_BODY_LIMIT = sys.maxsize


def register(subparsers) -> None:
    p = subparsers.add_parser("run-batch", help="run a JSONL file of OpenAI requests (OpenAI's batch format)",
                              description="Answer each line of INPUT ({custom_id, method: POST, url: "
                                          "/v1/chat/completions, /v1/completions or /v1/responses, body}) with the serving app "
                                          "in-process, writing one result line each to OUTPUT, in input order.")
    g = p.add_argument_group("batch")
    g.add_argument("-i", "--input-file", required=True, help="requests, one JSON object a line ('-': stdin)")
    g.add_argument("-o", "--output-file", required=True, help="results, one JSON object a line ('-': stdout)")
    g.add_argument("--max-in-flight", type=int, default=256,
                   help="requests handed to the engine at once (default 256; the engine batches up to "
                        "--max-batch-size of them, the rest wait in its queue)")
    g.add_argument("--served-model-name", nargs="+", help="the model name(s) request bodies may give (default: "
                                                          "the model path)")
    g.add_argument("--tool-call-parser", choices=[p.value for p in ToolCallParser], help="as for `saguaro serve`")
    g.add_argument("--reasoning-parser", choices=[p.value for p in ReasoningParser], help="as for `saguaro serve`")
    g.add_argument("--chat-template", help=CHAT_TEMPLATE_HELP)
    g.add_argument("--url", help="send the lines to this running server (say a RayService) instead of loading "
                                 "the model here; the engine and serving flags are then its business (refused here)")
    g.add_argument("--api-key", help=f"the server's key with --url (default: ${API_KEY_ENV} if set)")
    add_engine_args(p, engine_seed=True)
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from saguaro_dist import LLM
    from saguaro_dist.serve.args import config_from_args

    _check_files(ns)
    _check_flags(ns)
    if ns.url:
        return _batch(ns, server_client(ns.url, ns.api_key or os.environ.get(API_KEY_ENV)))
    else:
        from saguaro_dist.serve.prompts import load_chat_template
        template = load_chat_template(ns.chat_template) if ns.chat_template else None
        config = config_from_args(engine_args(ns))
        served_model_names(ns.served_model_name, config.model)  # bad names and generation configs: before the model loads
        generation_defaults(config)
        with LLM.from_config(config) as llm:  # before the output file is opened
            return _batch(ns, app_client(_app(llm, ns, template)))


def _check_flags(ns: argparse.Namespace) -> None:
    """Flags this run would leave unused: the key without --url; with it, the engine's and the serving app's
    (the server answers the lines with its own)."""
    refuse_without(ns, ("api_key",), "url")
    refuse_with_url(ns, ["model_tag", *ENGINE_FLAGS, *LOCAL_APP_FLAGS], "the server answers with its own engine and options")


def _batch(ns: argparse.Namespace, client) -> int:
    """Run the batch and say how it went: 0, or 1 where the output could not be written (a full disk, a
    closed pipe: that ended in a stack trace)."""
    with _Output(ns.output_file) as output:
        try:
            summary = asyncio.run(run_batch(client, _lines(ns.input_file), output.write, ns.max_in_flight))
        except OSError as err:
            if err is not output.error:
                raise
            # a reader that went away (`-o - | head`) is no error to report: Unix tools stop without a word
            if not isinstance(err, BrokenPipeError):
                sys.stderr.write(f"saguaro run-batch: error: writing the output stopped after {output.written} "
                                 f"records: {err}\n")
            return 1
    sys.stderr.write(f"saguaro run-batch: {summary.requests} requests, {summary.failed} failed, "
                     f"{summary.completion_tokens} tokens generated in {summary.seconds:.1f} s\n")
    return 0


def _app(llm, ns: argparse.Namespace, template: str | None):
    """The serving app over this process's engine, with the serving flags given."""
    from saguaro_dist.serve.api import ServerOptions, create_app

    names = served_model_names(ns.served_model_name, llm.config.model)
    return create_app(llm, ServerOptions(served_model_name=names[0], model_aliases=names[1:],
                                         tool_call_parser=ns.tool_call_parser, reasoning_parser=ns.reasoning_parser,
                                         chat_template=template, max_request_bytes=NO_BODY_LIMIT))


def _check_files(ns: argparse.Namespace) -> None:
    """Before any model loads: the input exists, the output can be written and will not overwrite the input,
    and --url names a server (each of these used to surface only after the model had loaded, or line by line)."""
    if ns.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {ns.max_in_flight}")
    check_url(ns.url)
    if ns.input_file == "-" and sys.stdin is None:  # started with stdin closed (`<&-`): Python sets it to None
        raise ValueError("input file '-' is stdin, which is closed")
    if ns.output_file == "-" and sys.stdout is None:  # `>&-`: each record's write was an AttributeError's trace
        raise ValueError("output file '-' is stdout, which is closed")
    # a pipe is an input too (`-i <(...)`, /dev/stdin): isfile refused it as "does not exist"
    if ns.input_file != "-" and (os.path.isdir(ns.input_file) or not os.path.exists(ns.input_file)):
        raise ValueError(f"input file {ns.input_file!r} " + ("is a folder" if os.path.isdir(ns.input_file)
                                                             else "does not exist" + _url_hint(ns.input_file)))
    if ns.input_file != "-" and not os.access(ns.input_file, os.R_OK):  # the reader thread opens it
        raise ValueError(f"input file {ns.input_file!r} is not readable")
    if ns.output_file != "-":
        _check_writable(ns.output_file)
    if _output_is_input(ns.input_file, ns.output_file):
        raise ValueError("the output file would overwrite the input file"
                         + (" (stdin reads from it)" if ns.input_file == "-" else ""))


def _url_hint(path: str) -> str:
    """vLLM's run_batch fetches an http(s) input; here it is a file name that does not exist, said so."""
    if not path.startswith(("http://", "https://")):
        return ""
    return " (a URL is not fetched here: download it first, or pipe it in: curl -sSf URL | saguaro run-batch -i - ...)"


def _output_is_input(input_file: str, output_file: str) -> bool:
    """Whether opening the output would truncate the input before it is read: the same regular file, named
    or as stdin (`-i - < F -o F` lost every request and reported success)."""
    if output_file == "-" or not os.path.isfile(output_file):  # a terminal or a pipe is not truncated
        return False
    if input_file != "-":
        return os.path.samefile(input_file, output_file)
    try:
        return os.path.samestat(os.fstat(sys.stdin.fileno()), os.stat(output_file))
    except (OSError, ValueError):  # a stdin without a file behind it (closed, or in-memory)
        return False


def _check_writable(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"output file {path!r} is in a folder that does not exist")
    if os.path.isdir(path):
        raise ValueError(f"output file {path!r} is a folder")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise ValueError(f"output file {path!r} is not writable")


def _lines(path: str) -> Iterator[bytes]:
    """The input's lines as bytes (each is decoded on its own, so one bad line is that line's error), read by
    run_batch's reader thread, which opens the file and closes it. os.read, not a buffered file: a thread
    blocked in one (an open stdin at Ctrl-C) held its lock, and closing it hung or aborted the interpreter."""
    if path != "-":
        fd = os.open(path, os.O_RDONLY)
        try:
            yield from _fd_lines(fd)
        finally:
            os.close(fd)
        return
    try:
        fd = sys.stdin.fileno()
    except (OSError, ValueError):  # a stdin without a file descriptor (in-memory)
        yield from sys.stdin.buffer
        return
    yield from _fd_lines(fd)


def _fd_lines(fd: int) -> Iterator[bytes]:
    """Each line as it arrives (a pipe's too), with its line break; the last may lack one."""
    pending: list[bytes] = []  # the line so far, in pieces: joined once, however many reads it took
    while chunk := os.read(fd, 1 << 16):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            yield b"".join([*pending, chunk[start:end + 1]])
            pending, start = [], end + 1
        if start < len(chunk):
            pending.append(chunk[start:])
    if pending:
        yield b"".join(pending)


class _Output:
    """write(record): one JSON line, flushed, so a long batch's finished results are on disk as they come.
    Counts the records written, and keeps the error that stopped writing."""

    def __init__(self, path: str):
        self.is_stdout = path == "-"
        self.file = sys.stdout if self.is_stdout else open(path, "w", encoding="utf-8")
        self.written, self.error = 0, None

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as err:
            self.error = err
            raise
        self.written += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if not self.is_stdout:
            try:
                self.file.close()
            except OSError:  # flushing what failed to write fails again; the error is reported already
                if self.error is None:
                    raise
        elif self.error is not None:  # what stdout holds can never go out: the interpreter's flush at exit
            stdout_to_devnull()  # would print its own error

