"""Command-line front end shared by the entry points: a bad command line ends in one clear line, never a traceback.

``cli.run(main)`` replaces ``absl.app.run(main)``: flags are parsed by :func:`parse_flags`, and ``app.UsageError``
(or any exception type listed in ``errors``) raised by ``main`` is printed as ``error: ...`` on stderr with exit
status 2. For ``ml_collections`` config-file flags (``--config=FILE --config.a.b=v``) a missing file, an unknown key
(with the closest known ones) and a value of the wrong type are each reported against the flag that caused them.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import app, flags
from ml_collections.config_flags import config_flags as _config_flags

__all__ = ["EXIT_USAGE", "explain_flag_error", "fail", "parse_flags", "run"]

EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` (one line) on stderr and exit with ``code``."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(code)


def _closest(word: str, options: Sequence[str]) -> str:
    """``did you mean 'a' or 'b'? `` for the options closest to ``word`` ('' when none is close)."""
    close = difflib.get_close_matches(word, list(options), n=3, cutoff=0.5)
    return f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""


def _a(kind: str) -> str:
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def _config_file_flags(flag_values) -> list[str]:
    """Names of the ``DEFINE_config_file`` flags."""
    out = []
    for name in list(flag_values):
        flag = flag_values[name]
        if name == flag.name and isinstance(flag.parser, _config_flags.ConfigFileFlagParser):
            out.append(name)
    return out


def _config_value(flag_name: str, argv: Sequence[str]) -> str | None:
    """The value ``FILE[:arg]`` of ``--flag_name=FILE[:arg]`` (or ``--flag_name FILE``) in argv; None when absent."""
    for i, a in enumerate(argv):
        m = re.match(rf"^--?{re.escape(flag_name)}(=(.*))?$", a)
        if m:
            return m.group(2) if m.group(1) else (argv[i + 1] if i + 1 < len(argv) else "")
    return None


def _missing_file(flag_name: str, path: str) -> str:
    folder = os.path.dirname(path) or "."
    others = sorted(f for f in os.listdir(folder) if f.endswith(".py")) if os.path.isdir(folder) else []
    hint = _closest(os.path.basename(path), others)
    where = f"the .py files in {folder}/ are {others}" if others else f"{folder}/ has no .py files"
    return f"--{flag_name}={path}: no such config file (relative to {os.getcwd()}); {hint}{where}"


def _overrides(flag_name: str, argv: Sequence[str]) -> list[tuple[str, str, str | None]]:
    """``(argument, dotted key, value or None)`` of every ``--flag_name.a.b[=v]`` override."""
    out = []
    for a in argv:
        m = re.match(rf"^--?(?:no)?{re.escape(flag_name)}\.([^=]+)(?:=(.*))?$", a)
        if m:
            out.append((a, m.group(1), m.group(2)))
    return out


def _check_override(flag_name: str, config: Any, key: str) -> tuple[str | None, Any]:
    """(error naming the first unknown part of ``key``, None) or (None, the default value at ``key``)."""
    node, done = config, flag_name
    for part in key.split("."):
        keys = list(node.keys()) if hasattr(node, "keys") else None
        if keys is None:
            return f"{done} is {_a(type(node).__name__)} value, not a block: it has no key {part!r}", None
        if part not in keys:
            return f"{done} has no key {part!r}; {_closest(part, keys)}known keys: {sorted(keys)}", None
        node, done = node[part], f"{done}.{part}"
    return None, node


def explain_flag_error(error: BaseException, argv: Sequence[str], flag_values=flags.FLAGS) -> str:
    """One line explaining why ``flag_values(argv)`` raised ``error``."""
    text = " ".join(str(error).split()) or type(error).__name__
    for name in _config_file_flags(flag_values):
        value = _config_value(name, argv)
        if value is None:
            continue
        path = value.split(":", 1)[0]
        try:  # the file as the flag loads it, without the overrides (a load failure raises on first access)
            config = _config_flags.ConfigFileFlagParser(name, lock_config=False).parse(value)
            getattr(config, "keys", None)
        except Exception as e:
            return f"--{name}={path}: cannot load the config file: {' '.join(str(e).split())[:500]}"
        for arg, key, _ in _overrides(name, argv):
            problem, default = _check_override(name, config, key)
            if problem:
                return f"{arg.split('=', 1)[0]}: {problem}"
            if f"--{name}.{key}=" in text or f"--{name}.{key}:" in text:
                what = _a(type(default).__name__)
                if not hasattr(default, "keys"):
                    what += f", default {default!r}"
                return f"{arg}: {text.split(': ', 1)[-1]} ({name}.{key} is {what})"
    m = re.search(r"Unknown command line flag '([^']+)'", text)
    if m:
        return f"--{m.group(1)}: unknown flag; {_closest(m.group(1), list(flag_values))}see --helpfull"
    return text


def parse_flags(argv: Sequence[str], flag_values=flags.FLAGS) -> list[str]:
    """``absl`` flag parsing (an ``app.run`` flags_parser) that turns every failure into one line via :func:`fail`."""
    for name in _config_file_flags(flag_values):
        value = _config_value(name, argv)
        if value is not None and not os.path.isfile(value.split(":", 1)[0]):
            fail(_missing_file(name, value.split(":", 1)[0]))
    try:
        return flag_values(list(argv))
    except Exception as e:  # flags.Error, or KeyError / AttributeError from a config override
        fail(explain_flag_error(e, argv, flag_values))


def run(main: Callable[[list[str]], Any], *, errors: tuple[type[BaseException], ...] = ()) -> None:
    """``app.run(main)`` with one-line errors for bad flags, ``app.UsageError`` and the listed exception types."""

    def wrapped(argv):
        try:
            return main(argv)
        except (app.UsageError, *errors) as e:
            fail(str(e))

    app.run(wrapped, flags_parser=parse_flags)
