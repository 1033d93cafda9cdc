"""docs/models.md's configs run as written (fewer steps): its Python files written beside them."""

import re

import pytest
from helpers import ROOT, final_weights, write_config

pytest.importorskip("transformers")

BLOCKS = re.findall(r"```(toml|python)\n# (\S+)\n(.*?)```", (ROOT / "docs" / "models.md").read_text(), re.S)
CONFIGS = [name for kind, name, _ in BLOCKS if kind == "toml"]


def test_the_page_holds_its_three_jobs():
    assert CONFIGS == ["llama.toml", "bert.toml", "bn_cnn.toml"]


@pytest.mark.parametrize("config", CONFIGS)
def test_docs_config_runs(tmp_path, gang, config):
    for _, name, text in BLOCKS:
        write_config(tmp_path / name, text)
    gang(2).train(tmp_path / config, tmp_path / "run", ["train.steps=3"])
    assert final_weights(tmp_path / "run")
