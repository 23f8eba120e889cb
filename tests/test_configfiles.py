"""Configs that compose (deqscore.configfiles): a base's options overridden key by key, lists replaced whole, and
every composing config in configs/ meaning what it did when written out in full (its printed config is checked
against the saved run config by tests/lightning/test_families.py)."""

import pytest
import yaml

from deqscore.cli.train import run
from deqscore.configfiles import ConfigFileError, composed_text, is_base, load_config
from deqscore.families import ROOT


def write(path, content):
    path.write_text(yaml.safe_dump(content))
    return path


def test_a_config_overrides_its_bases_key_by_key_and_replaces_lists(tmp_path):
    write(tmp_path / "_a.yaml", {"trainer": {"max_epochs": 10, "callbacks": [1, 2]}, "seed_everything": 1})
    write(tmp_path / "_b.yaml", {"base": "_a.yaml", "trainer": {"log_every_n_steps": 5}})
    run_config = write(tmp_path / "run.yaml", {"base": ["_b.yaml"], "trainer": {"max_epochs": 2, "callbacks": [3]},
                                               "model": {"init_args": {"x": 1}, "class_path": "m.M"}})
    assert load_config(run_config) == {"trainer": {"max_epochs": 2, "callbacks": [3], "log_every_n_steps": 5},
                                       "seed_everything": 1, "model": {"class_path": "m.M", "init_args": {"x": 1}}}
    assert list(load_config(run_config)["model"]) == ["class_path", "init_args"]  # as configs write it
    assert yaml.safe_load(composed_text(run_config)) == load_config(run_config)


@pytest.mark.parametrize(("files", "message"), [
    ({"run.yaml": {"base": "_missing.yaml"}}, "its base _missing.yaml is not a file"),
    ({"run.yaml": {"base": "_a.yaml"}, "_a.yaml": {"base": "run.yaml"}}, "its bases name it again"),
    ({"run.yaml": {"base": "_a.yaml"}, "_a.yaml": ["not", "a", "mapping"]}, "the file is a YAML list"),
])
def test_a_base_that_cannot_be_composed_is_one_line_naming_the_file(tmp_path, capsys, files, message):
    for name, content in files.items():
        write(tmp_path / name, content)
    with pytest.raises(ConfigFileError, match=message):
        load_config(tmp_path / "run.yaml")
    assert run(["fit", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_the_shipped_bases_compose_and_are_never_run_alone():
    bases = [p for p in (ROOT / "configs").rglob("*.yaml") if is_base(p)]
    assert len(bases) >= 5
    composing = [p for p in (ROOT / "configs").rglob("*.yaml") if not is_base(p) and "base" in yaml.safe_load(
        p.read_text())]
    assert len(composing) >= 20
    for path in composing:
        config = load_config(path)
        assert {"model", "data", "trainer"} <= set(config) and "base" not in config, path
