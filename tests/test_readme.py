"""The README's Python snippets, run in order as one script (they share their imports), on the reference path."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_snippets_run(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    with open(README) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert len(blocks) >= 4, "the README lost its code examples"
    monkeypatch.chdir(tmp_path)  # the Hugging Face snippet saves a model directory
    exec(compile("\n".join(blocks), README, "exec"), {"__name__": "readme"})
    assert (tmp_path / "gpt2-small-run" / "config.json").exists()
