"""The README's Python example runs as written and prints the guarantee it promises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


@pytest.mark.slow
def test_readme_example_trains_privately_and_prints_epsilon(capsys):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    engine = namespace["engine"]
    assert 0.99 * 3.0 <= engine.epsilon() <= 3.0
    assert f"ε = {engine.epsilon():.4g}" in printed
    assert engine.steps == 10 * round(1797 / 128)


def test_readme_python_examples_do_not_teach_a_seed_for_a_private_run():
    examples = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert examples and all("seed" not in code for code in examples)
