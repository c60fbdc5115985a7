"""Bad command lines of the entry points: one short line on stderr naming the problem and the fix, exit status 2."""

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _fails_in_one_line(module, *args):
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, expect",
    [
        (
            ["--config=configs/tiny.py", "--config.rollout.top_kk=1"],
            ["--config.rollout.top_kk", "config.rollout has no key 'top_kk'", "did you mean 'top_k'", "top_p"],
        ),
        (["--config=configs/tiny.py", "--config.bogus.x=1"], ["config has no key 'bogus'", "keys: ['checkpoint'"]),
        (
            ["--config=configs/tiny.py", "--config.rollout.top_k=abc"],
            ["--config.rollout.top_k=abc", "'abc'", "config.rollout.top_k is an int, default 0"],
        ),
        (["--config=configs/nonexist.py"], ["--config=configs/nonexist.py: no such config file", "'tiny.py'"]),
        (["--config=configs/tny.py"], ["did you mean 'tiny.py'"]),
        (["--config=configs/tiny.py", "stray"], ["unexpected arguments ['stray']"]),
        ([], ["--config=configs/<name>.py is required"]),
    ],
)
def test_main_bad_command_lines(args, expect):
    line = _fails_in_one_line("tlt_jax.main", *args, "--workdir=/nonexistent/never-created")
    for e in expect:
        assert e in line, line


def test_generate_bad_command_lines():
    line = _fails_in_one_line("tlt_jax.generate", "--max_new_tokens=many")
    assert "--max_new_tokens=many" in line and "int" in line, line
    line = _fails_in_one_line("tlt_jax.generate", "--num_sample=2")
    assert "--num_sample" in line and "num_samples" in line, line
    line = _fails_in_one_line("tlt_jax.generate", "--num_samples=0")
    assert "--num_samples=0" in line and "positive" in line, line
    line = _fails_in_one_line("tlt_jax.generate", "--dtype=float16")
    assert "--dtype" in line and "bfloat16" in line, line
