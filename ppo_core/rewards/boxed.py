"""The final answer of a MATH-style response: the content of its last ``\\boxed{...}`` (or ``\\fbox{...}``).

Rules: braces nest (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); only top-level boxes count and the last
one wins; a box whose content is itself a single box is unwrapped (``\\boxed{\\boxed{3}}`` gives ``3``); the
brace-less form ``\\boxed 5`` reads up to the next space or ``$``; a response whose last box is never closed
(typically cut by the length limit) has no answer, even if an earlier box was complete.
"""

from __future__ import annotations

import re

__all__ = ["boxed_contents", "last_boxed_answer"]

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _closing_brace(text: str, open_at: int) -> int | None:
    """Index of the ``}`` matching the ``{`` at ``open_at`` (escaped ``\\{`` / ``\\}`` do not count)."""
    depth = 0
    i = open_at
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # an escaped character (\{, \}, \\) never opens or closes a group
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def boxed_contents(text: str) -> tuple[list[str], bool]:
    """Contents of the top-level boxes of ``text`` in order, and whether the last box is unclosed.

    Example:
        >>> boxed_contents(r"\\boxed{1} then \\fbox{\\frac{2}{3}} and \\boxed 4$")
        (['1', '\\\\frac{2}{3}', '4'], False)
        >>> boxed_contents(r"\\boxed{1} \\boxed{2")
        (['1'], True)
    """
    out: list[str] = []
    pos = 0
    while True:
        match = _BOX_RE.search(text, pos)
        if match is None:
            return out, False
        k = match.end()
        while k < len(text) and text[k] == " ":
            k += 1
        if k < len(text) and text[k] == "{":
            close = _closing_brace(text, k)
            if close is None:
                return out, True
            out.append(text[k + 1 : close])
            pos = close + 1
        elif k > match.end():
            word = re.match(r"[^\s$]+", text[k:])
            if word is None:
                return out, True
            out.append(word.group(0))
            pos = k + word.end()
        else:
            pos = match.end()


def last_boxed_answer(text: str) -> str | None:
    """The stripped content of the last top-level box of ``text`` (see the module rules); None if empty or absent.

    Example:
        >>> last_boxed_answer(r"First \\boxed{2}, finally $\\boxed{\\frac{1}{\\sqrt{2}}}$.")
        '\\\\frac{1}{\\\\sqrt{2}}'
        >>> last_boxed_answer("no box") is None, last_boxed_answer(r"\\boxed{\\boxed{3}}")
        (True, '3')
    """
    contents, unclosed = boxed_contents(text)
    if unclosed or not contents:
        return None
    answer = contents[-1].strip()
    while True:
        inner, inner_unclosed = boxed_contents(answer)
        match = _BOX_RE.match(answer)
        if match is None or inner_unclosed or len(inner) != 1:
            return answer or None
        # unwrap only when the whole answer is one box: "\boxed{3}" but not "\boxed{3} + 1"
        rebuilt = answer[match.end() :].strip()
        if not (
            rebuilt.startswith("{")
            and rebuilt.endswith("}")
            and _closing_brace(rebuilt, 0) == len(rebuilt) - 1
        ):
            return answer or None
        answer = inner[0].strip()
