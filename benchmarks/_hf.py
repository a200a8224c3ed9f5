"""The one way the benchmarks call Hugging Face ``generate`` as their reference, so that every comparison against it
configures it alike."""

from __future__ import annotations

from typing import Any


def hf_generate_kwargs(new_tokens: int, *, static: bool) -> dict[str, Any]:
    """``generate`` keywords that sample exactly ``new_tokens`` tokens a row at temperature 1 with no top-p/top-k
    and no EOS (every row does the same work as our engines'), with the static cache when ``static``."""
    kwargs: dict[str, Any] = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        pad_token_id=0,
        eos_token_id=None,
    )
    if static:
        kwargs["cache_implementation"] = "static"
    return kwargs
