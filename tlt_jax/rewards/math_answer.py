"""GSM8K-style answer extraction and exact-match scoring.

The final answer of a completion is, in order of preference: the first number after the last ``####``, the last
number inside the last ``\\boxed{...}``, else the last number in the text. Numbers are compared by value, so
``1,234`` == ``1234.0``, ``0.50`` == ``.5`` and ``3/4`` == ``0.75``.
"""

from __future__ import annotations

import math
import re

__all__ = ["extract_answer", "has_answer_statement", "parse_number", "score_gsm8k"]

# A number not glued to a preceding word character or dot (so "10-5" is 10 and 5, "x2" has no number):
# a fraction, an integer with optional thousands separators and decimals, or a bare decimal like ".5".
_NUMBER = re.compile(
    r"""(?<![\w.])(?:
        -?\d+/\d+(?![\d/])
      | -?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?
      | -?\.\d+
    )""",
    re.VERBOSE,
)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2014": "-"})
_BOXED_PREFIXES = ("\\boxed", "\\fbox")
# An explicit final-answer statement: "answer is" (then at most a few non-digit characters, as in "The answer is
# N = 42"), "####" or a box, followed by a number.
_STATEMENT = re.compile(r"(?:\banswer\s+is\b[^\d\n]{0,8}|####\s*|\\boxed\s*\{\s*)-?\$?\.?\d", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``), braces balanced."""
    start, prefix = max((text.rfind(p), p) for p in _BOXED_PREFIXES)
    if start < 0:
        return None
    rest = text[start + len(prefix) :]
    if not rest.startswith("{"):
        bare = rest.split()
        return bare[0].rstrip("$.") if rest[:1].isspace() and bare else None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced: the completion was cut off inside the box


def _clean_latex(s: str) -> str:
    """Rewrite the LaTeX that commonly wraps numbers in boxed answers into plain text."""
    s = _LATEX_TEXT.sub(r" \1 ", s)
    s = _LATEX_FRAC.sub(r"\1/\2", s)
    for old, new in (
        ("{,}", ","),
        ("\\,", ""),
        ("\\!", ""),
        ("\\%", "%"),
        ("\\$", "$"),
        ("\\left", ""),
        ("\\right", ""),
    ):
        s = s.replace(old, new)
    return s


def extract_answer(text: str) -> str | None:
    """The final-answer number of ``text`` as written (e.g. ``"1,234"``, ``"-3/4"``, ``".5"``), or None."""
    text = text.translate(_MINUS_SIGNS)
    if "####" in text:
        found = _NUMBER.search(text.rsplit("####", 1)[1])
        return found.group(0) if found else None
    boxed = _last_boxed(text)
    if boxed is not None:
        numbers = _NUMBER.findall(_clean_latex(boxed))
        return numbers[-1] if numbers else None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(s: str) -> float | None:
    """Value of a number string as returned by :func:`extract_answer` (commas dropped, ``a/b`` divided)."""
    s = s.replace(",", "").strip()
    try:
        if "/" in s:
            num, den = s.split("/")
            return float(num) / float(den) if float(den) != 0 else None
        return float(s)
    except ValueError:
        return None


def has_answer_statement(completion: str) -> bool:
    """Whether the completion states its final answer explicitly ("The answer is 42.", "#### 42", "\\boxed{42}"):
    the format part of a format + correctness reward, right or wrong."""
    return _STATEMENT.search(completion.translate(_MINUS_SIGNS)) is not None


def score_gsm8k(completion: str, ground_truth: str) -> float:
    """1.0 if the completion's final answer equals the ground truth's number, else 0.0.

    ``ground_truth`` is a GSM8K answer (worked solution ending in ``#### N``) or a bare number; a ground truth
    without any number is a data error and raises ValueError.
    """
    gt_text = extract_answer(ground_truth)
    expected = parse_number(gt_text) if gt_text is not None else None
    if expected is None:
        raise ValueError(f"ground truth has no number: {ground_truth!r}")
    answer = extract_answer(completion)
    value = parse_number(answer) if answer is not None else None
    if value is None:
        return 0.0
    return 1.0 if math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-6) else 0.0
