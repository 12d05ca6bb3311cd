"""lsmini.config: one place for the user-facing settings, checked values, blocks that restore what they found,
the environment's starting value, and torch.compile following a change."""
import os
import subprocess
import sys

import pytest
import torch

import lsmini
from lsmini import _backend
from lsmini.ops import layer_norm


def test_settings_and_their_defaults():
    assert repr(lsmini.config) == "lsmini.config(reference=False, attention_dropout_bits='auto')"


def test_override_restores_on_exit_and_on_error():
    with lsmini.config.override(reference=True, attention_dropout_bits="never") as c:
        assert c is lsmini.config and lsmini.config.reference and lsmini.config.attention_dropout_bits == "never"
        assert _backend.force_reference() and lsmini.backend() == "reference"
        assert "lsmini.config.reference" in lsmini.backend().reason
        with lsmini.config.override(attention_dropout_bits="always"):
            assert lsmini.config.attention_dropout_bits == "always"
        assert lsmini.config.attention_dropout_bits == "never"
    assert not lsmini.config.reference and lsmini.config.attention_dropout_bits == "auto"
    with pytest.raises(KeyError):
        with lsmini.config.override(reference=True):
            raise KeyError("inside")
    assert not lsmini.config.reference


def test_bad_names_and_values_raise_and_change_nothing():
    with pytest.raises(AttributeError, match="no setting 'refrence'; the settings are"):
        lsmini.config.refrence = True
    with pytest.raises(TypeError, match="reference must be True or False, got 1"):
        lsmini.config.reference = 1
    with pytest.raises(ValueError, match=r"must be one of \('auto', 'always', 'never'\), got 'on'"):
        lsmini.config.attention_dropout_bits = "on"
    with pytest.raises(ValueError, match="got 'on'"):
        with lsmini.config.override(reference=True, attention_dropout_bits="on"):
            pass
    with pytest.raises(AttributeError, match="no setting 'x'"):
        with lsmini.config.override(x=1):
            pass
    assert repr(lsmini.config) == "lsmini.config(reference=False, attention_dropout_bits='auto')"


def test_setting_persists_until_set_back(monkeypatch):
    monkeypatch.setattr(lsmini.config, "reference", True)
    assert lsmini.config.reference and _backend.force_reference()


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False), ("", False)])
def test_environment_gives_the_starting_value(value, expected):
    env = {**os.environ, "LSMINI_FORCE_REFERENCE": value}
    out = subprocess.run([sys.executable, "-c", "import lsmini; print(lsmini.config.reference)"], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(expected)


def test_compiled_code_follows_a_change():
    # The compiled function reads the setting while tracing: its graph calls the registered operator, or the
    # reference's torch ops when the reference is forced; a change recompiles instead of running the path
    # chosen before, and changing back finds the first graph again.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    torch._dynamo.reset()
    f = torch.compile(lambda x: layer_norm(x, w, b), backend=backend, fullgraph=True)
    f(x)
    f(x)
    assert len(graphs) == 1 and "lsmini.layer_norm.default" in graphs[0]
    with lsmini.config.override(reference=True):
        torch.testing.assert_close(f(x), torch.nn.functional.layer_norm(x, (8,), w, b))
    assert len(graphs) == 2 and not any(t.startswith("lsmini.") for t in graphs[1])
    f(x)
    assert len(graphs) == 2
