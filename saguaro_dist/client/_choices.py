"""Which choices a streamed request must finish: a stream that ends without [DONE] is whole only if every one did.
Counting only the choices seen missed a stream cut (cleanly: a proxy, a server's early end) after choice 0 finished
and before choice 1 sent anything: the caller got n - 1 choices and no error."""
from __future__ import annotations


def expected_choices(body: dict) -> int | None:
    """How many choices a generation request's stream carries: n per prompt (a chat has one prompt; a completion's
    prompt is a string, a token list, or a list of either). None where the request does not say plainly."""
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None  # (the server refuses it, or it is no count)
    prompts = 1 if "messages" in body else _prompt_count(body.get("prompt"))
    return None if prompts is None else n * prompts


def _prompt_count(prompt) -> int | None:
    if isinstance(prompt, str):
        return 1
    if not isinstance(prompt, list) or not prompt:
        return None  # (prompt_embeds and other prompts of vLLM's: not counted)
    return 1 if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt) else len(prompt)


def missing_choices(expected: int | None, seen, unfinished: set[int]) -> str | None:
    """What a stream that ended without [DONE] lacks ("choice 0 unfinished; choices 1, 2 of 3 never began"), or
    None where every choice it should carry finished."""
    never = sorted(set(range(expected or 0)) - set(seen))
    parts = []
    if unfinished:
        parts.append(f"{_choices_named(sorted(unfinished))} unfinished")
    if never:
        parts.append(f"{_choices_named(never)} of {expected} never began")
    return "; ".join(parts) or None


def _choices_named(indices: list[int]) -> str:
    shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
    return f"choice{'s' if len(indices) > 1 else ''} {shown}"
