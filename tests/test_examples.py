"""Every script in examples/ runs as a user runs it (from the repository root) and, where it compares with plain
greedy decoding, says the outputs are identical."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))


def test_examples_are_listed_in_their_readme():
    with open(os.path.join(ROOT, "examples", "README.md")) as f:
        listed = f.read()
    assert SCRIPTS and all(f"`{s}`" in listed for s in SCRIPTS), SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, os.path.join("examples", script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith("identical to plain")]
    assert all(line.endswith("True") for line in verdicts), verdicts
